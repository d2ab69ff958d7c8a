#!/usr/bin/env bash
# Sets up everything from scratch and runs every test: lint, types, the Python suite on
# both I/O backends, the native tests and the Python suite again under ASan+UBSan, and
# the benchmarks once at a small size (beside that pass), side by side with the peers
# (in a venv of their own, scripts/bench-peers.sh), the regression check's subset among
# them timed, its ratio table (benchmarks/bench_check.py) printed without failing on
# timing.
# CI (.ci/run) runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FASTLOAD_VENV:-.venv}
JOBS=${JOBS:-2}

step() { printf '\n==> %s\n' "$*"; }
# Nothing may leave this machine: s3:// clients must not ask a cloud metadata service.
export AWS_EC2_METADATA_DISABLED=true

step "system tools: every one the tests and the benchmarks use"
# command:Debian package. tests/kit/netsim.c (the latency-adding FUSE file system) is
# compiled by the tests (cc, pkg-config, libfuse3-dev) and mounted with fuse3; tests/slurm
# start their own slurmctld + slurmd on loopback (scripts/slurm-cluster.sh); the tar tests
# compare with GNU tar, bsdtar (libarchive), zstd and pigz; rsync and pigz are benchmark
# peers; chattr makes a directory immutable; cmake and ninja build the sanitized tests.
TOOLS="tar:tar unzip:unzip zip:zip zstd:zstd pigz:pigz bsdtar:libarchive-tools rsync:rsync chattr:e2fsprogs
  cc:gcc c++:g++ pkg-config:pkg-config fusermount3:fuse3 cmake:cmake ninja:ninja-build
  slurmctld:slurmctld slurmd:slurmd srun:slurm-client sbatch:slurm-client"
missing_tools() {
  local t out=""
  for t in $TOOLS; do command -v "${t%%:*}" >/dev/null || out="$out ${t#*:}"; done
  pkg-config --exists fuse3 2>/dev/null || out="$out libfuse3-dev"
  echo "$out" | tr ' ' '\n' | sort -u | xargs
}
missing=$(missing_tools)
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing: $missing"
  apt_log=$(mktemp)
  # shellcheck disable=SC2086
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends $missing) >"$apt_log" 2>&1 || tail -n 20 "$apt_log"
  rm -f "$apt_log"
  missing=$(missing_tools)
fi
if [ -n "$missing" ]; then
  # With CI set a missing tool fails the run (as it fails the tests that need it); by
  # hand the tests that need it skip, saying why.
  if [ -n "${CI:-}" ] && [ "${CI:-}" != false ] && [ "${CI:-}" != 0 ]; then
    echo "missing (CI): $missing" >&2
    exit 1
  fi
  echo "missing: $missing (the tests that need them will skip; as root with apt-get, this script installs them)"
fi

step "virtual environment $VENV and the package (warnings are errors)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch exactly as the machine provides it (a CPU build); any other spec would pull CUDA.
"$VENV/bin/python" -m pip install -q "torch==${FASTLOAD_TORCH_VERSION:-2.13.0}"
# The package is compiled once, into a wheel both venvs install (scripts/bench-peers.sh
# takes it from FASTLOAD_WHEEL): two builds of the same sources cost CI a minute or more.
# build/cpp is shared with scripts/demo.sh: after the demo, only what changed compiles.
./scripts/build.sh "$VENV" wheel build/wheelhouse
WHEEL=$(ls build/wheelhouse/fastload-*.whl)
export FASTLOAD_WHEEL=$PWD/$WHEEL
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$FASTLOAD_WHEEL"
"$VENV/bin/python" -m pip install -q "$FASTLOAD_WHEEL[test,torch]"

step "ruff and mypy"
"$VENV/bin/python" -m ruff check python tests benchmarks
"$VENV/bin/python" -m mypy

