"""train.py's bookkeeping phases, one helper each: the output directory (lock, this run's identity), resuming from
the latest good checkpoint, and the final save. The training loop itself stays in train.py."""
from __future__ import annotations

import os

from . import checkpoint as ckpt
from . import run_dir


def open_run(args, accelerator, config=None):
    """Lock ``--output-dir`` for this run and record its identity; returns ``(lock, run_id)``.

    One run at a time (lock); checkpoints of other runs are never touched; a finished run is not replaced;
    ``--resume`` refuses flags other than the run's (``run_flags``; ``config``: the model's, for its architecture and
    RoPE theta). Every rank reads the same files and fails alike before any collective; the main process writes, the
    others wait for it."""
    from . import run_flags
    lock, found = run_dir.RunLock(args.output_dir), ckpt.list_checkpoints(args.output_dir)
    lock.check()
    run_dir.check_run(args.output_dir, args, found)
    now = run_flags.identity(args, config, accelerator.num_processes)
    changes = {}
    if args.resume and found:  # there is a checkpoint to load: it must be this run's model, layout and meaning
        run_dir.check_collisions(args.output_dir, found)  # another run's checkpoints at steps this run will save
        changes = run_flags.check_resume(args.output_dir, run_dir.read_run(args.output_dir), now,
                                         run_dir.fingerprint(args),
                                         run_flags.accepted_keys(getattr(args, "accept_changed", None)))
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        lock.acquire()
        ckpt.remove_stale_temps(args.output_dir)  # half-written checkpoints of a killed run
        if args.overwrite_output_dir:
            import shutil
            shutil.rmtree(ckpt.ckpt_root(args.output_dir), ignore_errors=True)
        run_dir.begin_run(args.output_dir, args, found, now, changes)
        if changes:
            accelerator.print("--resume --accept-changed: " + ", ".join(
                f"{run_flags.CHANGEABLE[k]} {v[0]} -> {v[1]}" for k, v in changes.items()) + " (recorded in run.json)")
    accelerator.wait_for_everyone()
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
    state = ckpt.load_checkpoint(accelerator, path)
    loader.load_state_dict(state["data"])
    accelerator.print(f"resumed from {path} (step {state['step']})")
    return state["step"]


def save_outputs(args, accelerator, model, tokenizer) -> None:
    """The final model: HF safetensors + tokenizer, RoPE theta (``--save-rope-theta``) in config.json; with
    ``--lora-rank`` the adapter (+ the merged model with ``--merge-lora``)."""
    accelerator.wait_for_everyone()
    if args.no_save_model:
        return
    if args.lora_rank:
        from .lora import save_lora
        save_lora(accelerator, model, tokenizer, args)
    else:
        from .modeling import save_final_model
        save_final_model(accelerator, model, tokenizer, args.output_dir, args.save_rope_theta, args.seq_length)
    accelerator.print(f"saved model to {args.output_dir} (rope_theta {args.save_rope_theta:g}); "
                      f"metrics in {args.log_file}")


__all__ = ["open_run", "resume", "save_outputs"]
