"""train.py's flags: EasyContext's names and meanings, plus dp x sp, schedule, checkpoints, memory options."""
from __future__ import annotations

import argparse
import os

from easy_context.registry import DEFAULT_MODE, get_mode, mode_names, modes_taking
from .errors import UsageError, fail

# easy_context.memory.CHECKPOINTING + "auto" (auto_checkpointing.py), spelled out: flag parsing loads no torch
# (tests/test_train_extras.py checks the two agree)
CHECKPOINTING = ("none", "layer", "selective", "offload", "nested", "auto")


def duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``10m`` or ``1.5h``."""
    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:].lower(), None)
    try:
        return float(text[:-1] if scale else text) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 10m, 1h)") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line instead of usage + error
        fail(message, prog=self.prog)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="train.py", description="Long-context fine-tuning with sequence parallelism "
                "(EasyContext flags). Launch with `accelerate launch --config_file accelerate_configs/... train.py`.")
    a = p.add_argument
    # EasyContext's flags (same names, same meaning)
    a("--batch-size", type=int, default=1, help="rows per micro-batch per data-parallel rank (shared by an sp group)")
    a("--gradient-accumulate-every", type=int, default=8, help="micro-batches per optimizer step")
    a("--output-dir", required=True, help="final model, checkpoints/ and metrics.jsonl go here")
    a("--wandb", default=None, help="wandb project name (WANDB_MODE=offline|disabled respected)")
    a("--seed", type=int, default=42)
    a("--max-train-steps", type=int, default=400, help="optimizer steps")
    a("--learning-rate", type=float, default=2e-5, help="peak LR; this is the LR used (also under DeepSpeed)")
    a("--rope-theta", type=float, default=None,
      help="RoPE base used for training (written into the config); default: the model's own value")
    a("--rope-scaling", choices=("linear", "dynamic", "yarn", "llama3"), default=None,
      help="RoPE scaling written into config.rope_parameters before the model is built (trained and saved "
      "with it); needs --rope-factor. dynamic: data_parallel only (its frequencies depend on the whole length)")
    a("--rope-factor", type=float, default=None, help="--rope-scaling factor (> 1), e.g. 4 for 4x the context")
    a("--rope-original-max-positions", type=int, default=None,
      help="yarn/llama3/dynamic: the pretraining context length (default: the model's max_position_embeddings)")
    a("--model", default="meta-llama/Llama-2-7b-hf", help="hub name or local HF directory")
    a("--dataset", default="emozilla/pg_books-tokenized-bos-eos-chunked-65536",
      help="hub name, save_to_disk dir or json/jsonl/parquet file with an input_ids column")
    a("--seq-length", type=int, default=16384)
    a("--parallel_mode", "--parallel-mode", dest="parallel_mode", default=DEFAULT_MODE,
      choices=mode_names())
    a("--ring_degree", "--ring-degree", dest="ring_degree", type=int, default=None,
      help="usp_attn: ring degree (ulysses degree = sp size / ring degree); default: sp size (pure ring)")
    # additions
    a("--sp-size", type=int, default=None, help="sequence-parallel group size (default: all processes; "
      "1 for data_parallel). Data-parallel size = processes / sp size")
    a("--warmup-steps", type=int, default=0, help="linear LR warmup steps")
    a("--lr-schedule", choices=("constant", "cosine", "linear"), default="constant",
      help="after warmup: constant at --learning-rate, or cosine/linear decay to --min-lr-ratio x LR")
    a("--min-lr-ratio", type=float, default=0.1)
    a("--dp-balance", choices=("auto", "on", "off"), default="auto", help="give every data-parallel rank about the "
      "same sum of squared document lengths per step (auto: on for packed rows, i.e. with position_ids, when dp > 1)")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay (never on norms, biases, embeddings)")
    a("--decay-all", action="store_true", help="also decay norms, biases and embeddings")
    a("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    a("--router-aux-loss-coef", type=float, default=None,
      help="MoE models: weight of the router load-balancing loss, computed over every rank's tokens (default: the "
      "config's router_aux_loss_coef when its output_router_logits is true, else off)")
    a("--checkpoint-every", type=int, default=0, help="save a resumable checkpoint every N steps (0 = off)")
    a("--keep-checkpoints", type=int, default=2, help="how many periodic checkpoints to keep")
    a("--resume", action="store_true", help="continue this output dir's run from its latest good checkpoint")
    a("--accept-changed", default=None, metavar="NAMES",
      help="--resume with flags other than the run was started with (refused otherwise): the names to accept, "
      "comma-separated, e.g. seq-length,rope-theta for a new stage in the same directory (the model's architecture "
      "and the process count cannot change)")
    a("--overwrite-output-dir", action="store_true",
      help="start a fresh run in an output dir holding another run's checkpoints (they are deleted) or its final "
      "model and metrics (replaced)")
    a("--save-rope-theta", type=float, default=None,
      help="RoPE theta written into the saved config (default: --rope-theta), e.g. 1e9 for the final model")
    a("--no-save-model", action="store_true", help="skip the final HF save (benchmarks)")
    a("--dataset-split", default="train")
    a("--log-file", default=None, help="per-step metrics as JSON lines (default: OUTPUT_DIR/metrics.jsonl)")
    a("--collective-timeout", "--timeout", dest="timeout", type=duration, default=600.0,
      help="a collective waiting this long for a peer stops every rank, naming the silent rank and the phase "
      "(docs/faults.md): 90s, 10m, 1h or plain seconds (default 10m; torch's own is 30m)")
    a("--build-lock-timeout", type=duration, default=300.0,
      help="start-up: a lock of the JIT build of DeepSpeed's ops (torch_extensions/.../lock) this old that no process "
      "holds (a run killed while compiling) stops the launch with the fix instead of waiting forever (default 5m)")
    # memory options (easy_context.memory)
    a("--checkpointing", choices=CHECKPOINTING, default="layer",
      help="activation checkpointing: per layer (HF), selective (keep attention output), offload (kept layer "
      "inputs in host memory), nested (one kept input per --offload-every-k layers), none, or auto: offload with k "
      "and selective layers chosen from each rank's GPU and host memory, the same on every rank (turns on "
      "--chunked-loss and --tiled-mlp, which its memory model assumes; easy_context_train/auto_checkpointing.py)")
    a("--offload-every-k", type=int, default=None, help="offload/nested: keep one layer input per k layers (default 1)")
    a("--gpu-budget-gib", type=float, default=None, help="--checkpointing auto: GPU memory per rank for activations "
      "(weights, gradients, optimizer state excluded); default: measured (needed on a machine without CUDA)")
    a("--host-budget-gib", type=float, default=None, help="--checkpointing auto: host memory PER NODE for offloaded "
      "checkpoints, split evenly among the node's ranks (LOCAL_WORLD_SIZE); default: 80%% of MemAvailable less "
      "ZeRO's CPU-offloaded optimizer state")
    a("--auto-margin", type=float, default=None,
      help="--checkpointing auto: share of the GPU budget left unplanned (default 0.06; raise it after an OOM)")
    a("--head-chunks", type=int, default=None,
      help="run each attention block in this many head groups, its backward one group at a time (exact; a smaller "
      "working set: 96.6 -> 56.6 KB/token at 7B with 8 on an H200, ~4%% slower; under ZeRO-3 each block gathers its "
      "own parameters). Default 1; --checkpointing auto chooses it when not given (easy_context/memory/head_chunks.py)")
    a("--recurrent-tiles", type=int, default=None,
      help="hybrids, one rank per sequence (sp = 1): the recurrent layers run their sequence in this many tiles, the "
      "backward one tile at a time (exact; one tile's working set, one more forward of those layers). Default 1; "
      "--checkpointing auto chooses it when not given (docs/hybrid.md)")
    a("--chunked-loss", action="store_true", help="LM head + loss in chunks, never materializing full logits")
    a("--tiled-mlp", action="store_true", help="run MLPs tile by tile along the sequence")
    a("--no-sliding-window", action="store_true",
      help="train (and save) with full causal attention instead of the model's sliding window (Mistral v0.1, "
      "Gemma 3's local layers); by default the window is kept: exact under every mode")
    a("--fused-ops", action=argparse.BooleanOptionalAction, default=True,
      help="lean fused RMSNorm + fused RoPE (torch.compile kernels on CUDA; exact eager math on CPU)")
    # LoRA (easy_context_train/lora.py, via peft)
    a("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank instead of the full model (0 = off)")
    a("--lora-alpha", type=float, default=None, help="LoRA alpha (scaling alpha / rank); default: 2 x --lora-rank")
    a("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
      help="comma-separated module names that get adapters (e.g. add gate_proj,up_proj,down_proj)")
    a("--lora-train-embeddings-norms", action="store_true",
      help="also train (and save with the adapter) the input embeddings and every norm (LongLoRA's recipe)")
    a("--merge-lora", action="store_true", help="final save: also the merged full model (adapter in OUTPUT_DIR/adapter)")
    # held-out loss (easy_context_train/evaluate.py)
    a("--eval-dataset", default=None, help="prepared dataset (like --dataset) whose first --eval-rows rows give "
      "eval_loss, the token-mean NLL under the same sp layout; evaluated every --eval-every steps and at the end")
    a("--eval-every", type=int, default=0, help="evaluate every N optimizer steps (0 = only after the last step)")
    a("--eval-rows", type=int, default=16, help="held-out rows evaluated (the first K of --eval-dataset)")
    a("--eval-split", default=None, help="split of --eval-dataset (default: --dataset-split)")
    return p


FLOAT_FLAGS = ("--learning-rate", "--rope-theta", "--rope-factor", "--min-lr-ratio", "--weight-decay",
               "--max-grad-norm", "--save-rope-theta", "--collective-timeout", "--timeout", "--lora-alpha",
               "--router-aux-loss-coef", "--gpu-budget-gib", "--host-budget-gib", "--auto-margin",
               "--build-lock-timeout")


def _join_negative_numbers(argv: list[str]) -> list[str]:
    """``--learning-rate -1e-3`` -> ``--learning-rate=-1e-3``: argparse takes "-1e-3" for a flag and says
    "expected one argument"; joined, the value reaches our range check and its clear message."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in FLOAT_FLAGS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def parse_args(argv=None) -> argparse.Namespace:
    import sys
    argv = _join_negative_numbers(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except UsageError as e:
        fail(str(e))
    return args


def looks_like_path(name: str) -> bool:
    """A hub name is ``org/name`` (or ``name``); anything with a leading ./, ../, /, ~, more than one slash,
    or whose first component is an existing local directory is meant as a local path."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        return True
    head = name.split("/")[0]
    return "/" in name and os.path.isdir(head)


def check_model_path(name: str, flag: str = "--model") -> None:
    path = os.path.expanduser(name)
    if looks_like_path(name) and not os.path.isdir(path):
        raise UsageError(f"{flag} {name!r}: no such directory (a local Hugging Face model directory was meant; "
                         "check the path, or pass a hub name like org/model)")


def check_auto_checkpointing(args) -> None:
    """--checkpointing auto and its budgets; fills in what auto implies (--chunked-loss, --tiled-mlp). Imports torch
    only for auto without --gpu-budget-gib, to refuse a machine without CUDA before anything heavy."""
    auto = args.checkpointing == "auto"
    given = [f for f, v in (("--gpu-budget-gib", args.gpu_budget_gib), ("--host-budget-gib", args.host_budget_gib),
                            ("--auto-margin", args.auto_margin)) if v is not None]
    if not auto:
        if given:
            raise UsageError(f"{' / '.join(given)} apply to --checkpointing auto only (got --checkpointing "
                             f"{args.checkpointing})")
        return
    if args.offload_every_k is not None:
        raise UsageError("--offload-every-k and --checkpointing auto: auto chooses k from the host memory; pass one "
                         "(or --checkpointing offload --offload-every-k K)")
    for flag, val in (("--gpu-budget-gib", args.gpu_budget_gib), ("--host-budget-gib", args.host_budget_gib)):
        if val is not None and not val > 0:
            raise UsageError(f"{flag} must be > 0 GiB, got {val:g}")
    if args.auto_margin is not None and not 0 <= args.auto_margin < 1:
        raise UsageError(f"--auto-margin must be in [0, 1), got {args.auto_margin:g}")
    if args.gpu_budget_gib is None:
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--checkpointing auto measures free GPU memory, and this machine has no CUDA: pass "
                             "--gpu-budget-gib G (the GPU memory per rank to plan for)")
    args.chunked_loss = args.tiled_mlp = True  # the memory auto plans with counts neither full logits nor full MLPs


def check_args(args) -> None:
    """Cheap checks that need neither torch nor the model (run before any heavy import)."""
    import math
    for name in ("batch_size", "gradient_accumulate_every", "max_train_steps", "seq_length"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for flag in FLOAT_FLAGS:
        val = getattr(args, "timeout" if flag == "--collective-timeout" else flag[2:].replace("-", "_"))
        if val is not None and not math.isfinite(val):
            raise UsageError(f"{flag} must be a finite number, got {val}")
    for flag, val, ok, want in (
            ("--learning-rate", args.learning_rate, args.learning_rate > 0, "> 0"),
            ("--rope-theta", args.rope_theta, args.rope_theta is None or args.rope_theta > 0, "> 0"),
            ("--save-rope-theta", args.save_rope_theta, args.save_rope_theta is None or args.save_rope_theta > 0, "> 0"),
            ("--min-lr-ratio", args.min_lr_ratio, 0 <= args.min_lr_ratio <= 1, "in [0, 1]"),
            ("--weight-decay", args.weight_decay, args.weight_decay >= 0, ">= 0"),
            ("--max-grad-norm", args.max_grad_norm, args.max_grad_norm >= 0, ">= 0 (0 = no clipping)"),
            ("--router-aux-loss-coef", args.router_aux_loss_coef,
             args.router_aux_loss_coef is None or args.router_aux_loss_coef >= 0, ">= 0"),
            ("--collective-timeout", args.timeout, args.timeout > 0, "> 0 seconds"),
            ("--build-lock-timeout", args.build_lock_timeout, args.build_lock_timeout > 0, "> 0 seconds")):
        if not ok:
            raise UsageError(f"{flag} must be {want}, got {val:g}")
    if args.warmup_steps < 0 or args.checkpoint_every < 0 or args.keep_checkpoints < 0:
        raise UsageError("--warmup-steps, --checkpoint-every and --keep-checkpoints must be >= 0")
    if args.rope_scaling is None and (args.rope_factor, args.rope_original_max_positions) != (None, None):
        raise UsageError("--rope-factor / --rope-original-max-positions need --rope-scaling "
                         "{linear,dynamic,yarn,llama3}")
    if args.rope_scaling is not None and (args.rope_factor is None or not args.rope_factor > 1):
        raise UsageError(f"--rope-scaling {args.rope_scaling} needs --rope-factor > 1 (e.g. 4 for 4x the context), "
                         f"got {args.rope_factor}")
    if args.rope_original_max_positions is not None and (args.rope_original_max_positions < 1
                                                         or args.rope_scaling == "linear"):
        raise UsageError("--rope-original-max-positions must be >= 1 and applies to yarn, llama3 and dynamic "
                         "(linear scaling has no original length)")
    mode = get_mode(args.parallel_mode)
    if args.rope_scaling == "dynamic" and mode.is_parallel:
        raise UsageError("--rope-scaling dynamic rescales by the longest position of each forward, which a "
                         "sequence-parallel rank sees only part of: use yarn/linear/llama3, or data_parallel")
    if args.lora_rank < 0 or args.lora_alpha is not None and not args.lora_alpha > 0:
        raise UsageError(f"--lora-rank must be >= 0 and --lora-alpha > 0, got {args.lora_rank} and {args.lora_alpha}")
    if not args.lora_rank and (args.merge_lora or args.lora_train_embeddings_norms or args.lora_alpha is not None):
        raise UsageError("--lora-alpha / --lora-train-embeddings-norms / --merge-lora need --lora-rank R (>= 1)")
    if args.lora_rank and not [t for t in args.lora_targets.split(",") if t.strip()]:
        raise UsageError("--lora-targets is empty: name the modules to adapt, e.g. q_proj,k_proj,v_proj,o_proj")
    if args.eval_every < 0 or args.eval_rows < 1:
        raise UsageError(f"--eval-every must be >= 0 and --eval-rows >= 1, got {args.eval_every} and {args.eval_rows}")
    if args.eval_every and args.eval_dataset is None:
        raise UsageError("--eval-every needs --eval-dataset (the held-out rows to evaluate)")
    check_auto_checkpointing(args)
    for flag in ("head_chunks", "recurrent_tiles"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if (args.head_chunks or 1) > 1 and not mode.supports_attention_cache:
        raise UsageError(f"--head-chunks needs a sequence-parallel mode's attention (it keeps each head group's "
                         f"output + LSE); --parallel_mode {mode.name} runs the model's own: use --head-chunks 1 or a "
                         "sequence-parallel mode (at --sp-size 1 too)")
    if args.resume and args.overwrite_output_dir:
        raise UsageError("--resume continues the run in --output-dir; --overwrite-output-dir deletes it: pass one")
    if args.accept_changed is not None:
        if not args.resume:
            raise UsageError("--accept-changed applies to --resume only")
        from .run_flags import accepted_keys
        accepted_keys(args.accept_changed)
    if args.ring_degree is not None and "ring_degree" not in mode.degree_kwargs:
        raise UsageError(f"--ring_degree applies to {' / '.join(modes_taking('ring_degree'))} only "
                         f"(got --parallel_mode {args.parallel_mode})")
    if not mode.is_parallel and args.sp_size not in (None, 1):
        raise UsageError(f"--sp-size must be 1 (or unset) with --parallel_mode {mode.name}")
    # --save-rope-theta unset: the theta used for training (the model's own when --rope-theta is unset too)
    check_model_path(args.model)
    from .run_dir import check_writable_dir
    check_writable_dir(args.output_dir)
    path = os.path.join(args.output_dir, "checkpoints")  # preemption's and periodic checkpoints (temp dirs: mkdtemp)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{path!r} is a file where the run writes a directory (checkpoints/): move it, or choose "
                         "another --output-dir")
    if args.log_file is None:
        args.log_file = os.path.join(args.output_dir, "metrics.jsonl")
    else:  # every path the run writes is checked before the model loads
        from .run_dir import check_writable_file
        check_writable_file(args.log_file, "--log-file")
