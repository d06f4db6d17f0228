"""Shared by the examples: a tiny model / tokenizer / data made here (``--tiny``, CPU, no downloads) or real ones."""
from __future__ import annotations

import os
import tempfile


def add_flags(p) -> None:
    p.add_argument("--tiny", action="store_true", help="tiny Llama built from a config, tokenizer and data made here")
    p.add_argument("--model", default=None, help="HF model name or path (without --tiny)")
    p.add_argument("--mode", default="zigzag_ring_attn", help="easy_context mode (easy_context.SEQ_ALGOS)")
    p.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    p.add_argument("--ring-degree", type=int, default=None, help="usp_attn: ring size (ring x ulysses = sp)")
    p.add_argument("--chunked-loss", action="store_true", help="LM head + loss in token chunks (no full logits)")
    p.add_argument("--attn-backend", default=None, help="fa4 / cudnn / flash / ... (default: automatic)")
    p.add_argument("--no-sp", action="store_true", help="the same trainer without sequence parallelism")
    p.add_argument("--seq-length", type=int, default=256, help="tokens per packed row")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--gradient-accumulation-steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=0, help="PEFT LoRA adapters of this rank (0: full fine-tuning)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--save-steps", type=int, default=0, help="Trainer checkpoints every N steps (0: none)")
    p.add_argument("--resume", default=None, help="a checkpoint dir to resume from, or 'latest' (in --output-dir)")
    p.add_argument("--report", default=None, help="write the loss curve and the trained weights here (torch.save)")


def checkpoint_args(args) -> dict:
    """TrainingArguments for --save-steps."""
    return dict(save_strategy="steps", save_steps=args.save_steps) if args.save_steps else dict(save_strategy="no")


def train_and_report(trainer, args) -> None:
    """trainer.train() (resumed with --resume), then the losses on rank 0 (and --report: losses + weights)."""
    resume = True if args.resume == "latest" else args.resume
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        curve = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print("losses:", [round(x, 5) for x in curve])
        if args.report:
            import torch
            model = trainer.accelerator.unwrap_model(trainer.model)
            params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"loss": curve, "params": params}, args.report + ".tmp")
            os.replace(args.report + ".tmp", args.report)


def tiny_tokenizer():
    """A byte-level BPE with a chat template (easy_context_train.toy), trained on the toy corpus."""
    from easy_context_train.toy import build_tokenizer, make_corpus
    out = os.path.join(tempfile.gettempdir(), "easy_context_example_tok")
    return build_tokenizer(make_corpus(200), out)


def tiny_model(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=65536, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def load_model(args, tok):
    import torch
    if args.tiny:
        return tiny_model(len(tok))
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")


def per_rank(batch: int) -> int:
    """Rows each rank reads of a micro-batch of ``batch`` rows over all ranks (TRL's DPO / GRPO data parallelism)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if batch % world:
        raise SystemExit(f"--batch-size {batch} must be a multiple of the {world} ranks")
    return batch // world


def sp_options(args) -> dict:
    return dict(mode=args.mode, sp_size=args.sp_size, ring_degree=args.ring_degree, chunked_loss=args.chunked_loss,
                attn_backend=args.attn_backend)


def lora(args):
    if not args.lora_rank:
        return None
    from peft import LoraConfig
    return LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
