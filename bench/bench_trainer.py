#!/usr/bin/env python
"""SFTTrainer with EasyContext's integration vs SFTTrainer alone: tokens/s and peak GPU memory, one run, one table.

    python bench/bench_trainer.py                    # H200: ~1.2B Llama-shaped random model, 64K-token packed rows,
                                                     # bf16, gradient checkpointing; ours = zigzag_ring_attn on 1 rank
                                                     # + chunked loss + --attn-backend (fa4 > cudnn automatically)
    python bench/bench_trainer.py --trainer hf       # transformers.Trainer instead (no trl / datasets needed)
    python bench/bench_trainer.py --tiny             # CPU: code-path check on a tiny config (no numbers)

Both variants train the same model shape from the same seed on the same rows: documents of random tokens (lengths
uniform in [--min-doc, --max-doc]) packed into rows of at most --seq-length tokens (trl's "bfd" packing, padding-free:
position_ids restart at each document; --trainer hf packs greedily itself). Each variant runs in its own process;
--warmup steps (JIT, allocator) are not timed; tokens/s = tokens of the timed steps / their wall time (the optimizer
step included); peak = torch.cuda.max_memory_allocated over the timed steps. baseline = the plain trainer with
attn_implementation --baseline-attn (sdpa: transformers builds a block-diagonal mask from the packed position_ids).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def flags(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=("sft", "hf"), default="sft", help="trl.SFTTrainer or transformers.Trainer")
    p.add_argument("--seq-length", type=int, default=65536, help="tokens per packed row")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--min-doc", type=int, default=2048, help="shortest document (tokens)")
    p.add_argument("--max-doc", type=int, default=16384, help="longest document (tokens)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--mode", default="zigzag_ring_attn", help="ours: easy_context mode (1 rank)")
    p.add_argument("--attn-backend", default=None, help="ours: fa4 / cudnn / ... (default: automatic)")
    p.add_argument("--no-chunked-loss", action="store_true", help="ours: full logits")
    p.add_argument("--fused-ops", action="store_true", help="ours: lean fused RMSNorm + fused RoPE")
    p.add_argument("--checkpointing", default=None,
                   help="ours: easy_context checkpointing (offload, ...) instead of the Trainer's per-layer one")
    p.add_argument("--baseline-attn", default="sdpa", help="baseline attn_implementation")
    p.add_argument("--variants", default="baseline,ours")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny config (code path only)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        a.seq_length, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab = 512, 64, 2, 4, 2, 128, 512
        a.min_doc, a.max_doc, a.steps, a.warmup = 32, 160, 2, 1
    return a


def documents(a, n_tokens: int):
    """Random-token documents (seeded) totalling at least n_tokens."""
    import random
    rng, docs, total = random.Random(0), [], 0
    while total < n_tokens:
        n = rng.randint(a.min_doc, min(a.max_doc, a.seq_length))
        docs.append([rng.randrange(3, a.vocab) for _ in range(n)])
        total += n
    return docs


def packed_rows(a, docs):
    """--trainer hf: greedy rows of at most seq_length tokens, DataCollatorWithFlattening's fields per row."""
    rows, cur = [], []
    for d in docs:
        if sum(map(len, cur)) + len(d) > a.seq_length and cur:
            rows.append(cur)
            cur = []
        cur.append(d)
    rows.append(cur)
    return [{"input_ids": sum(r, []), "labels": sum([[-100] + d[1:] for d in r], []),
             "position_ids": sum([list(range(len(d))) for d in r], [])} for r in rows]


