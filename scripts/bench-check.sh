#!/usr/bin/env bash
# Catches I/O regressions in minutes: runs a fixed quick subset of the benchmarks (tree
# copy, netsim tree, the latency mount's second reader (issue 33), tar, tar.gz, random
# access, streaming epoch, packed batches, object store), each fastload case beside its
# peer in the same run, and compares the ratios (peer time / fastload time) with
# benchmarks/baseline.json. Fails naming the case, the
# old and new ratio and the baseline's commit when a ratio falls below its recorded spread.
#
#   scripts/bench-check.sh                 check the median of 3 runs at the small size
#   scripts/bench-check.sh --runs 1        one run (about a minute; one sample per case)
#   scripts/bench-check.sh --update [N]    record a new baseline from N runs (default 5)
#   scripts/bench-check.sh --report-only   print the table, never fail on timing
#   FASTLOAD_BENCH_SCALE=full scripts/bench-check.sh
# Other options go to benchmarks/bench_check.py (see its --help). Absolute times are
# saved by pytest-benchmark under .benchmarks/ (--compare-saved shows the last ones).
# The working tree's package is measured where it is built in place (python/fastload
# holds a _core*.so); FASTLOAD_BENCH_INSTALLED=1 measures the installed one instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for v in .venv-bench .venv; do [ -x "$v/bin/python" ] && { PY=$v/bin/python; break; }; done
  PY=${PY:-python3}
fi
if [ -z "${FASTLOAD_BENCH_INSTALLED:-}" ] && compgen -G "python/fastload/_core*.so" >/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
export AWS_EC2_METADATA_DISABLED=true
cmd=run
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --update)
      cmd=update
      if [ $# -gt 1 ] && [[ "$2" =~ ^[0-9]+$ ]]; then args+=("$2"); shift; fi ;;
    *) args+=("$1") ;;
  esac
  shift
done
exec "$PY" benchmarks/bench_check.py "$cmd" --python "$PY" ${args[@]+"${args[@]}"}
