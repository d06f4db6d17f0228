"""What a run is, as recorded in ``run.json`` ("identity") and compared by ``--resume``.

``identity(args, config, world)``: the flags that change what a run means, resolved (the sp size, the ring degree
and the RoPE theta actually trained with), the model's architecture, the tokenizer's files and the process count.
``check_resume``: a changed architecture (or LoRA shape) or process count is refused outright: the checkpoint cannot
be loaded (tensor shapes; ZeRO shards and per-rank RNG states). Any other change is refused unless named in
``--accept-changed`` (a new stage in the same directory, a lowered learning rate): one line naming every change, the
recorded and the new value. Accepted changes are written back into run.json with the date (``history``).
What the data *is* (``data``: rows, tokens and a checksum of sampled rows, ``data.data_identity``) is compared too,
not only its path: a dataset replaced at the same path is refused unless ``--accept-changed dataset``.
"""
from __future__ import annotations

import hashlib
import os
import time

from .errors import UsageError

# identity key -> how the line names it (the flag, as typed)
CHANGEABLE = {"model": "--model", "tokenizer": "tokenizer", "dataset": "--dataset", "seq_length": "--seq-length",
              "parallel_mode": "--parallel_mode", "sp_size": "--sp-size", "ring_degree": "--ring-degree",
              "rope_theta": "--rope-theta", "batch_size": "--batch-size",
              "gradient_accumulate_every": "--gradient-accumulate-every", "seed": "--seed",
              "learning_rate": "--learning-rate", "lr_schedule": "--lr-schedule", "warmup_steps": "--warmup-steps"}
ARCH_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "vocab_size")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json")


def accepted_keys(text: str | None) -> set[str]:
    """``--accept-changed seq-length,model`` -> {"seq_length", "model"}; an unknown name is a UsageError."""
    keys = {t.strip().lstrip("-").replace("-", "_") for t in (text or "").split(",") if t.strip()}
    bad = sorted(keys - set(CHANGEABLE))
    if bad:
        raise UsageError(f"--accept-changed: unknown name(s) {', '.join(bad)}; choose from "
                         f"{', '.join(k.replace('_', '-') for k in CHANGEABLE)}")
    return keys


def tokenizer_id(model: str) -> str | None:
    """sha256 (16 hex digits) of the tokenizer files of a local model directory; None for a hub name."""
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return None
    h, n = hashlib.sha256(), 0
    for name in TOKENIZER_FILES:
        p = os.path.join(path, name)
        if os.path.isfile(p):
            n += 1
            h.update(name.encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16] if n else None


def architecture(config, args) -> dict:
    arch = {k: getattr(config, k, None) for k in ARCH_KEYS}
    if getattr(args, "lora_rank", 0):
        arch.update(lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                    lora_embeddings_norms=bool(args.lora_train_embeddings_norms))
    return arch


def identity(args, config, world: int, data: dict | None = None) -> dict:
    from easy_context.registry import get_mode
    mode = get_mode(args.parallel_mode)
    sp = args.sp_size or (world if mode.is_parallel else 1)
    rec = {"model": args.model, "tokenizer": tokenizer_id(args.model), "dataset": args.dataset,
           "seq_length": args.seq_length, "parallel_mode": mode.name, "sp_size": sp,
           "ring_degree": (args.ring_degree or sp) if "ring_degree" in mode.degree_kwargs else None,
           "rope_theta": args.rope_theta, "batch_size": args.batch_size,
           "gradient_accumulate_every": args.gradient_accumulate_every, "seed": args.seed,
           "learning_rate": args.learning_rate, "lr_schedule": args.lr_schedule, "warmup_steps": args.warmup_steps,
           "processes": world}
    if data is not None:
        rec["data"] = data  # what the rows are (the path above is only where they were)
    if config is not None:
        from easy_context.hf.config import get_rope_theta
        rec["rope_theta"] = get_rope_theta(config)  # the theta trained with (the model's own when the flag is unset)
        rec["architecture"] = architecture(config, args)
    return rec


