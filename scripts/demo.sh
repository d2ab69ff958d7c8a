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

# Build once; later runs reuse the build (build/cpp, shared with scripts/test.sh) and
# skip the install when the sources have not changed since.
STAMP="$VENV/.fastload-demo-build"
WANT=$( (git rev-parse HEAD 2>/dev/null || true; git status --porcelain -- cpp python \
  CMakeLists.txt pyproject.toml 2>/dev/null || true) | sha1sum)
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ] || ! "$VENV/bin/python" -c "import fastload" 2>/dev/null; then
  echo "==> building and installing fastload (scripts/build.sh)"
  ./scripts/build.sh "$VENV" install
  echo "$WANT" > "$STAMP"
else
  echo "==> fastload is installed and up to date (build/cpp)"
fi
"$VENV/bin/python" scripts/make_demo.py "$SRC"
"$VENV/bin/fastload" stage "$SRC" "$DST" --progress
"$VENV/bin/fastload" verify "$DST"
"$VENV/bin/fastload" stage "$SRC" "$DST"
