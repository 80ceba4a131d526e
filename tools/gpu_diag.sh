#!/usr/bin/env bash
# Issue 37 on a 4-GPU machine: where transpose_sum runs lose time (bench dask-timeline),
# then dask-cuda's own benchmark (bench dask-cuda) on two GPUs and on every GPU.
#   OUT=... bash tools/gpu_diag.sh        (carry .whl and .whl_ucx)
# Env: RUNS (timeline runs per variant), V4 / V2 (timeline variants on all GPUs / two;
# "-" skips), BENCH=0 skips bench dask-cuda (BENCH4=0 only its run on every GPU), TESTS=1 runs the Dask GPU tests after the
# timelines (on GPUs 2,3 beside bench x2 when there are four; tests.txt).  At most 8
# files come back from $OUT.
set -u
OUTDIR="${OUT:-$PWD/gpu_diag_out}"; mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
t0=$SECONDS
for d in .whl_ucx .whl; do
  compgen -G "$d/*.whl" >/dev/null && python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl
done
echo "install $((SECONDS - t0)) s"
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || { echo "build failed"; tail /tmp/build.log; }
nvidia-smi -L
n=$(nvidia-smi -L | wc -l)
devs=$(seq -s, 0 $((n - 1)))
tl() {  # tl DEVICES VARIANTS JSON SECONDS
  [ "$2" = "-" ] && return 0
  timeout --kill-after=10 "$4" python3 -m cupy_poolmem.benchmarks.dask_timeline \
    --devices "$1" --variants "$2" --runs "${RUNS:-8}" --json "$OUTDIR/$3" 2>/tmp/$3.err \
    | tee -a "$OUTDIR/timeline.txt"
  local rc=${PIPESTATUS[0]}  # the benchmark's (or timeout's 124), not tee's
  echo "== tl $1 $2: exit $rc at $((SECONDS - t0)) s" | tee -a "$OUTDIR/timeline.txt"
}
bench() {  # bench DEVICES NAME SECONDS [extra args]
  local devs=$1 name=$2 secs=$3; shift 3
  rm -rf "/tmp/save-$name"
  timeout --kill-after=10 "$secs" python3 -m cupy_poolmem.benchmarks.dask_cuda_local --devices "$devs" \
    --runs 5 --timeout 110 --log-dir "/tmp/logs-$name" --save "/tmp/save-$name" "$@" \
    > "/tmp/bench-$name.txt" 2>&1
  echo "== bench $name ($devs): exit $? at $((SECONDS - t0)) s" >> "/tmp/bench-$name.txt"
  cat "/tmp/bench-$name.txt" >> "$OUTDIR/bench.txt"
  cp /tmp/save-$name/*.json "$OUTDIR/dask-cuda-$name.json" 2>/dev/null
  grep -v "UCX  WARN" "/tmp/bench-$name.txt" | tail -45
}
dask_tests() {  # on the last two GPUs, beside bench x2 on GPUs 0,1 (when there are 4)
  local gpus=0,1
  [ "$n" -gt 3 ] && gpus=2,3
  CUDA_VISIBLE_DEVICES=$gpus timeout --kill-after=10 "${TESTS_S:-300}" python3 -m pytest \
    -p no:cacheprovider -rA -q tests/test_dask_deploy_gpu.py tests/test_dask_gpu.py \
    tests/test_dask_transfer_gpu.py > "$OUTDIR/tests.txt" 2>&1
  echo "== dask GPU tests on GPUs $gpus: exit $? at $((SECONDS - t0)) s" >> "$OUTDIR/tests.txt"
}
tl "$devs" "${V4:-tcp+cupy_poolmem,ucxx}" tl4.json 200
tl "0,1" "${V2:-tcp+cupy_poolmem,tcp+cupy_poolmem+nofreeze,ucxx}" tl2.json 200
pid=""
if [ "${TESTS:-0}" = 1 ]; then
  if [ "$n" -gt 3 ]; then dask_tests & pid=$!; else dask_tests; fi
fi
[ "${BENCH:-1}" = 1 ] && bench 0,1 x2 "${BENCH2_S:-300}"
[ -n "$pid" ] && wait "$pid"
[ "${TESTS:-0}" = 1 ] && grep -E "passed|failed|error|== dask" "$OUTDIR/tests.txt" | tail -6
[ "${BENCH:-1}" = 1 ] && [ "${BENCH4:-1}" = 1 ] && [ "$n" -gt 2 ] && bench "$devs" "x$n" "${BENCH4_S:-300}" --no-transfer
echo "== done at $((SECONDS - t0)) s"
