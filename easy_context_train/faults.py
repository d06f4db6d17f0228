"""The faults a long run meets, each ending the run with one line and a distinct exit status (docs/faults.md).

| exit | fault | what is left |
|---|---|---|
| 75 | preempted: SIGTERM / SIGUSR1 on any rank | a checkpoint of the step just finished; rerun with ``--resume`` |
| 74 | a write of the run failed (metrics, run.json, a checkpoint, the final model: disk full, quota, read-only) | the previous checkpoint, intact and the latest |
| 0 | a signal after the final save | the finished model (one line says it is complete) |
| 4 | a rank died or hung (no progress for ``--collective-timeout``) | the last periodic checkpoint |
| 3 | out of GPU memory | the last periodic checkpoint; the line says what ``plan`` suggests |
| 2 / 1 | bad input / a non-finite loss (unchanged) | |

These are each worker's status; under ``accelerate launch`` / ``torchrun`` the launcher exits 1 and lists every
worker's status in its summary. ``Guard`` is created just before the training loop: it installs the preemption
handlers (``preempt.py``) and, with more than one rank, the heartbeat watchdog (``watchdog.py``).
``handle_fault`` (train.py's ``main``) turns the exception that ended ``train`` into the line and the status.
"""
from __future__ import annotations

import os
import re
import sys

from easy_context.phase import TRACKER
from .checkpoint import injected, latest_checkpoint
from .leave import PROG, _leave
from .preempt import Preemption
from .watchdog import EXIT_LOST_RANK, Watchdog
from .writes import WriteError

EXIT_PREEMPTED, EXIT_CHECKPOINT_WRITE, EXIT_OOM = 75, WriteError.code, 3
WRITE_FAILED = 1000  # in the per-step agreement: above every signal number
WRITE_REASON = "write failed"  # a rank's exit reason in the heartbeat store (its peers then exit 74 quietly)
_active: list = []  # the Guard of this process (handle_fault reads it; per process, not a process group)


