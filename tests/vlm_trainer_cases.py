"""Tiny VLM ``transformers.Trainer`` runs for tests/test_vlm.py (imported inside spawned gloo ranks).

Examples are single documents of text + images + a video (tests/vlm_models.make_doc); the collator pads them the way
TRL's ``DataCollatorForVisionLanguageModeling`` does (right padding, ``attention_mask``, labels -100 at padding and
at the placeholders, ``pixel_values`` / ``image_grid_thw`` / ``pixel_values_videos`` / ``video_grid_thw`` of the batch,
``mm_token_type_ids`` as Qwen processors return it). The one-process run is the plain Trainer on the model's own
padded path; the sequence-parallel run is the same Trainer after ``enable_sequence_parallel``.
"""
from __future__ import annotations

import torch

STEPS, GA, BATCH, LR = 4, 2, 2, 5e-3
SHAPES = [  # one document per example: (segments)
    [("t", 5), ("img", (4, 4)), ("t", 7)],
    [("t", 3), ("vid", (2, 4, 4)), ("t", 4), ("img", (4, 8)), ("t", 2)],
    [("t", 9), ("img", (8, 4)), ("t", 3)],
    [("t", 4), ("t", 6)],
    [("t", 2), ("img", (4, 4)), ("t", 2), ("img", (4, 4)), ("t", 5)],
    [("t", 6), ("vid", (3, 4, 4)), ("t", 6)],
]


def examples(family: str, n: int = STEPS * GA * BATCH, seed: int = 3) -> list[dict]:
    from tests.vlm_models import PATCH, make_doc
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids, images, videos = make_doc(family, SHAPES[i % len(SHAPES)], g)
        ex = {"input_ids": ids, "images": images, "videos": videos}
        ex["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in images), PATCH, generator=g)
        ex["pixel_values_videos"] = torch.randn(sum(t * h * w for t, h, w in videos), PATCH, generator=g)
        out.append(ex)
    return out


def collate(batch: list[dict], pad_id: int = 0) -> dict:
    from easy_context.vlm.positions import IMAGE, VIDEO
    from tests.vlm_models import IMG, VID
    n = max(len(ex["input_ids"]) for ex in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, ex in enumerate(batch):
        ids[r, :len(ex["input_ids"])] = torch.tensor(ex["input_ids"])
        mask[r, :len(ex["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[(ids == IMG) | (ids == VID)] = -100
    types = torch.zeros_like(ids, dtype=torch.int)
    types[ids == IMG], types[ids == VID] = IMAGE, VIDEO
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": types}
    images = [g for ex in batch for g in ex["images"]]
    videos = [g for ex in batch for g in ex["videos"]]
    if images:
        out["pixel_values"] = torch.cat([ex["pixel_values"] for ex in batch])
        out["image_grid_thw"] = torch.tensor(images)
    if videos:
        out["pixel_values_videos"] = torch.cat([ex["pixel_values_videos"] for ex in batch])
        out["video_grid_thw"] = torch.tensor(videos)
    return out


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=r".*language_model.*\.(q_proj|v_proj|o_proj)")


def run(family: str, out: str, sp: dict | None = None, lora: bool = False, evaluate: bool = False, **args_kw) -> dict:
    """Train STEPS optimizer steps (GA 2); returns {"loss": curve, "weights": trainable parameters} (+ "eval_loss"
    on 4 more examples when ``evaluate``)."""
    from transformers import Trainer, TrainingArguments
    from easy_context.integrations import enable_sequence_parallel
    from tests.vlm_models import make_vlm
    model = make_vlm(family)
    for name, p in model.named_parameters():  # a key bias has an exactly zero gradient (softmax ignores a constant
        if name.endswith("k_proj.bias"):      # per query): Adam would turn its rounding noise into lr-sized steps
            p.requires_grad_(False)
    if lora:
        from peft import get_peft_model
        model = get_peft_model(model, lora_config())
    args = TrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=GA, learning_rate=LR, lr_scheduler_type="constant",
                             warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0,
                             remove_unused_columns=False, per_device_eval_batch_size=BATCH, **args_kw)
    trainer = Trainer(model=model, args=args, train_dataset=examples(family), data_collator=collate,
                      eval_dataset=examples(family, 4, seed=5) if evaluate else None)
    if sp is not None:
        enable_sequence_parallel(trainer, **sp)
    else:  # the Qwen VLMs say accepts_loss_kwargs=False, so the plain Trainer would average micro-batch means; the
        # reference is the token mean over the GA window, the loss the integration (and train.py) trains on
        trainer.model_accepts_loss_kwargs = True
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    weights = {n.replace("module.", "", 1) if n.startswith("module.") else n: w for n, w in weights.items()}
    res = {"loss": loss, "weights": weights}
    if evaluate:
        res["eval_loss"] = trainer.evaluate()["eval_loss"]
    return res
