"""Give a base model's tokenizer a chat template, so the curriculum and the evals' --chat-template run on it.

    python -m easy_context_train.real_model.chat_template MODEL_DIR [--family gemma]

Gemma 3 270M is a base model: its GGUF has no chat template, but its vocabulary has Gemma's turn tokens
(``<start_of_turn>``, ``<end_of_turn>``: one id each). This writes Gemma's own turn format (the instruct models'
layout: user / model turns, ``<bos>`` first) into MODEL_DIR's tokenizer and makes ``<end_of_turn>`` the end-of-sequence
token, so greedy generation stops at the end of a reply. Run it after prepare_data.py (which separates documents with
the end-of-sequence token: raw text keeps ``<eos>``).
"""
from __future__ import annotations

import argparse
import sys

TEMPLATES = {
    "gemma": ("{{ bos_token }}{% for m in messages %}"
              "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
              "<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}", "<end_of_turn>"),
}


def apply(model_dir: str, family: str = "gemma") -> None:
    from transformers import AutoTokenizer
    template, eos = TEMPLATES[family]
    tok = AutoTokenizer.from_pretrained(model_dir)
    if len(tok(eos, add_special_tokens=False)["input_ids"]) != 1:
        raise ValueError(f"{model_dir}: {eos!r} is not one token of this tokenizer: not a {family} vocabulary")
    tok.chat_template = template
    tok.eos_token = eos
    tok.save_pretrained(model_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--family", choices=sorted(TEMPLATES), default="gemma")
    a = p.parse_args(argv)
    try:
        apply(a.model_dir, a.family)
    except (ValueError, OSError) as e:
        print(f"chat_template: error: {e}", file=sys.stderr)
        return 2
    print(f"{a.model_dir}: {a.family} chat template, end of sequence {TEMPLATES[a.family][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
