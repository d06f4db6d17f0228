"""Tiny Trainer / SFTTrainer runs for tests/test_integrations.py (imported inside spawned gloo ranks).

Every rank builds the same tiny Llama from a seed (float32, CPU), reads the tokenizer the parent built, and trains 3
optimizer steps with gradient accumulation 2, logging every step; a run returns its loss curve and eval loss.
"""
from __future__ import annotations

import os

STEPS, GA, LR = 3, 2, 2e-3


def tiny_model(vocab: int, seed: int = 0, heads: int = 4, kv_heads: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=1024, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.float32)


def doc_dataset(tok, n: int = 24, seed: int = 0):
    """Pre-tokenized documents of unequal lengths (input_ids only: labels come from the collator)."""
    import datasets
    from easy_context_train.toy import make_corpus
    docs = make_corpus(n, seed)
    ids = [tok(d)["input_ids"][: 20 + 7 * (i % 5)] for i, d in enumerate(docs)]
    return datasets.Dataset.from_dict({"input_ids": ids})


def chat_dataset(n: int = 24, seed: int = 0):
    import datasets
    from easy_context_train.toy import make_chat_corpus
    return datasets.Dataset.from_dict({"messages": make_chat_corpus(n, seed)})


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")


def common_args(out: str, ga: int = GA, **kw) -> dict:
    return {**dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                   gradient_accumulation_steps=ga, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                   logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, data_seed=0,
                   disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0), **kw}


def make_trainer(kind: str, tok_dir: str, out: str, lora: bool = False, ga: int = GA, eval_rows: int = 0,
                 model=None, **args_kw):
    """kind "trainer": transformers.Trainer on documents + DataCollatorWithFlattening; "sft": trl.SFTTrainer on a chat
    dataset with packing (bfd, padding-free)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = model if model is not None else tiny_model(len(tok))
    if kind == "trainer":
        from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
        if lora:
            from peft import get_peft_model
            model = get_peft_model(model, lora_config())
        ds = doc_dataset(tok)
        ev = doc_dataset(tok, eval_rows, seed=1) if eval_rows else None
        return Trainer(model=model, args=TrainingArguments(**common_args(out, ga, **args_kw)), train_dataset=ds,
                       eval_dataset=ev, data_collator=DataCollatorWithFlattening(), processing_class=tok)
    from trl import SFTConfig, SFTTrainer
    cfg = SFTConfig(**common_args(out, ga, **args_kw), packing=True, max_length=48, bf16=False,
                    dataset_num_proc=None, eval_packing=True)
    ev = chat_dataset(eval_rows, seed=1) if eval_rows else None
    return SFTTrainer(model=model, args=cfg, train_dataset=chat_dataset(), eval_dataset=ev, processing_class=tok,
                      peft_config=lora_config() if lora else None)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run(kind: str, tok_dir: str, out: str, sp: dict | None = None, lora: bool = False, ga: int = GA,
        eval_rows: int = 0, **args_kw) -> dict:
    """Train (and evaluate); ``sp``: enable_sequence_parallel options (None = the plain trainer)."""
    from easy_context.integrations import enable_sequence_parallel
    t = make_trainer(kind, tok_dir, out, lora=lora, ga=ga, eval_rows=eval_rows, **args_kw)
    if sp is not None:
        enable_sequence_parallel(t, **sp)
    t.train()
    res = {"loss": losses(t)}
    if eval_rows:
        res["eval_loss"] = t.evaluate()["eval_loss"]
    return res


def out_dir(root: str, name: str) -> str:
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.path.join(root, f"{name}-r{rank}")
