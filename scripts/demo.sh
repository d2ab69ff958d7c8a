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
"$VENV/bin/python" -m pip install -q .
"$VENV/bin/python" scripts/make_demo.py "$SRC"
"$VENV/bin/fastload" stage "$SRC" "$DST" --progress
"$VENV/bin/fastload" verify "$DST"
"$VENV/bin/fastload" stage "$SRC" "$DST"
