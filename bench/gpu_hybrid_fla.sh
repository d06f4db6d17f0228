#!/usr/bin/env bash
# Gated DeltaNet on flash-linear-attention (issue #49) on one GPU, each step within one 10-minute device call.
# The GPU machine has torch 2.11 (whose bundled Triton fla 0.6 refuses for its gated backward on Hopper: "Triton >=
# 3.4.0 and < 3.7.1 ... incorrect results") and transformers 5.17, and no package index. On the CPU machine, once:
#   bash bench/gpu_hybrid_fla.sh pack     # -> .gpusite/site.tar.xz (git-ignored, ~44 MB: one carry): Triton 3.7.1
#                                         # (cp312; debug info stripped, profiler/CUPTI/Blackwell ptxas/disassemblers left out),
#                                         # fla-core 0.6.0, einops, transformers 5.24.0 (whose qwen3_next / qwen3_5
#                                         # layers speak the hybrid-cache protocol the recurrent paths use)
# On the GPU machine; every step unpacks it into /tmp/fla-site first when missing (carry .gpusite in the first call;
# later calls on the same warm machine need no carry):
#   bash bench/gpu_hybrid_fla.sh test [-k ...]  # tests/test_delta_fla.py (fla vs torch, W = 2/4/8, bf16 drift) + CPU tests
#   bash bench/gpu_hybrid_fla.sh layer    # bench_hybrid one layer (Qwen3-Next shape) at 32K and 128K: new vs old path
#   bash bench/gpu_hybrid_fla.sh model [L...]  # bench_hybrid --model: Qwen3.5-9B-width stack vs attention twin
#                                         # (default L = 32768 131072; ~9 min with first-call compiling)
#   bash bench/gpu_hybrid_fla.sh layer9b  # the 9B-width GDN layer at W = 8, 128K: par/share, peaks
#   bash bench/gpu_hybrid_fla.sh model512 # the same stack pair at 512K, one step each, checkpoint offload, the
#                                         # recurrent layers in TILES (default 8) tiles (untiled: out of 139 GB)
#   bash bench/gpu_hybrid_fla.sh profile  # bench/gdn_profile.py: the 9B-width layer's own vs parallel path, 16K tokens
#   bash bench/gpu_hybrid_fla.sh save-cache  # $OUT/tcache.tar.xz: Triton's cache with autotuning picks; copied into
#                                         # .gpusite/, later calls carrying .gpusite skip the first-call tuning
# Logs go to $OUT (the device call's output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
SITE=/tmp/fla-site
KEEP_MODELS="auto llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe qwen3_next qwen3_5 qwen3_5_moe gemma gemma2 gemma3
  phi3 olmo2 lfm2 lfm2_moe mamba mamba2 falcon_mamba bamba jamba zamba zamba2 nemotron_h granitemoehybrid falcon_h1"
export PYTHONPATH=${FLA_ONE_CONFIG:+$PWD/bench/fla_one_config:}$SITE:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TRITON_CACHE_DIR=/tmp/tcache TRITON_CACHE_AUTOTUNING=1
install() {
  if [ ! -d "$SITE/fla" ]; then
    [ -f .gpusite/site.tar.xz ] || { echo "no $SITE and no .gpusite/site.tar.xz: carry .gpusite (made by: $0 pack)" >&2; exit 2; }
    mkdir -p "$SITE" && tar -C "$SITE" -xJf .gpusite/site.tar.xz
  fi
  # Triton's compiled kernels and autotuning picks persist in /tmp/tcache; a cache saved by an earlier call
  # (save-cache -> $OUT/tcache.tar.xz, copied to .gpusite/) is unpacked, so a fresh machine skips minutes of tuning
  if [ -f .gpusite/tcache.tar.xz ] && [ ! -d /tmp/tcache ]; then mkdir -p /tmp/tcache && tar -C /tmp/tcache -xJf .gpusite/tcache.tar.xz; fi
  python3 -c "import triton, fla, transformers, torch; print('triton', triton.__version__, '| fla', fla.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__, '|', torch.cuda.get_device_name())"
}
case "${1:-}" in
  pack)  # CPU machine: one xz tarball of a site dir (pip --target), small enough for one carry with the tree
    t=$(mktemp -d) && mkdir -p .gpusite "$t/site"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$t" triton==3.7.1
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$t" fla-core==0.6.0 einops==0.8.2 transformers==5.24.0
    for w in "$t"/*.whl; do unzip -q -o "$w" -d "$t/site"; done  # a wheel is a zip (pip refuses cp312 here)
    (cd "$t/site/triton" && rm -rf backends/nvidia/lib/cupti backends/nvidia/bin/ptxas-blackwell _C/libproton.so \
      instrumentation/libGPUInstrumentationTestLib.so plugins/*TestLib* plugins/*.so* FileCheck \
      backends/nvidia/bin/nvdisasm backends/nvidia/bin/cuobjdump && strip --strip-unneeded _C/libtriton.so)  # SASS dumps only
    rm -rf "$t/site/bin"
    # transformers' model folders beyond the families the tests and benches build (~10 MB compressed): room in the
    # carry for Triton's cache (tcache.tar.xz), so a fresh machine skips the first call's autotuning
    (cd "$t/site/transformers/models" && for d in */; do d=${d%/}; case " $(echo $KEEP_MODELS) " in *" $d "*) ;; *) rm -rf "$d" ;; esac; done)
    tar -C "$t/site" -cf - . | xz -T0 -9 > .gpusite/site.tar.xz.tmp && mv .gpusite/site.tar.xz.tmp .gpusite/site.tar.xz
    rm -rf "$t"; ls -la .gpusite ;;
  test)  # extra arguments go to pytest (e.g. -k fused)
    shift
    install
    timeout 520 python3 -m pytest -v -p no:cacheprovider --durations=8 -W ignore tests/test_delta_fla.py tests/test_delta_prepass.py "$@" \
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
    timeout 560 python3 bench/bench_hybrid.py --model --lengths ${@:-32768 131072} --no-layer 2>&1 | grep -v Warn \
      | tee "$OUT/hybrid_fla_model.log" | tail -8 || true ;;
  layer9b)  # one call of its own: with `model` it ran past 560 s
    install
    timeout 560 python3 bench/bench_hybrid.py --length 131072 --size qwen35 --layers gated_deltanet --worlds 8 \
      --no-chain --no-old --iters 2 2>&1 | grep -v Warn | tee "$OUT/hybrid_fla_layer9b.log" | tail -8 || true ;;
  model512)  # extra arguments go to bench_hybrid.py (e.g. --stacks hybrid --warmup 0)
    shift
    install
    timeout 560 python3 bench/bench_hybrid.py --model --lengths 524288 --steps 1 --no-layer --checkpointing offload \
      --recurrent-tiles ${TILES:-8} "$@" \
      2>&1 | grep -v Warn | tee "$OUT/hybrid_fla_model512.log" | tail -8 || true ;;
  profile)
    install
    timeout 470 python3 bench/gdn_profile.py --tokens 16384 --spans 0 1024 4096 2>&1 | grep -v Warn | tee "$OUT/gdn_profile.log" | head -90 || true ;;
  save-cache)  # the Triton cache (kernels + autotuning picks) back to this machine: copy it to .gpusite/ and carry
    tar -C /tmp/tcache -cf - . | xz -T0 -6 > "$OUT/tcache.tar.xz"; ls -la "$OUT/tcache.tar.xz" ;;
  *) echo "usage: $0 pack|test|layer|model [L...]|layer9b|model512|profile|save-cache" >&2; exit 2 ;;
esac