def id_tokenizer(vocab: int):
    """A word-level tokenizer over token names t0..t{vocab-1} (the data is token ids already; trl wants one)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0")


class Timer:
    """Trainer callback: wall time and tokens of the steps after warm-up, peak GPU memory over them."""

    def __init__(self, warmup: int):
        from transformers import TrainerCallback

        outer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == warmup:
                    outer._sync()
                    import torch
                    if torch.cuda.is_available():
                        torch.cuda.reset_peak_memory_stats()
                    outer.t0, outer.tok0 = time.perf_counter(), state.num_input_tokens_seen

            def on_step_end(self, args, state, control, **kw):
                outer._sync()
                outer.t1, outer.tok1 = time.perf_counter(), state.num_input_tokens_seen
        self.callback = _CB()

    @staticmethod
    def _sync():
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def run_variant(a) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    ours = a.variant == "ours"
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                      max_position_embeddings=max(a.seq_length, 4096), rope_theta=1e6, tie_word_embeddings=False,
                      attn_implementation="sdpa" if ours else a.baseline_attn)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    steps = a.warmup + a.steps
    docs = documents(a, steps * a.seq_length + a.seq_length)
    common = dict(output_dir=tempfile.mkdtemp(prefix="bench_trainer_"), max_steps=steps, per_device_train_batch_size=1,
                  gradient_accumulation_steps=1, learning_rate=1e-5, logging_steps=1, save_strategy="no",
                  report_to="none", bf16=not a.tiny, use_cpu=a.tiny, seed=0, disable_tqdm=True,
                  gradient_checkpointing=not a.tiny and not (ours and a.checkpointing),
                  include_num_input_tokens_seen=True, dataloader_num_workers=0)
    if a.trainer == "sft":
        import datasets
        from trl import SFTConfig, SFTTrainer
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, packing=True, max_length=a.seq_length),
                             train_dataset=datasets.Dataset.from_dict({"input_ids": docs}),
                             processing_class=id_tokenizer(a.vocab))
    else:
        from transformers import Trainer, TrainingArguments, default_data_collator
        rows = packed_rows(a, docs)
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=rows,
                          data_collator=default_data_collator)
    timer = Timer(a.warmup)
    trainer.add_callback(timer.callback)
    if ours:
        from easy_context.integrations import enable_sequence_parallel
        enable_sequence_parallel(trainer, mode=a.mode, chunked_loss=not a.no_chunked_loss, attn_backend=a.attn_backend,
                                 fused_ops=a.fused_ops, checkpointing=a.checkpointing)
    res = {"variant": a.variant, "params": n_params}
    try:
        trainer.train()
    except torch.OutOfMemoryError:
        return {**res, "error": "out of memory"}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    secs = timer.t1 - timer.t0
    res.update(tok_s=(timer.tok1 - timer.tok0) / secs, step_s=secs / a.steps, loss1=losses[0],
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)
    return res


def main():
    a = flags()
    if a.variant:  # a child: one variant, result as JSON
        res = run_variant(a)
        with open(a.result, "w") as f:
            json.dump(res, f)
        return
    from bench.common import env_line, table
    results = {}
    for v in a.variants.split(","):
        out = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--variant", v, "--result", out]
        rc = subprocess.call(cmd)
        if rc != 0 or not os.path.exists(out):
            results[v] = {"variant": v, "error": f"exit status {rc}"}
            continue
        with open(out) as f:
            results[v] = json.load(f)
        os.remove(out)
    base = results.get("baseline", {})
    rows = []
    for v, r in results.items():
        row = {"variant": v, "tokens/s": f"{r['tok_s']:.0f}" if "tok_s" in r else r.get("error", ""),
               "s/step": f"{r['step_s']:.2f}" if "step_s" in r else "",
               "peak GiB": f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a",
               "loss step 1": f"{r['loss1']:.4f}" if "loss1" in r else ""}
        if v != "baseline" and "tok_s" in r and "tok_s" in base:
            row["tokens/s ratio"] = f"{r['tok_s'] / base['tok_s']:.2f}x"
            if r.get("peak_gib") and base.get("peak_gib"):
                row["peak ratio"] = f"{r['peak_gib'] / base['peak_gib']:.2f}x"
        rows.append(row)
    n = next((r["params"] for r in results.values() if "params" in r), 0)
    print(f"\n{a.trainer} trainer, {n / 1e9:.2f}B params, rows of <= {a.seq_length} tokens, {a.steps} timed steps "
          f"after {a.warmup}; ours: {a.mode} on 1 rank, chunked loss {not a.no_chunked_loss}, backend "
          f"{a.attn_backend or 'auto'}; baseline attn {a.baseline_attn}; {env_line()}")
    print(table(rows, ["variant", "tokens/s", "s/step", "peak GiB", "loss step 1", "tokens/s ratio", "peak ratio"]))


if __name__ == "__main__":
    main()
