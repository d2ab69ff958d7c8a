#!/usr/bin/env bash
# Builds fastload's C++ core once for both scripts/demo.sh and scripts/test.sh, into one
# build folder (build/cpp, reused: a second build compiles only what changed), with C++
# warnings as errors, printing ninja's progress as it goes.
#   scripts/build.sh VENV install     pip install the package into VENV
#   scripts/build.sh VENV wheel DIR   build the wheel into DIR
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$1
MODE=$2
# The build runs in VENV (no isolated build environment: its objects stay valid between
# builds), so VENV gets the build requirements; cmake and ninja from PyPI where the
# machine has none.
TOOLS=()
command -v cmake >/dev/null || TOOLS+=("cmake>=3.20")
command -v ninja >/dev/null || TOOLS+=(ninja)
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" numpy tqdm \
  "${TOOLS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
mkdir -p build
LOG=build/cpp-build.log
if [ -f build/cpp/CMakeCache.txt ]; then
  echo "    (build/cpp reused: only what changed since the last build is compiled)"
else
  echo "    (first build: a few minutes on 2 cores)"
fi
case $MODE in
  install) ARGS=(install --no-deps .) ;;
  wheel) rm -rf "$3"; ARGS=(wheel --no-deps -w "$3" .) ;;
  *) echo "usage: $0 VENV install|wheel DIR" >&2; exit 2 ;;
esac
set +e
FASTLOAD_WERROR=1 "$VENV/bin/python" -m pip "${ARGS[@]}" --no-build-isolation -v \
  -Cbuild-dir=build/cpp >"$LOG" 2>&1 &
pid=$!
# ninja's "[n/m] Building CXX object ..." lines, as they come
tail -n +1 -f "$LOG" --pid=$pid 2>/dev/null \
  | grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] (Building|Linking)' \
  | sed -u -E 's#^ *(\[[0-9]+/[0-9]+\]) [A-Za-z ]+ .*/(cpp/[^ ]*|_core[^ ]*)$#    \1 \2#'
wait $pid
rc=$?
set -e
if [ $rc -ne 0 ]; then
  tail -n 40 "$LOG"
  echo "build failed (full log: $LOG)" >&2
  exit $rc
fi