# The benchmarks' venv (scripts/bench-peers.sh: pip, mostly downloads and unpacking) is
# made while pytest runs, and waited for before the benchmarks.
BENCH_VENV=${FASTLOAD_BENCH_VENV:-.venv-bench}
mkdir -p build
PYTHON="$PY" ./scripts/bench-peers.sh "$BENCH_VENV" >build/bench-peers.log 2>&1 &
PEERS_PID=$!
trap 'kill "$PEERS_PID" 2>/dev/null || true' EXIT

# The sanitized build (AddressSanitizer + UndefinedBehaviorSanitizer, for the native tests
# and a second pass of the suite) compiles while pytest runs, one job at the lowest
# priority: pytest waits on processes, servers and disks much of the time, and the build
# takes that time instead of adding its minutes after it.
PYBIND11_DIR=$("$VENV/bin/python" -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null \
  || { "$VENV/bin/python" -m pip install -q pybind11 && "$VENV/bin/python" -c 'import pybind11; print(pybind11.get_cmake_dir())'; })
cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFASTLOAD_SANITIZE=ON \
  -DFASTLOAD_WERROR=ON -DFASTLOAD_NATIVE_TESTS=ON -Dpybind11_DIR="$PYBIND11_DIR" \
  -DPython_EXECUTABLE="$(cd "$VENV/bin" && pwd)/python" >/dev/null
nice -n 19 cmake --build build/asan -j1 >build/asan-build.log 2>&1 &
ASAN_PID=$!
trap 'kill "$PEERS_PID" "$ASAN_PID" 2>/dev/null || true' EXIT