def _arch_text(a: dict) -> str:
    text = (f"{a.get('model_type')}, {a.get('num_hidden_layers')} layers, hidden {a.get('hidden_size')}, "
            f"{a.get('num_attention_heads')} heads ({a.get('num_key_value_heads')} kv), vocab {a.get('vocab_size')}")
    return text + (f", LoRA rank {a['lora_rank']} on {a['lora_targets']}" if a.get("lora_rank") else "")


def check_resume(output_dir: str, prev: dict | None, now: dict, legacy_flags: dict, accepted: set[str]) -> dict:
    """Compare this launch with the run it resumes (every rank, read-only). Returns the accepted changes
    ``{key: [recorded, now]}``; raises a one-line UsageError for a change it may not make."""
    if not prev:
        return {}
    run = f"run {prev.get('run_id')}"
    old = prev.get("identity")
    if old is None:  # run.json of an older version: its raw flags against this launch's raw flags
        old, now = prev.get("flags") or {}, legacy_flags
    if "architecture" in old and "architecture" in now and old["architecture"] != now["architecture"]:
        raise UsageError(f"--resume: the checkpoints in {output_dir!r} ({run}) hold a different model "
                         f"({_arch_text(old['architecture'])}) than --model {now['model']!r} "
                         f"({_arch_text(now['architecture'])}): they cannot be loaded into it; pass --model "
                         f"{old.get('model')!r} as recorded, or choose another --output-dir")
    if "processes" in old and old["processes"] != now.get("processes"):
        raise UsageError(f"--resume: the checkpoints in {output_dir!r} ({run}) were written by {old['processes']} "
                         f"processes and this launch has {now.get('processes')} (ZeRO shards and per-rank RNG "
                         f"states are per process): launch with --num_processes {old['processes']}, or choose another "
                         "--output-dir")
    changed = {k: [old[k], now.get(k)] for k in CHANGEABLE if k in old and k in now and old[k] != now[k]}
    if old.get("data") and now.get("data") and old["data"] != now["data"]:
        if "dataset" not in accepted:
            raise UsageError(f"--resume: the data at --dataset {now.get('dataset')!r} is not the data {run} in "
                             f"{output_dir!r} was trained on (recorded {data_text(old['data'])}; now "
                             f"{data_text(now['data'])}): the saved data position would point into other rows; "
                             "rerun with the recorded data, or pass --accept-changed dataset to continue on these rows "
                             "(recorded in run.json), or choose another --output-dir")
        changed["data"] = [old["data"], now["data"]]
    refused = [k for k in changed if k not in accepted and k != "data"]
    if refused:
        what = ", ".join(f"{CHANGEABLE[k]} {_v(changed[k][0])} (now {_v(changed[k][1])})" for k in refused)
        names = ",".join(k.replace("_", "-") for k in refused)
        raise UsageError(f"--resume: {run} in {output_dir!r} was started with {what}; rerun with the recorded "
                         f"value(s), or pass --accept-changed {names} to continue with the new one(s) (e.g. a new "
                         "stage), or choose another --output-dir")
    return changed


def data_text(d: dict) -> str:
    return f"{d.get('rows')} rows, {d.get('tokens')} tokens, sampled sha256 {str(d.get('sha256'))[:12]}"


def change_text(key: str, old, new) -> str:
    """One accepted change as the resume line names it."""
    if key == "data":
        return f"--dataset's rows {data_text(old)} -> {data_text(new)}"
    return f"{CHANGEABLE[key]} {old} -> {new}"


def _v(x) -> str:
    return repr(x) if isinstance(x, str) else f"{x:g}" if isinstance(x, float) else str(x)


def updated_record(prev: dict, now: dict, changes: dict) -> dict:
    """run.json after an accepted resume: this launch's identity, the changes appended to ``history``."""
    rec = {**prev, "identity": now}
    if changes:
        rec["history"] = prev.get("history", []) + [{"resumed": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                    "changed": changes}]
    return rec


__all__ = ["CHANGEABLE", "accepted_keys", "identity", "check_resume", "updated_record", "tokenizer_id", "data_text",
           "change_text"]
