# Several bench runs in one device call, each with its own label, their outputs in two tarballs under $OUT (a call
# brings back at most 8 files): source it from the call's script, then `run LABEL [run_gpu_bench arguments]`.
#   source benchmarks/gpu/device_runs.sh     # installs MLX (on_device.sh --install-only): after the staging call
#   run d06_1 --shapes 0.6b --contended-only
#   run t06_1 --shapes 0.6b --contended-only --traced-midpoints on
# After every run and on exit $OUT holds runs.tgz (every LABEL/gpu_bench.{json,md} and LABEL.log) and ptx.tgz (the
# kernel cache: carry it as .ptx-cache/ptx.tgz next call). /root/r outlives a call on a warm machine, so a later call's runs.tgz holds the
# earlier calls' runs too. `BENCH` holds the arguments every run shares (the issue's contended settings by default).
# `HOST_WAITS=1 run LABEL ...` preloads benchmarks/gpu/host_waits.c (built when the .so is older than it): the engine
# thread's blocking waits in MLX land in the contended pass's `submission_waits` and the longest gap's `waits`.
# `API_CALLS=1` times every CUDA call of the contended pass through CUPTI (benchmarks/gpu/api_calls.c, built there).
# `RUN_LIMIT_S` (360) bounds each run. `HOST_SAMPLES=1` samples the engine thread's Python stack through the
# contended pass (benchmarks/gpu/host_samples.py):
# the longest gap's `samples`, and each prefill step's Python ms against ms inside mx.async_eval (`queue_split`).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # a crash in MLX prints every thread's Python stack to the log
source benchmarks/gpu/on_device.sh --install-only || exit 3
mkdir -p /root/r
# the tarballs are written after every run too: a call killed at its time limit runs no trap
pack() { pack_dir "$MLX_PTX_CACHE_DIR" "$OUT/ptx.tgz"; pack_dir /root/r "$OUT/runs.tgz"; }
trap pack EXIT
BENCH=${BENCH:-"--quick --decode-prompt 512 --cost-model affine --step-target-ms auto"}
run() {
  local label=$1
  shift
  local started=$SECONDS preload=
  if [ "${HOST_WAITS:-0}" = 1 ]; then
    preload=/root/host_waits.so
    [ "$preload" -nt benchmarks/gpu/host_waits.c ] \
      || cc -O2 -shared -fPIC -o "$preload" benchmarks/gpu/host_waits.c -ldl -lpthread \
      || { echo "== $label: the host_waits shim did not build"; return 1; }
  fi
  # a run past RUN_LIMIT_S is stopped (rc 124), so one hung run cannot spend the whole call (session 47 lost 420 s so);
  # by SIGABRT, so PYTHONFAULTHANDLER writes every thread's stack to the log first (n30_5 hung for 450 s without one)
  # shellcheck disable=SC2086
  timeout -s ABRT -k 15 "${RUN_LIMIT_S:-360}" env ${preload:+LD_PRELOAD=$preload} \
    python3 -m benchmarks.gpu.run_gpu_bench $BENCH \
    --out "/root/r/$label" "$@" > "/root/r/$label.log" 2>&1
  echo "== $label rc=$? $((SECONDS - started)) s"
  grep -A12 '^Fatal Python error' "/root/r/$label.log" | cut -c1-200  # PYTHONFAULTHANDLER's stacks, if it crashed
  grep '^|' "/root/r/$label/gpu_bench.md" 2>/dev/null | cut -c1-200
  pack
}