# Each I/O backend runs every test that takes one: the first available (io_uring where
# the kernel allows it) in this pass, the other (the pread pool) in the sanitized pass
# below, which runs the native suites those tests are in.
VPY=$(cd "$VENV/bin" && pwd)/python
ENGINES=$(cd tests && "$VPY" -c 'import fastload; print(" ".join(fastload.available_engines()))')
FIRST_ENGINE=${ENGINES%% *}
LAST_ENGINE=${ENGINES##* }

step "pytest (the engine's cases on $FIRST_ENGINE; $LAST_ENGINE's in the sanitized pass)"
# Run from tests/ so the installed package is imported, not python/fastload.
# Two pytest processes at once: the suites that wait on servers, clusters and their
# processes much of the time (an S3 server, SLURM, the node cache's downloads) beside the
# rest, so the waits of one take the other's CPU time instead of adding to the wall time.
# Each has its own servers and temporary folders; the second one's output follows.
# --durations: the slowest tests, in CI's log, for keeping the whole run under 20 minutes.
WAITING=(tests/sources tests/slurm tests/cache)
IGNORE=()
for d in "${WAITING[@]}"; do IGNORE+=(--ignore="$d"); done
FASTLOAD_TEST_ENGINES=$FIRST_ENGINE "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 \
  "${WAITING[@]}" >build/pytest-waiting.log 2>&1 &
WAITING_PID=$!
trap 'kill "$PEERS_PID" "$ASAN_PID" "$WAITING_PID" 2>/dev/null || true' EXIT
rest=0
FASTLOAD_TEST_ENGINES=$FIRST_ENGINE "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests \
  "${IGNORE[@]}" || rest=$?
waiting=0
wait "$WAITING_PID" || waiting=$?
printf '\n%s:\n' "pytest ${WAITING[*]}"
cat build/pytest-waiting.log
if [ "$rest" != 0 ] || [ "$waiting" != 0 ]; then
  echo "pytest failed (the rest: exit $rest; ${WAITING[*]}: exit $waiting)" >&2
  exit 1
fi

step "benchmarks, once, small, timing off, with the peers (MosaicML streaming, litdata, HF datasets): in the background, beside the sanitized pass"
# The peers' pins clash with the test venv, and two of them would pull torchvision (another
# torch): scripts/bench-peers.sh gives them a venv of their own, with this torch and this
# fastload. Where it cannot be set up (no network), the benchmarks run in the test venv
# and the peer cases skip, saying why.
BENCH_PY=$VENV/bin/python
if wait "$PEERS_PID"; then
  tail -n 3 build/bench-peers.log
  BENCH_PY=$BENCH_VENV/bin/python
else
  tail -n 20 build/bench-peers.log
  echo "could not set up $BENCH_VENV: the peer benchmark cases will skip"
fi
# Every case once; those of the regression check's subset are left to the next step,
# which runs each of them once too (one round at this size), timed.
mapfile -t CHECKED < <("$BENCH_PY" benchmarks/bench_check.py nodes)
DESELECT=()
for node in "${CHECKED[@]}"; do DESELECT+=(--deselect "$node"); done
# Untimed, they take the CPU time the sanitized pass leaves (its Python is mostly one
# thread); their output follows that pass's.
FASTLOAD_BENCH_SCALE=small "$BENCH_PY" -m pytest -q benchmarks --benchmark-disable "${DESELECT[@]}" \
  >build/bench.log 2>&1 &
BENCH_PID=$!
trap 'kill "$BENCH_PID" 2>/dev/null || true' EXIT

step "native tests and the Python suite under AddressSanitizer + UndefinedBehaviorSanitizer"
if ! wait "$ASAN_PID"; then
  tail -n 40 build/asan-build.log
  exit 1
fi
cmake --build build/asan -j"$JOBS"  # nothing left to do, unless the background build stopped early
ctest --test-dir build/asan --output-on-failure
rm -rf build/asan/pkg && mkdir -p build/asan/pkg/fastload
cp -r python/fastload/. build/asan/pkg/fastload/
cp build/asan/_core*.so build/asan/pkg/fastload/
ASAN_LIB=$(gcc -print-file-name=libasan.so)
UBSAN_LIB=$(gcc -print-file-name=libubsan.so)
# Python itself leaks by design at exit; leak checking is for the native tests above.
# The engine's cases run here on the other backend (the pread pool where io_uring ran
# above; the same one where only one is available). Left out here:
# the suites whose native calls are the same reads of an index or a stage another suite
# here makes, around long Python work (servers, DataLoader workers, downloads, several
# "nodes", SLURM): tests/cache, tests/env, tests/cli, tests/sources, tests/slurm, fan-out,
# the mixes, probe, tests/data/test_iterable.py and the torchvision shim; and the SIGKILL
# tests (a killed process reports nothing to a sanitizer; what they check after is a
# plain stage, run here by the others; the Ctrl-C tests stay).
FASTLOAD_TEST_ENGINES=$LAST_ENGINE LD_PRELOAD="$ASAN_LIB $UBSAN_LIB" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH=build/asan/pkg \
  FASTLOAD_TEST_SANITIZED=1 "$VENV/bin/python" -m pytest -q -m native -p no:cacheprovider tests \
  --ignore=tests/cache --ignore=tests/env --ignore=tests/cli --ignore=tests/sources \
  --ignore=tests/slurm --ignore=tests/staging/test_fanout.py \
  --ignore=tests/staging/test_fanout_mpi.py --ignore=tests/staging/test_fanout_entry_points.py \
  --ignore=tests/data/test_iterable.py --ignore=tests/test_torchvision_shim.py \
  --ignore=tests/test_probe.py --ignore=tests/test_probe_edges.py \
  --ignore-glob='tests/data/test_mix*.py' \
  -k "not sigkill and not repeated_kills"

step "benchmarks: their output"
bench=0
wait "$BENCH_PID" || bench=$?
cat build/bench.log
if [ "$bench" != 0 ]; then
  echo "benchmarks failed (exit $bench)" >&2
  exit 1
fi

step "I/O regression check: ratios against benchmarks/baseline.json (printed, not failing on timing)"
# The CI machine is shared and differs from the baseline's: a human reads the table on every
# submission. A case that raises or checks a wrong result still fails here (exit 2);
# scripts/bench-check.sh is the check that fails on timing, run before and after a change.
"$BENCH_PY" benchmarks/bench_check.py run --runs 1 --scale small --report-only --no-autosave \
  --python "$BENCH_PY"

step "all tests passed"
