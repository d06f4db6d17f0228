"""A run directory is fresh, in progress or finished, and every entry acts on that state (docs/training.md).

* fresh: no final model, no checkpoint, no metrics: a run starts.
* in progress: checkpoints (or a log) and no final model: ``--resume`` continues it; a fresh start is refused.
* finished: the final model is there (run.json's ``finished`` records its step; an older run.json: the last step of
  its metrics log). ``--resume`` to the same ``--max-train-steps`` is a no-op (one line, exit 0: a scheduler that
  requeues a finished job loses nothing); to fewer steps it is refused (it would put an earlier step's weights in
  place of the finished model); to more steps it continues from the checkpoint of the final step (never an older
  one), after moving the finished model into ``OUTPUT/final-step-N/``: nothing replaces a finished model unless
  ``--overwrite-output-dir`` is given.
"""
from __future__ import annotations

import fnmatch
import json
import os
import time
from dataclasses import dataclass, field

from .errors import UsageError
from .run_dir import FINAL_FILES, RUN_FILE, owned_by, read_run, run_of

FRESH, IN_PROGRESS, FINISHED = "fresh", "in progress", "finished"
# what save_outputs writes (model shards, tokenizer, LoRA adapter): moved together when a finished run is continued
MODEL_PATTERNS = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                  "pytorch_model*.bin", "pytorch_model.bin.index.json", "tokenizer*", "special_tokens_map.json",
                  "vocab.json", "merges.txt", "chat_template.jinja", "adapter_config.json", "adapter_model.safetensors",
                  "adapter")


@dataclass
class RunState:
    kind: str
    step: int | None = None  # the finished run's last step (None: unknown)
    model: list = field(default_factory=list)  # the final model's files
    run_id: str | None = None


def last_logged_step(log_file: str | None) -> int | None:
    try:
        with open(log_file) as f:
            lines = [ln for ln in f if ln.strip()]
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def read_state(output_dir: str, checkpoints: list, log_file: str | None = None) -> RunState:
    rec = read_run(output_dir) or {}
    model = [n for n in FINAL_FILES if os.path.isfile(os.path.join(output_dir, n))]
    done = rec.get("finished")
    if model or (done and not done.get("model", True)):  # --no-save-model: finished without a model
        step = done["step"] if done else last_logged_step(log_file or os.path.join(output_dir, "metrics.jsonl"))
        return RunState(FINISHED, step, model, rec.get("run_id"))
    logged = log_file and os.path.isfile(log_file) and os.path.getsize(log_file) > 0
    return RunState(IN_PROGRESS if checkpoints or logged else FRESH, run_id=rec.get("run_id"))


def plan_resume(args, checkpoints: list) -> str:
    """What ``--resume`` does here (read-only, every rank alike, before any collective): "continue" (an in-progress
    run, or nothing to resume), "done" (a finished run, same target: nothing to do) or "extend" (a finished run, a
    later target: continue from its final step). Raises a one-line UsageError otherwise."""
    out = args.output_dir
    st = read_state(out, checkpoints, getattr(args, "log_file", None))
    if st.kind != FINISHED:
        return "continue"
    who = f"run {st.run_id}" if st.run_id else "an earlier run"
    files = ", ".join(st.model) or "no model saved (--no-save-model)"
    if st.step is None:
        raise UsageError(f"--resume: --output-dir {out!r} holds the final model of {who} ({files}) and no record of "
                         "its last step (the run finished); choose another --output-dir, or drop --resume and pass "
                         "--overwrite-output-dir to replace it")
    target = args.max_train_steps
    if target == st.step:
        return "done"
    if target < st.step:
        raise UsageError(f"--resume: {who} in {out!r} finished at step {st.step} ({files}); --max-train-steps "
                         f"{target} is before that, and resuming would replace the finished model with an earlier "
                         f"step's weights: pass --max-train-steps above {st.step} to train on, or choose another "
                         "--output-dir")
    mine = [s for s, p in checkpoints if owned_by(run_of(p), st.run_id or "legacy")]
    if not mine or max(mine) != st.step:
        last = f"its last checkpoint is step {max(mine)}" if mine else "it has no checkpoint"
        raise UsageError(f"--resume: {who} in {out!r} finished at step {st.step} and {last}, so its final state "
                         f"(optimizer, data position) cannot be continued to step {target}: start a new stage from the "
                         f"finished model (--model {out} --output-dir NEW), or rerun with --max-train-steps "
                         f"{st.step} (nothing to do)")
    return "extend"


def finished_line(args) -> str:
    st = read_state(args.output_dir, [], getattr(args, "log_file", None))
    return (f"train.py: run {st.run_id} in {args.output_dir} finished at step {st.step} and its model is complete "
            f"({', '.join(st.model) or 'no model saved'}): nothing to resume (--max-train-steps above {st.step} "
            "continues it)")


def model_files(output_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(output_dir) if any(fnmatch.fnmatch(n, p) for p in MODEL_PATTERNS))


def keep_finished_model(output_dir: str, step: int, target: int) -> str:
    """Main process, under the run lock: move the finished model into ``final-step-N/`` (renames, nothing copied or
    deleted) and record the continuation in run.json; returns the directory."""
    from .writes import atomic_json, guarded
    dest = os.path.join(output_dir, f"final-step-{step:07d}")
    n = 1
    while os.path.exists(dest):  # a directory of that name is the user's (or an earlier continuation's): kept
        n += 1
        dest = os.path.join(output_dir, f"final-step-{step:07d}-{n}")
    with guarded("the finished model's copy", dest):
        os.makedirs(dest)
        for name in model_files(output_dir):
            os.replace(os.path.join(output_dir, name), os.path.join(dest, name))
        rec = read_run(output_dir) or {}
        fin = rec.pop("finished", None)
        rec["history"] = rec.get("history", []) + [{"continued": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                    "from_step": step, "to_step": target, "finished": fin,
                                                    "model_kept_in": os.path.basename(dest)}]
        atomic_json(os.path.join(output_dir, RUN_FILE), rec)
    return dest


def mark_finished(output_dir: str, step: int, model: bool) -> None:
    """Main process, after the final save: run.json records that the run finished (and at which step)."""
    from .writes import atomic_json, guarded
    path = os.path.join(output_dir, RUN_FILE)
    with guarded("run.json", path, then="the model itself is saved; rerun with --resume to record it"):
        rec = read_run(output_dir) or {}
        rec["finished"] = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": model}
        atomic_json(path, rec)


__all__ = ["FRESH", "IN_PROGRESS", "FINISHED", "RunState", "read_state", "plan_resume", "finished_line",
           "keep_finished_model", "mark_finished"]
