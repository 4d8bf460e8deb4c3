# MLX's CUDA kernel cache carried between device calls (sourced by on_device.sh; tests/benchmarks/test_ptx_cache.py).
# MLX reads a cached module's .ptx (a cubin on sm_90) and .txt and loads it without a check. In session 47 a call
# cut at its time limit mid-pack left a truncated ptx.tgz; the next call's extraction left one 4-bit GEMM's cubin at
# 228 KB of ~2.6 MB, and both 8B 4-bit full runs then died with a segfault at their first 32-stream step, very
# likely its load (its m16 and m64 twins were compiled afresh in the same run).

# restore_ptx_cache TARBALL DIR: extract only an archive that reads to its end, then drop half-written modules
restore_ptx_cache() {
  local tarball=$1 dir=$2
  mkdir -p "$dir"
  [ -f "$tarball" ] || return 0
  if ! tar tzf "$tarball" > /dev/null 2>&1; then
    echo "ptx cache: $tarball is cut short (a call ended while packing it); starting with an empty cache" >&2
    return 0
  fi
  tar xzf "$tarball" -C "$dir"
  drop_partial_modules "$dir"
}

# drop_partial_modules DIR: MLX writes a module's .ptx, then .txt, then .cu: one without its .cu was cut mid-write
drop_partial_modules() {
  local dir=$1 ptx
  for ptx in "$dir"/*.ptx; do
    [ -e "$ptx" ] || continue
    if [ ! -f "${ptx%.ptx}.cu" ]; then
      echo "ptx cache: dropping $(basename "${ptx%.ptx}"): its files were cut mid-write" >&2
      rm -f "$ptx" "${ptx%.ptx}.txt"
    fi
  done
}

# pack_dir DIR TARBALL: written beside, then renamed, so a call cut mid-pack keeps the last whole archive
pack_dir() {
  local dir=$1 tarball=$2
  local partial
  partial="$(dirname "$tarball")/.$(basename "$tarball").part"
  tar czf "$partial" -C "$dir" . && mv -f "$partial" "$tarball"
}