class Guard:
    def __init__(self, args, accelerator, model=None):
        self.args, self.accelerator = args, accelerator
        from .op_build import stop
        stop()  # the start-up (and DeepSpeed's op builds) is over
        self.preemption = Preemption()
        world = accelerator.num_processes
        self.watchdog = Watchdog(accelerator.process_index, world, args.timeout, PROG) if world > 1 else None
        if self.watchdog:
            from easy_context.phase import tick
            layers = [m for m in (model.modules() if model is not None else ())
                      if type(m).__name__.endswith("DecoderLayer")]
            for m in layers:  # recomputed in backward under checkpointing
                m.register_forward_pre_hook(tick)
            if layers and os.environ.get("EASY_CONTEXT_CRASH", "").startswith("layer:"):  # test hook: die mid-step,
                from .checkpoint import crash_point  # the peers inside their (DeepSpeed's) collectives
                layers[-1].register_forward_pre_hook(lambda *_: crash_point("layer", TRACKER.step + 1))
            self.watchdog.arm()
        _active[:] = [self]

    def stop_requested(self, step: int, write_error: BaseException | None = None) -> bool:
        """At the end of optimizer step ``step`` (every rank): did any rank receive SIGTERM / SIGUSR1? A write that
        failed on a rank this step (``write_error``: the metrics log) rides on the same all-reduce: every rank raises
        (exit 74; the failing rank prints its line)."""
        if injected("oom", step):  # test hook: as if this step had run out of GPU memory
            import torch
            raise torch.OutOfMemoryError("CUDA out of memory (injected by EASY_CONTEXT_CRASH)")
        TRACKER.step = step
        if injected("sigterm", step):  # test hook: the signal reaches this rank only
            import signal
            os.kill(os.getpid(), signal.SIGTERM)
        self.signal = self.preemption.agreed(self.accelerator.device, WRITE_FAILED if write_error else 0)
        if self.signal >= WRITE_FAILED:
            raise write_error or WriteError("another rank could not write its file", local=False)
        if step >= self.args.max_train_steps and self.watchdog:
            self.watchdog.arm(False)  # the final save may take long; torch's own timeout still applies
        return self.signal != 0

    def exit_if(self, preempted: bool, step: int) -> None:
        """After the checkpoint of ``step``: say so (once), tear down cleanly, exit EXIT_PREEMPTED on every rank."""
        if not preempted:
            return
        import signal

        import torch.distributed as dist
        path = latest_checkpoint(self.args.output_dir)
        if self.accelerator.is_main_process:
            print(f"{PROG}: preempted ({signal.Signals(self.signal).name} received) after step {step}: "
                  f"checkpoint {path} written; rerun the same command with --resume to continue", file=sys.stderr,
                  flush=True)
        if self.watchdog:  # the signal handlers stay: a late SIGTERM (the launcher's) must not cut the teardown
            self.watchdog.close()
        self.accelerator.end_training()
        if dist.is_initialized():
            dist.destroy_process_group()
        _leave(None, "", None, EXIT_PREEMPTED)  # no interpreter teardown, where Python resets SIGTERM to fatal


    def complete(self, step: int) -> None:
        """After the final save (every rank): tear down and exit 0 without the interpreter's teardown, where Python
        puts SIGTERM back to fatal; a signal that arrived during or after the final save is acknowledged with one line
        (the model is complete: a scheduler must not requeue it; ``--resume`` on it does nothing)."""
        import torch.distributed as dist
        if injected("sigterm", "final"):  # test hook: the signal lands just after the final save
            import signal
            os.kill(os.getpid(), signal.SIGTERM)
        if self.watchdog:
            self.watchdog.close()
        self.accelerator.end_training()
        if dist.is_initialized():
            dist.destroy_process_group()
        got = self.preemption.received
        if got and self.accelerator.is_main_process:
            import signal
            print(f"{PROG}: {signal.Signals(got).name} received after the final save: the model in "
                  f"{self.args.output_dir} is complete (step {step}); exiting 0 (--resume on it does nothing)",
                  file=sys.stderr, flush=True)
        _leave(None, "", None, 0)


def handle_fault(e: BaseException, args) -> None:
    """train.py's ``main``: a fault this module knows becomes one line and its exit status; anything else
    is re-raised (a bug keeps its traceback)."""
    import torch
    import torch.distributed as dist
    guard = _active[0] if _active else None
    dog = guard.watchdog if guard else None
    rank = os.environ.get("RANK", "0")
    if isinstance(e, torch.OutOfMemoryError):
        _leave(dog, "out of memory", f"rank {rank}: " + oom_message(args, TRACKER.step), EXIT_OOM)
    if isinstance(e, WriteError):
        _leave(dog, WRITE_REASON, f"rank {rank}: {e}" if e.local else None, EXIT_CHECKPOINT_WRITE)
    theirs = failed_collective(e)  # a collective outside our phases (DeepSpeed's ZeRO-3 gathers / reduce-scatters)
    comm = isinstance(e, dist.DistError) or TRACKER.failed is not None or theirs is not None
    if dog is not None and comm and isinstance(e, RuntimeError):
        where = TRACKER.failed or theirs or TRACKER.last or "a collective"
        TRACKER.last = where  # the line says where this rank was
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0][:160]  # gloo: "[file:line] Read error ..."
        line, found = dog.lost_peer(f"a peer was lost during {where} ({first})")
        if found and any(p.get("exit") == WRITE_REASON for p in dog.peers().values()):
            _leave(dog, "lost a peer", None, EXIT_CHECKPOINT_WRITE)  # it said why (a failed write): 74, quietly
        if found:  # else no peer is missing: a bug in this rank, keep its traceback
            _leave(dog, "lost a peer", line, EXIT_LOST_RANK)
    raise e


_COMM_ERROR = re.compile(r"gloo|nccl|connection (closed|reset)|broken pipe|socket timeout|timed out|processgroup",
                         re.IGNORECASE)


