#!/usr/bin/env bash
# One x4 call for issue 35: the step-IPC GPU tests on GPUs 0,1; the benches that decide
# the default on GPU 2 (alloc, churn, ipc); the sharing and Numba GPU regressions on GPU 3.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 setup.py -q build_ext --inplace >"$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
export PYTHONPATH=$PWD/src
T=${T:-470}
( CUDA_VISIBLE_DEVICES=0,1 timeout $T python3 -m pytest -v -rA -p no:cacheprovider \
    -o faulthandler_timeout=60 tests/test_sharing_steps_gpu.py >"$OUT/steps.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=2
  for b in ${BENCH:-alloc churn ipc}; do
    timeout $T python3 -m cupy_poolmem bench $b ${BQ:-} --save "$OUT/res" >>"$OUT/bench.txt" 2>&1
  done ) &
( CUDA_VISIBLE_DEVICES=3 timeout $T python3 -m pytest -v -rA -p no:cacheprovider \
    -o faulthandler_timeout=60 -m gpu ${REG:-tests/test_sharing_gpu.py} >"$OUT/reg.txt" 2>&1 ) &
wait
tail -n 4 "$OUT/steps.txt" "$OUT/reg.txt"; grep -E "goal|^cupy_poolmem|reserved" "$OUT/bench.txt" | head -40
