#!/usr/bin/env bash
# GPU run of the Dask deployment tests and the dask-cuda benchmark (issue 37), on a
# machine with 2+ GPUs and no network.  Run from the repository root:
#
#   tools/gpu_dask.sh [install|tests|bench|all]     (default: all)
#
# install  wheels in .whl/ and .whl_ucx/ (whichever are present) into /tmp/site, which
#          survives between calls on a warm machine.  The two folders together exceed
#          one call's carry limit: first a call carrying .whl_ucx that runs
#          `tools/gpu_dask.sh install`, then calls carrying .whl.  UCX goes first:
#          pip --target replaces bin/ on each install, and .whl holds the `dask` CLI.
# tests    python -m pytest -m multigpu -k dask   (the deployments; 2 GPUs)
# bench    python -m cupy_poolmem bench dask-cuda (local_cupy: tcp+cupy_poolmem by env,
#          tcp+rmm, ucxx; then bench transfer --quick)
#
# Logs go to $OUT (or ./gpu_dask_out): pip-*.log, tests.log, bench.log, local_cupy-*.log,
# versions.log, steps.log.  Every step is bounded: install 60 s per folder; in `all`
# tests 240 s and bench 220 s (under 9 minutes in all, with one wheel folder); run
# alone, tests 500 s and bench 480 s (one call each: the safer plan).
# Exit status: the first failing step's.
set -u
OUTDIR="${OUT:-$PWD/gpu_dask_out}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
what="${1:-all}"
status=0

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "== $name (at most ${secs}s): $*" | tee -a "$OUTDIR/steps.log"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$secs" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$OUTDIR/steps.log"
  tail -n 40 "$OUTDIR/$name.log"
  [ $status -eq 0 ] && status=$rc
  return 0
}

install() {
  local dirs=()
  for d in .whl_ucx .whl; do
    compgen -G "$d/*.whl" > /dev/null && dirs+=("$d")
  done
  if [ ${#dirs[@]} -eq 0 ]; then
    echo "no wheels in .whl/ or .whl_ucx/ (carry them); using what /tmp/site has"
    return 0
  fi
  for d in "${dirs[@]}"; do
    step "pip-${d#.}" 60 python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl
  done
  python3 - <<'PY' 2>&1 | tee "$OUTDIR/versions.log"
import importlib
for m in ("dask", "distributed", "dask_cuda", "rmm", "distributed_ucxx", "ucxx", "cupy",
          "cupy_poolmem", "nvtx", "pandas"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"), getattr(mod, "__file__", ""))
    except Exception as exc:
        print(m, "NOT IMPORTABLE:", type(exc).__name__, exc)
PY
  nvidia-smi -L 2>&1 | tee -a "$OUTDIR/versions.log"
}

tests() {  # tests SECONDS
  step tests "$1" python3 -m pytest -q -p no:cacheprovider -m multigpu -k dask \
    --timeout 200 -rs tests/
}

bench() {  # bench SECONDS PER_PEER_SECONDS
  step bench "$1" python3 -m cupy_poolmem.benchmarks.dask_cuda_local --runs 5 --quick \
    --timeout "$2" --log-dir "$OUTDIR"
}

case "$what" in
  install) install ;;
  tests) install; tests 500 ;;
  bench) install; bench 480 120 ;;
  all) install; tests 240; bench 220 50 ;;
  *) echo "usage: $0 [install|tests|bench|all]"; exit 2 ;;
esac
echo "== done: exit $status; logs in $OUTDIR"
exit $status
