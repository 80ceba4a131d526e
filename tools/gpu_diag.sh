#!/usr/bin/env bash
# Issue 37 diagnostics on a 4-GPU machine: where transpose_sum runs lose time.
#   OUT=... bash tools/gpu_diag.sh        (carry .whl and .whl_ucx)
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
python3 setup.py -q build_ext --inplace > "$OUTDIR/build.log" 2>&1 || echo "build failed"
nvidia-smi -L
n=$(nvidia-smi -L | wc -l)
devs=$(seq -s, 0 $((n - 1)))
tl() {  # tl DEVICES VARIANTS JSON SECONDS
  timeout --kill-after=10 "$4" python3 -m cupy_poolmem.benchmarks.dask_timeline \
    --devices "$1" --variants "$2" --runs "${RUNS:-8}" --json "$OUTDIR/$3" 2>"$OUTDIR/$3.err" \
    | tee -a "$OUTDIR/timeline.txt"
  echo "== tl $1 $2: exit $? at $((SECONDS - t0)) s" | tee -a "$OUTDIR/timeline.txt"
}
tl "$devs" "${V4:-tcp+cupy_poolmem,tcp+cupy_poolmem+switch,tcp+cupy_poolmem+offload,ucxx}" tl4.json 280
tl "0,1" "${V2:-tcp+cupy_poolmem,ucxx}" tl2.json 130
echo "== done at $((SECONDS - t0)) s"
