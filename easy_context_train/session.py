"""train.py's bookkeeping phases, one helper each: the output directory (lock, this run's identity), resuming from
the latest good checkpoint, and the final save. The training loop itself stays in train.py."""
from __future__ import annotations

import os

from . import checkpoint as ckpt
from . import run_dir


def already_final(args) -> bool:
    """--resume of a finished run with the same target: one line on rank 0 saying the model is complete, and True
    (train.py returns, exit 0). Refusals (fewer steps, changed flags) raise from ``resume_plan``."""
    if resume_plan(args) != "done":
        return False
    if os.environ.get("RANK", "0") == "0":
        import sys

        from .run_state import finished_line
        print(finished_line(args), file=sys.stderr, flush=True)
    return True


def resume_plan(args) -> str:
    """Before anything loads (every rank, read-only): the output dir's state decides what this launch does:
    "start" (no --resume), "continue", "done" (a finished run, same target: nothing to do) or "extend"
    (run_state.plan_resume: a finished run is never replaced or cut back)."""
    from .run_state import plan_resume, read_state
    if not args.resume:
        args.resume_plan = "start"
        return "start"
    found = ckpt.list_checkpoints(args.output_dir)
    args.resume_plan = plan_resume(args, found)
    if args.resume_plan == "done":  # nothing trains, but other flags mean another stage: refused like any resume
        from . import run_flags
        prev = run_dir.read_run(args.output_dir) or {}
        old = {k: v for k, v in (prev.get("identity") or {}).items() if k not in ("processes", "architecture")}
        now = run_flags.identity(args, None, int(os.environ.get("WORLD_SIZE", "1")))
        if args.rope_theta is None:  # the model's own theta: only its config knows it (not loaded for a no-op)
            old.pop("rope_theta", None)
        run_flags.check_resume(args.output_dir, {**prev, "identity": old} if prev.get("identity") else prev, now,
                               run_dir.fingerprint(args), run_flags.accepted_keys(args.accept_changed))
    if args.resume_plan == "extend":
        args.finished_step = read_state(args.output_dir, found, args.log_file).step
    return args.resume_plan


def open_run(args, accelerator, config=None, data=None):
    """Lock ``--output-dir`` for this run and record its identity; returns ``(lock, run_id)``.

    One run at a time (lock); checkpoints of other runs are never touched; a finished run is not replaced;
    ``--resume`` refuses flags other than the run's (``run_flags``; ``config``: the model's, for its architecture and
    RoPE theta; ``data``: what the data is, ``data.data_identity``). Every rank reads the same files and fails alike
    before any collective; the main process writes, the others learn by one all-reduce whether it could (a failed write
    is exit 74 on every rank)."""
    from . import run_flags
    lock, found = run_dir.RunLock(args.output_dir), ckpt.list_checkpoints(args.output_dir)
    lock.check()
    run_dir.check_run(args.output_dir, args, found)
    now = run_flags.identity(args, config, accelerator.num_processes, data)
    changes = {}
    if args.resume and found:  # there is a checkpoint to load: it must be this run's model, layout and meaning
        run_dir.check_collisions(args.output_dir, found)  # another run's checkpoints at steps this run will save
        changes = run_flags.check_resume(args.output_dir, run_dir.read_run(args.output_dir), now,
                                         run_dir.fingerprint(args),
                                         run_flags.accepted_keys(getattr(args, "accept_changed", None)))
    err = None
    if accelerator.is_main_process:
        from .errors import UsageError
        from .writes import WriteError, guarded
        try:
            with guarded("the output directory", args.output_dir):
                os.makedirs(args.output_dir, exist_ok=True)
                lock.acquire()
                ckpt.remove_stale_temps(args.output_dir)  # half-written checkpoints / final saves of a killed run
                if args.overwrite_output_dir:
                    import shutil
                    shutil.rmtree(ckpt.ckpt_root(args.output_dir), ignore_errors=True)
                if getattr(args, "resume_plan", None) == "extend":  # the finished model is kept, never replaced
                    from .run_state import keep_finished_model
                    kept = keep_finished_model(args.output_dir, args.finished_step, args.max_train_steps)
                    accelerator.print(f"--resume: continuing the finished run from step {args.finished_step} to "
                                      f"{args.max_train_steps}; its final model was moved to {kept}")
                run_dir.begin_run(args.output_dir, args, found, now, changes)
        except (WriteError, UsageError) as e:  # guarded: an OSError is a WriteError (exit 74)
            err = e
        if changes and err is None:
            accelerator.print("--resume --accept-changed: " + ", ".join(
                run_flags.change_text(k, *v) for k, v in changes.items()) + " (recorded in run.json)")
    from .writes import agree
    agree(accelerator, err)  # instead of a barrier: a main process that could not write stops every rank
    run_id = run_dir.read_run(args.output_dir)["run_id"]
    if args.wandb:
        accelerator.init_trackers(args.wandb, config=vars(args), init_kwargs={
            "wandb": {"name": os.path.basename(os.path.normpath(args.output_dir)), "dir": args.output_dir}})
    return lock, run_id


def resume(args, accelerator, loader, run_id: str) -> int:
    """``--resume``: model, optimizer, scheduler, RNG and data position from this run's latest good checkpoint;
    returns the step to start from (0 without ``--resume`` or without a checkpoint)."""
    if not args.resume:
        return 0
    path = run_dir.latest_good_checkpoint(ckpt.list_checkpoints(args.output_dir), run_id, accelerator.print)
    if path is None:
        accelerator.print(f"--resume: no checkpoint in {args.output_dir}, starting from step 0")
        return 0
    step = int(os.path.basename(path).split("-")[-1])
    if getattr(args, "resume_plan", None) == "extend" and step != args.finished_step:
        from .errors import UsageError  # the final step's checkpoint did not verify: never an older one
        raise UsageError(f"--resume: the checkpoint of the finished run's last step {args.finished_step} is damaged "
                         f"(the newest good one is {path}); continuing from it would lose the steps after it: start "
                         f"a new stage from the model in {args.output_dir} (final-step-*/) instead")
    state = ckpt.load_checkpoint(accelerator, path)
    loader.load_state_dict(state["data"])
    accelerator.print(f"resumed from {path} (step {state['step']})")
    return state["step"]


def save_outputs(args, accelerator, model, tokenizer, step: int | None = None) -> None:
    """The final model: HF safetensors + tokenizer, RoPE theta (``--save-rope-theta``) in config.json; with
    ``--lora-rank`` the adapter (+ the merged model with ``--merge-lora``). Then run.json records that the run finished
    at ``step`` (the run directory's state: run_state.py)."""
    from .run_state import mark_finished
    from .writes import WriteError, agree
    accelerator.wait_for_everyone()
    step = args.max_train_steps if step is None else step
    if args.no_save_model:
        err = None
        if accelerator.is_main_process:
            try:
                mark_finished(args.output_dir, step, model=False)
            except WriteError as e:
                err = e
        agree(accelerator, err)
        return
    if args.lora_rank:
        from .lora import save_lora
        save_lora(accelerator, model, tokenizer, args)
    else:
        from .modeling import save_final_model
        save_final_model(accelerator, model, tokenizer, args.output_dir, args.save_rope_theta, args.seq_length)
    err = None
    if accelerator.is_main_process:
        try:
            mark_finished(args.output_dir, step, model=True)
        except WriteError as e:
            err = e
    agree(accelerator, err)
    accelerator.print(f"saved model to {args.output_dir} (rope_theta {args.save_rope_theta:g}); "
                      f"metrics in {args.log_file}")


__all__ = ["resume_plan", "open_run", "resume", "save_outputs"]
