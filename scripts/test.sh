#!/usr/bin/env bash
# Sets up everything from scratch and runs every test: lint, types, the Python suite on
# both I/O backends, the native tests and the Python suite again under ASan+UBSan, and
# the benchmarks once at a small size (beside that pass), side by side with the peers
# (in a venv of their own, scripts/bench-peers.sh), the regression check's subset among
# them timed, its ratio table (benchmarks/bench_check.py) printed without failing on
# timing. At the end it prints every skip with its reason (tests/kit/skips.py, from each
# pass's JUnit XML); with CI set, a skip not on tests/allowed-skips.txt fails the run.
# CI (.ci/run) runs exactly this.
#
#   ./scripts/test.sh                  everything above
#   ./scripts/test.sh -k name ...      set up, then one pytest run of tests/ with these
#                                      arguments (a part: no lint, no sanitized pass, no
#                                      benchmarks); e.g. -k stage_stats, or data -x
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FASTLOAD_VENV:-.venv}
JOBS=${JOBS:-2}

step() { printf '\n==> %s\n' "$*"; }
in_ci() { [ -n "${CI:-}" ] && [ "${CI:-}" != false ] && [ "${CI:-}" != 0 ]; }
# Every pytest run, those the tests and bench_check.py start included: the temporary
# folders of passing tests removed (pytest's tmp_path retention), so a run that passes
# leaves nothing in the system temporary folder (.ci/run checks). Each pass writes a JUnit
# report; its skips are checked at the end.
export PYTEST_ADDOPTS="-o tmp_path_retention_policy=failed${PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}"
PYTEST_OPTS=(-p no:cacheprovider)
JUNIT=build/junit
# Nothing may leave this machine: s3:// clients must not ask a cloud metadata service.
export AWS_EC2_METADATA_DISABLED=true
# Every temporary file of the run (pytest's folders, multiprocessing's of processes the
# tests kill, torchrun's, the servers') goes into one folder of the system's, removed
# when the run passes (kept to look at when it fails): a run that passes leaves nothing
# in the system temporary folder (.ci/run checks).
RUN_TMP=$(mktemp -d "${TMPDIR:-/tmp}/fastload-tests.XXXXXX")
export TMPDIR=$RUN_TMP
# wids (a peer the tests and benchmarks read shards with) makes /tmp/_wids_cache when it
# is imported (a default argument of its LRUShards), whatever TMPDIR says; nothing is
# written into it here (each ShardListDataset is given localname=). Removed with the
# run's folder where this run made it (rmdir: only while it is empty).
WIDS_DIR=/tmp/_wids_cache
[ -e "$WIDS_DIR" ] && wids_made=0 || wids_made=1
clean_run_tmp() {
  rm -rf --one-file-system "$RUN_TMP"
  [ "$wids_made" = 0 ] || rmdir "$WIDS_DIR" 2>/dev/null || true
}

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
  if in_ci; then
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
"$VENV/bin/python" -m pip install -q "$FASTLOAD_WHEEL[test,torch,docs]"

VPY=$(cd "$VENV/bin" && pwd)/python
if [ "$#" -gt 0 ]; then
  step "pytest $* (a part of the suite, in tests/)"
  rc=0
  (cd tests && "$VPY" -m pytest -q "${PYTEST_OPTS[@]}" "$@") || rc=$?
  [ "$rc" != 0 ] || clean_run_tmp
  exit "$rc"
fi

step "ruff, mypy and the user guide (mkdocs build --strict: warnings are errors)"
"$VENV/bin/python" -m ruff check python tests benchmarks
"$VENV/bin/python" -m mypy
"$VENV/bin/python" -m mkdocs build --strict --quiet --site-dir build/site

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

