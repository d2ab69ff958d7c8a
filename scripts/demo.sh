#!/usr/bin/env bash
# The main job on a fresh machine: install fastload, make a demo dataset standing in for
# one on network storage, stage it to node-local disk with a progress bar, verify it,
# and stage it again (it returns at once).
#   ./scripts/demo.sh [SRC] [DST]
#   ./scripts/demo.sh --clean     remove the demo's data (demo-data/ and the staged copy)
# On disk: .venv (the package, ~110 MB) and build/cpp (the C++ build, ~12 MB) in the
# clone, reused by the next run and by scripts/test.sh; the demo dataset (1.5 GB) in
# demo-data/ and its staged copy (1.5 GB) in ${SLURM_TMPDIR:-/tmp}/fastload-demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FASTLOAD_VENV:-.venv}
DEMO_DST=${SLURM_TMPDIR:-/tmp}/fastload-demo
if [ "${1:-}" = --clean ]; then
  # Only what the demo itself makes by default: never a SRC or DST given to it.
  rm -rf demo-data "$DEMO_DST"
  echo "removed demo-data/ and $DEMO_DST/ (kept $VENV and build/: rm -rf $VENV build to remove them)"
  exit 0
fi
SRC=${1:-demo-data/source}
DST=${2:-$DEMO_DST/dataset}
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