def failed_collective(e: BaseException) -> str | None:
    """The torch.distributed call a communication error came from ("DeepSpeed's reduce_scatter_single"), or None
    when ``e`` is not one. gloo raises a plain RuntimeError ("[pair.cc:537] Read error ...: Connection reset by
    peer") from inside DeepSpeed's own collectives, which no ``phase`` of ours wraps."""
    import traceback
    err, seen = e, 0
    while err is not None and seen < 4:
        if isinstance(err, RuntimeError) and _COMM_ERROR.search(str(err)):
            frames = traceback.extract_tb(err.__traceback__)
            calls = [f.name for f in frames if f.filename.endswith("distributed_c10d.py")]
            if not calls:
                return None
            who = "DeepSpeed's " if any("/deepspeed/" in f.filename for f in frames) else ""
            return who + calls[-1]
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


# ------------------------------------------------------------------------------------------ out of memory
def oom_message(args, step: int) -> str:
    """The length, the options in use, and what ``python -m easy_context plan`` suggests for this shape."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    from easy_context.registry import get_mode
    sp = args.sp_size or (world if get_mode(args.parallel_mode).is_parallel else 1)
    opts = [f"--seq-length {args.seq_length}", f"--parallel_mode {args.parallel_mode}", f"sp {sp} x dp {world // sp}",
            f"--batch-size {args.batch_size}", f"--checkpointing {args.checkpointing}"
            + (" (raise --auto-margin)" if args.checkpointing == "auto" else ""),
            "--chunked-loss" if args.chunked_loss else "no --chunked-loss",
            "--tiled-mlp" if args.tiled_mlp else "no --tiled-mlp"]
    if args.ring_degree:
        opts.append(f"--ring_degree {args.ring_degree}")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        opts.append(f"DeepSpeed ZeRO-{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '?')}")
    cmd = (f"python -m easy_context plan --model {args.model} --seq-length {args.seq_length} --gpus {local}"
           + (f" --nodes {world // local}" if world > local else ""))
    import torch
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        opts.append(f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} of {total / 2**30:.0f} GiB allocated")
    return (f"out of GPU memory at step {step + 1} ({', '.join(opts)}); {plan_suggestion(args, world, local)} "
            f"(see: {cmd})")


def plan_suggestion(args, world: int, local: int) -> str:
    """The planner's best fitting candidate for this model, length and GPU count, as train.py flags."""
    try:
        from easy_context.tools.plan import Env, candidates, load_shape, rank_rows, train_flags
        gpu, mem = _this_gpu()
        env = Env(gpu=gpu, gpus_per_node=local, nodes=max(1, world // local), seq_len=args.seq_length,
                  batch=args.batch_size, grad_accum=args.gradient_accumulate_every, gpu_mem_gib=mem)
        rows = rank_rows(candidates(load_shape(args.model), env))
    except Exception as e:  # noqa: BLE001 - the suggestion is a courtesy; the fault line must still print
        return f"plan could not run here ({type(e).__name__}: {str(e)[:120]})"
    fits = [r for r in rows if r["fits"]]
    if not fits:
        return (f"plan finds nothing that fits {world} GPU(s) at this length (closest: {rows[0]['gpu_peak_gib']:.0f} "
                "GiB predicted): more GPUs (a larger --sp-size) or a shorter --seq-length" if rows else
                "plan finds no layout for this model and length")
    best = fits[0]
    return (f"plan suggests {' '.join(train_flags(best, env))} with DeepSpeed {best['zero']} (predicted "
            f"{best['gpu_peak_gib']:.1f} GiB per GPU)")


def _this_gpu() -> tuple[str, float | None]:
    """The planner's name for this GPU and its memory in GiB (an H200 on a machine without CUDA)."""
    import torch
    if not torch.cuda.is_available():
        return "h200", None
    name = torch.cuda.get_device_name().lower()
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    return next((g for g in ("h200", "h100", "a100") if g in name), "h200"), mem
