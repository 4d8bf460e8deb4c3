#!/usr/bin/env bash
# The GPU run in one device call, after the recipe's call 1 (../shared/device/README.md: stage the wheels here with
# ../shared/device/stage-wheels.sh; call 1 copies part A to /root/stage). Call 2, carrying .device-wheels/b:
#   bash benchmarks/gpu/on_device.sh [--no-check] [run_gpu_bench arguments...]
#   source benchmarks/gpu/on_device.sh --install-only   (installs, sets PYTHONPATH in the calling shell)
# installs MLX's CUDA wheels into /root/site, checks greedy parity with mlx-lm (check_engine), then runs the bench
# with its JSON, table and log under $OUT. Put every run of a session into one call: a fresh machine costs minutes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
check=1
install_only=0
if [ "${1:-}" = "--no-check" ]; then check=0; shift; fi
if [ "${1:-}" = "--install-only" ]; then install_only=1; shift; fi
OUT=${OUT:-gpu_bench_out}
mkdir -p "$OUT"
wheels=.device-wheels
[ -f /root/stage/part_aa ] || { echo "part A is not on this machine (cold start): repeat the recipe's call 1" >&2; exit 3; }
name=$(cat "$wheels/b/CUDA_WHEEL_NAME")
cat /root/stage/part_aa "$wheels/b/part_ab" > "/root/stage/$name"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site \
  "/root/stage/$name" "$wheels"/b/*.whl || exit 3
export PYTHONPATH=/root/site:$PWD
# MLX's compiled CUDA kernels (NVRTC: minutes for the 4-bit GEMMs) persist across machines: carry .ptx-cache (the
# ptx.tgz a previous call left under $OUT) and the JIT reads them instead of compiling; the cache goes back in $OUT
export MLX_PTX_CACHE_DIR=/root/ptx
source benchmarks/gpu/ptx_cache.sh
restore_ptx_cache .ptx-cache/ptx.tgz "$MLX_PTX_CACHE_DIR"
trap 'pack_dir "$MLX_PTX_CACHE_DIR" "$OUT/ptx.tgz"' EXIT
# llguidance (structured output) has no wheel for the device's Python on the registry mirror; the bench never
# constrains a request, so an import-only stand-in lets the engine load there
if ! python3 -c "import llguidance" 2>/dev/null; then
  mkdir -p /root/site/llguidance
  for m in __init__ hf numpy; do printf 'def __getattr__(name):\n    return None\n' > "/root/site/llguidance/$m.py"; done
fi
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
if [ "$install_only" = 1 ]; then return 0 2>/dev/null || exit 0; fi
if [ "$check" = 1 ]; then
  python3 -m benchmarks.gpu.check_engine > "$OUT/check_engine.log" 2>&1 || { tail -20 "$OUT/check_engine.log"; exit 1; }
  tail -3 "$OUT/check_engine.log"
fi
python3 -m benchmarks.gpu.run_gpu_bench --out "$OUT/bench" "$@" > "$OUT/bench.log" 2>&1
rc=$?
grep -v '^\[' "$OUT/bench.log" | tail -80
exit $rc
