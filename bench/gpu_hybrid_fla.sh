#!/usr/bin/env bash
# Gated DeltaNet on flash-linear-attention (issue #49) on one GPU, each step within one 10-minute device call.
# On the CPU machine, once (fills .fla/, git-ignored, ~14 MB: fla-core 0.6.0 + einops + transformers 5.24.0, whose
# qwen3_next / qwen3_5 layers speak the hybrid-cache protocol the recurrent paths use; the GPU has 5.17):
#   bash bench/gpu_hybrid_fla.sh wheels
# On the GPU machine (carry .fla); every step installs the wheels into /tmp/fla-site first when missing:
#   bash bench/gpu_hybrid_fla.sh test     # tests/test_delta_fla.py (fla vs torch, W = 2/4/8, bf16 drift) + CPU tests
#   bash bench/gpu_hybrid_fla.sh layer    # bench_hybrid one layer (Qwen3-Next shape) at 32K and 128K: new vs old path
#   bash bench/gpu_hybrid_fla.sh model [L...]  # bench_hybrid --model: Qwen3.5-9B-width stack vs attention twin
#                                         # (default L = 32768 131072), then the 9B-width GDN layer at W = 8, 128K
#   bash bench/gpu_hybrid_fla.sh model512 # the same stack pair at 512K, one timed step each (twin ~80 s a step)
# fla 0.6 refuses its gated backward on Hopper under Triton < 3.7.1 (torch 2.11 bundles one): `triton-pack` here,
# then on the GPU machine `triton-keep` four times (carry .tri/a .. .tri/d), `triton-install`, and
# TRITON_SITE=/tmp/tri-site before test / layer / model.
# Logs go to $OUT (the device call's output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
SITE=/tmp/fla-site
export PYTHONPATH=${TRITON_SITE:+$TRITON_SITE:}$SITE:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
install() {
  if [ ! -d "$SITE/fla" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .fla/*.whl
  fi
  python3 -c "import fla, transformers, torch; print('fla', fla.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__, '|', torch.cuda.get_device_name())"
}
case "${1:-}" in
  triton-pack)  # fla's gated backward needs Triton >= 3.7.1 on Hopper (torch 2.11 bundles an older one): 4 carries (the tree travels too)
    mkdir -p .tri/a .tri/b .tri/c .tri/d && rm -f .tri/*/*
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_27_x86_64 -d .tri triton==3.7.1
    (cd .tri && sha256sum triton-*.whl | sed 's|  |  /tmp/tri/|' > d/SHA256 && split -n 4 -d triton-*.whl part. \
      && mv part.00 a/ && mv part.01 b/ && mv part.02 c/ && mv part.03 d/ && rm triton-*.whl); ls -la .tri/* ;;
  triton-keep)  # carry .tri/a, .tri/b, .tri/c, .tri/d: one call each, back to back
    mkdir -p /tmp/tri && cp .tri/*/* /tmp/tri/ && ls -la /tmp/tri ;;
  triton-install)  # -> /tmp/tri-site; then TRITON_SITE=/tmp/tri-site bash bench/gpu_hybrid_fla.sh test|layer|...
    cat /tmp/tri/part.0? > /tmp/tri/triton-3.7.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
    sha256sum -c /tmp/tri/SHA256
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tri-site /tmp/tri/triton-*.whl
    PYTHONPATH=/tmp/tri-site python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)" ;;
  wheels)
    mkdir -p .fla
    python3 -m pip download -q --no-deps --only-binary=:all: -d .fla fla-core==0.6.0 einops transformers==5.24.0
    ls -la .fla ;;
  test)
    install
    timeout 540 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_delta_fla.py tests/test_delta_prepass.py \
      2>&1 | tee "$OUT/test_delta_fla.log" | tail -30 || true ;;
  layer)
    install
    timeout 270 python3 bench/bench_hybrid.py --length 32768 --layers gated_deltanet 2>&1 | grep -v Warn \
      | tee "$OUT/hybrid_fla_32k.log" | tail -9 || true
    timeout 270 python3 bench/bench_hybrid.py --length 131072 --layers gated_deltanet --iters 2 --no-chain 2>&1 \
      | grep -v Warn | tee "$OUT/hybrid_fla_128k.log" | tail -9 || true ;;
  model)
    shift
    install
    timeout 560 python3 bench/bench_hybrid.py --model --lengths ${@:-32768 131072} --worlds 8 --length 131072 \
      --no-chain --iters 2 2>&1 | grep -v Warn | tee "$OUT/hybrid_fla_model.log" | tail -16 || true ;;
  model512)
    install
    timeout 560 python3 bench/bench_hybrid.py --model --lengths 524288 --steps 1 --no-layer 2>&1 | grep -v Warn \
      | tee "$OUT/hybrid_fla_model512.log" | tail -8 || true ;;
  *) echo "usage: $0 wheels|test|layer|model [L...]|model512" >&2; exit 2 ;;
esac
