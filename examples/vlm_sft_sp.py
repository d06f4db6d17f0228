#!/usr/bin/env python
"""trl.SFTTrainer on a vision-language model (Qwen2.5-VL / Qwen3-VL / Qwen3.5) with EasyContext sequence parallelism.

    # CPU, a tiny Qwen2.5-VL, tokenizer, image processor and image + text data made here (no downloads)
    torchrun --nproc_per_node 2 examples/vlm_sft_sp.py --tiny --mode zigzag_ring_attn
    torchrun --nproc_per_node 2 examples/vlm_sft_sp.py --tiny --mode ulysses_attn --lora-rank 8
    python examples/vlm_sft_sp.py --tiny --no-sp                  # the same SFTTrainer on one process, no SP
    # GPUs: 8 ranks share each long row of images / video frames, bf16, chunked loss
    accelerate launch --num_processes 8 examples/vlm_sft_sp.py --model Qwen/Qwen2.5-VL-3B-Instruct \
        --dataset HuggingFaceH4/llava-instruct-mix-vsft --bf16 --chunked-loss --gradient-checkpointing

TRL's vision collator pads its rows; under SP every run of padding becomes a document of its own (it attends to
nothing real and is never a target), the images' and videos' 3-D positions are computed on the whole rows, and each
rank encodes only the images / frames its shard holds (docs/vlm.md). The lines an SFTTrainer user adds are marked
"# <- SP".
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.common import add_flags, checkpoint_args, sp_options, train_and_report  # noqa: E402

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def tiny_processor():
    """A Qwen2.5-VL processor over the toy byte-level tokenizer (+ the vision tokens), patch 2, merge 2."""
    import transformers as tf
    from easy_context_train.toy import build_tokenizer, make_corpus

    class TinyQwenVLProcessor(tf.Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # no video processor here (it needs torchvision)
            return None

    tok = build_tokenizer(make_corpus(200), os.path.join(tempfile.gettempdir(), "easy_context_vlm_tok"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    images = Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16,
                                      max_pixels=32 * 32)
    return TinyQwenVLProcessor(image_processor=images, tokenizer=tok)


def tiny_model(processor):
    import torch
    import transformers as tf
    tok = processor.tokenizer
    ids = {f"{k}_token_id": tok.convert_tokens_to_ids(t) for k, t in
           zip(("vision_start", "vision_end", "image", "video"), SPECIAL)}
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=65536, tie_word_embeddings=False,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, pad_token_id=tok.pad_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1])
    torch.manual_seed(0)
    model = tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    for name, p in model.named_parameters():  # a key bias has an exactly zero gradient: Adam steps on its noise
        if name.endswith("k_proj.bias"):
            p.requires_grad_(False)
    return model


def tiny_dataset(n: int = 64):
    """Captions of 1-3 random images (sizes vary, so rows and image token counts do)."""
    import datasets
    import numpy as np
    from PIL import Image
    from easy_context_train.toy import make_corpus
    rng = np.random.default_rng(0)
    texts, images = [], []
    for i, words in enumerate(make_corpus(n, seed=1)):
        k = 1 + i % 3
        imgs = [Image.fromarray((rng.random((8 + 4 * (j % 3), 12 + 4 * (i % 2), 3)) * 255).astype("uint8"))
                for j in range(k)]
        texts.append(" ".join([IMAGE] * k) + " " + " ".join(words.split()[:12 + i % 7]))
        images.append(imgs)
    return datasets.Dataset.from_dict({"images": images, "text": texts})


def lora(args):
    if not args.lora_rank:
        return None
    from peft import LoraConfig
    return LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                      target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)")  # the language model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    p.add_argument("--dataset", default=None, help="an image-text dataset ('images' + 'messages' or 'text')")
    p.add_argument("--split", default="train")
    args = p.parse_args()
    import datasets
    import torch
    from trl import SFTConfig, SFTTrainer

    from easy_context.integrations import enable_sequence_parallel  # <- SP

    if args.tiny:
        processor = tiny_processor()
        model, data = tiny_model(processor), tiny_dataset()
    else:
        from transformers import AutoModelForImageTextToText, AutoProcessor
        processor = AutoProcessor.from_pretrained(args.model)
        model = AutoModelForImageTextToText.from_pretrained(
            args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32, attn_implementation="sdpa")
        data = datasets.load_dataset(args.dataset, split=args.split)
    cfg = SFTConfig(
        output_dir=args.output_dir or os.path.join("output", "vlm_sft_sp"), max_steps=args.max_steps,
        per_device_train_batch_size=2, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr, logging_steps=1, report_to="none", bf16=args.bf16, **checkpoint_args(args),
        use_cpu=args.tiny, gradient_checkpointing=args.gradient_checkpointing, seed=0, max_length=None,
        remove_unused_columns=False)  # the collator reads the raw "images" and "text" columns
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=data, processing_class=processor,
                         peft_config=lora(args))
    if not args.no_sp:
        enable_sequence_parallel(trainer, **sp_options(args))  # <- SP
    else:  # Qwen VLMs declare accepts_loss_kwargs=False: the plain Trainer would average micro-batch means under
        trainer.model_accepts_loss_kwargs = True  # GA; SP trains on the token mean of the window (as train.py)
    train_and_report(trainer, args)


if __name__ == "__main__":
    main()
