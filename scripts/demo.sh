#!/usr/bin/env bash
# The main job on a fresh machine: install fastload, make a demo dataset standing in for
# one on network storage, stage it to node-local disk with a progress bar, verify it,
# and stage it again (it returns at once).
#   ./scripts/demo.sh [SRC] [DST]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FASTLOAD_VENV:-.venv}
SRC=${1:-demo-data/source}
DST=${2:-${SLURM_TMPDIR:-/tmp}/fastload-demo/dataset}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"

# Build once; later runs reuse the build (build/demo) and skip the install when the
# sources have not changed since.
STAMP="$VENV/.fastload-demo-build"
WANT=$( (git rev-parse HEAD 2>/dev/null || true; git status --porcelain -- cpp python \
  CMakeLists.txt pyproject.toml 2>/dev/null || true) | sha1sum)
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ] || ! "$VENV/bin/python" -c "import fastload" 2>/dev/null; then
  echo "==> installing the build tools"
  "$VENV/bin/python" -m pip install -q --upgrade pip "scikit-build-core>=0.10" "pybind11>=2.12" \
    numpy tqdm 2>&1 | grep -v "^WARNING: Location" || true
  echo "==> building fastload's C++ core (about a minute the first time; then only what changed)"
  mkdir -p build
  set +e
  "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -Cbuild-dir=build/demo -v . \
    > build/demo-install.log 2>&1 &
  pid=$!
  # ninja's "[n/m] Building CXX object ..." lines, as they come
  tail -n +1 -f build/demo-install.log --pid=$pid 2>/dev/null \
    | grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] Building' \
    | sed -u -E 's#^ *(\[[0-9]+/[0-9]+\]) .*/cpp/(.*)\.o$#    \1 \2#'
  wait $pid
  rc=$?
  set -e
  if [ $rc -ne 0 ]; then
    tail -n 40 build/demo-install.log
    echo "install failed (full log: build/demo-install.log)" >&2
    exit $rc
  fi
  echo "$WANT" > "$STAMP"
else
  echo "==> fastload is installed and up to date (build/demo)"
fi
"$VENV/bin/python" scripts/make_demo.py "$SRC"
"$VENV/bin/fastload" stage "$SRC" "$DST" --progress
"$VENV/bin/fastload" verify "$DST"
"$VENV/bin/fastload" stage "$SRC" "$DST"