# Each I/O backend runs every test that takes one (tests/conftest.py marks them
# "engine"): the first available (io_uring where the kernel allows it) in this pass, the
# other (the pread pool) in the sanitized pass below and, for the engine tests that pass
# leaves out, unsanitized after it.
ENGINES=$(cd tests && "$VPY" -c 'import fastload; print(" ".join(fastload.available_engines()))')
FIRST_ENGINE=${ENGINES%% *}
LAST_ENGINE=${ENGINES##* }
# CI's machine kind has io_uring: a run on the pread pool alone would be green having
# left out the engine most users get (the native tests that exit 77 without it fail the
# skip check at the end).
forced=$(echo "${FASTLOAD_ENGINE:-auto}" | tr '[:upper:]' '[:lower:]')
if in_ci && { [ "$FIRST_ENGINE" != uring ] || ! [[ $forced =~ ^(auto|uring|io_uring)?$ ]]; }; then
  echo "io_uring is not used here (engines: $ENGINES; FASTLOAD_ENGINE=${FASTLOAD_ENGINE:-}):" \
    "CI's machine kind has it, and a run without it leaves out the engine most users get" >&2
  exit 1
fi
rm -rf "$JUNIT" && mkdir -p "$JUNIT"

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
FASTLOAD_TEST_ENGINES=$FIRST_ENGINE "$VENV/bin/python" -m pytest -q "${PYTEST_OPTS[@]}" --durations=10 \
  --junitxml="$JUNIT/pytest-waiting.xml" "${WAITING[@]}" >build/pytest-waiting.log 2>&1 &
WAITING_PID=$!
trap 'kill "$PEERS_PID" "$ASAN_PID" "$WAITING_PID" 2>/dev/null || true' EXIT
rest=0
FASTLOAD_TEST_ENGINES=$FIRST_ENGINE "$VENV/bin/python" -m pytest -q "${PYTEST_OPTS[@]}" --durations=15 tests \
  --junitxml="$JUNIT/pytest.xml" "${IGNORE[@]}" || rest=$?
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
# and the peer cases skip, saying why; with CI set, that fails the run (as a tool the
# tests need that cannot be installed does).
BENCH_PY=$VENV/bin/python
if wait "$PEERS_PID"; then
  tail -n 3 build/bench-peers.log
  BENCH_PY=$BENCH_VENV/bin/python
else
  tail -n 20 build/bench-peers.log
  if in_ci; then
    echo "could not set up $BENCH_VENV (CI): the peer benchmark cases cannot run" >&2
    exit 1
  fi
  echo "could not set up $BENCH_VENV: the peer benchmark cases will skip"
fi
# Every case once; those of the regression check's subset are left to the next step,
# which runs each of them once too (one round at this size), timed.
mapfile -t CHECKED < <("$BENCH_PY" benchmarks/bench_check.py nodes)
DESELECT=()
for node in "${CHECKED[@]}"; do DESELECT+=(--deselect "$node"); done
# Untimed, they take the CPU time the sanitized pass leaves (its Python is mostly one
# thread); their output follows that pass's.
FASTLOAD_BENCH_SCALE=small "$BENCH_PY" -m pytest -q "${PYTEST_OPTS[@]}" benchmarks --benchmark-disable \
  --junitxml="$JUNIT/bench.xml" "${DESELECT[@]}" >build/bench.log 2>&1 &
BENCH_PID=$!
trap 'kill "$BENCH_PID" 2>/dev/null || true' EXIT

step "native tests and the Python suite under AddressSanitizer + UndefinedBehaviorSanitizer"
if ! wait "$ASAN_PID"; then
  tail -n 40 build/asan-build.log
  exit 1
fi
cmake --build build/asan -j"$JOBS"  # nothing left to do, unless the background build stopped early
ctest --test-dir build/asan --output-on-failure --output-junit "$PWD/$JUNIT/ctest.xml"
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
# plain stage, run here by the others; the Ctrl-C tests stay). The engine tests among
# those left out run on this backend after it, unsanitized.
SANITIZED=(tests -m "native or engine" -k "not sigkill and not repeated_kills"
  --ignore=tests/cache --ignore=tests/env --ignore=tests/cli --ignore=tests/sources
  --ignore=tests/slurm --ignore=tests/staging/test_fanout.py
  --ignore=tests/staging/test_fanout_mpi.py --ignore=tests/staging/test_fanout_entry_points.py
  --ignore=tests/data/test_iterable.py --ignore=tests/test_torchvision_shim.py
  --ignore=tests/test_probe.py --ignore=tests/test_probe_edges.py
  --ignore-glob='tests/data/test_mix*.py')
FASTLOAD_TEST_ENGINES=$LAST_ENGINE LD_PRELOAD="$ASAN_LIB $UBSAN_LIB" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH=build/asan/pkg \
  FASTLOAD_TEST_SANITIZED=1 "$VENV/bin/python" -m pytest -q "${PYTEST_OPTS[@]}" \
  --junitxml="$JUNIT/pytest-sanitized.xml" "${SANITIZED[@]}"

step "the engine tests the sanitized pass leaves out, on $LAST_ENGINE"
collect() {  # the node ids these arguments select, sorted, into the file $1
  local out=$1 && shift
  FASTLOAD_TEST_ENGINES=$LAST_ENGINE "$VPY" -m pytest -q -p no:cacheprovider --collect-only \
    "$@" >"$out.log"
  { grep '::' "$out.log" || true; } | sort >"$out"
}
collect build/engine-all.txt tests -m engine
collect build/engine-sanitized.txt "${SANITIZED[@]}"
mapfile -t REST < <(comm -23 build/engine-all.txt build/engine-sanitized.txt)
echo "${#REST[@]} of $(wc -l <build/engine-all.txt) cases"
if [ "${#REST[@]}" -gt 0 ]; then
  FASTLOAD_TEST_ENGINES=$LAST_ENGINE "$VPY" -m pytest -q "${PYTEST_OPTS[@]}" \
    --junitxml="$JUNIT/pytest-engine-rest.xml" "${REST[@]}"
fi

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

step "the node scripts, tiny, on the CPU: node-pack.sh (wheels only), node-check.sh (scale-check.sh, gpu-check.sh)"
# What a GPU node runs (NODE.md) breaks here first: the same scripts at a tiny size
# (seconds), with the fastload of the test venv instead of a build of their own.
PY_VERSION=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
NODE_PYTHON_VERSION=$PY_VERSION NODE_PACK_WEED=0 PYTHON=$VPY scripts/node-pack.sh >build/node-pack.log 2>&1 \
  || { cat build/node-pack.log; exit 1; }
OUT=$PWD/build/node-out NODE_BUILD=0 PYTHON=$VPY SCALE_FILES=60 SCALE_KB=4 SCALE_ROUNDS=1 SCALE_CORES=1 \
  SCALE_ONLY=tree,tar,ceiling FASTLOAD_GPU_CHECK_CPU=1 \
  NODE_GPU_ARGS="--samples 60 --kb 4 --workers 2 --epochs 1" scripts/node-check.sh

step "skips: every one, with its reason (with CI set, one not on tests/allowed-skips.txt fails)"
"$VPY" tests/kit/skips.py "$JUNIT"/*.xml
clean_run_tmp

step "all tests passed"
