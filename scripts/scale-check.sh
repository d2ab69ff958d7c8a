#!/usr/bin/env bash
# Does staging scale with cores? Builds fastload, then on 2, 4, 8 and all cores (taskset;
# counts this node lacks are left out) runs, side by side:
#   tree     fastload (auto, pread, uring), cp -r, find | xargs -P<cores> cp --parents
#   tar      fastload, GNU tar -xf
#   ceiling  <cores> parallel cat of the tree, dd iflag=direct read, dd oflag=direct write
#   s3       small objects and one large object: fastload, s5cmd (the benchmarks'
#            loopback server; where s5cmd or the server is missing, said and left out)
#   epoch    the remote-shard epoch: fastload, litdata, MosaicML streaming (where installed)
# and prints one table: wall time, CPU-seconds per GB and per 1,000 files, the busiest
# thread's share of the wall time, and fastload's ratio to the best peer. Each round is
# cold where the page cache can be dropped (root: echo 3 > /proc/sys/vm/drop_caches),
# else warm, and the table says which.
#
#   scripts/scale-check.sh                    build, then measure (about 4 minutes on 16 cores)
#   SCALE_FILES=12000 SCALE_KB=136 scripts/scale-check.sh    the issue's 1.64 GB tree
#   SCALE_CORES="2 16" SCALE_ONLY=tree,tar scripts/scale-check.sh
#   SCALE_BUILD=0 scripts/scale-check.sh      use the fastload already on PYTHONPATH
#   SCALE_WORK=/path                          where the data and copies go (default: a
#                                             folder under build/, on this checkout's disk)
#   SCALE_S3=full SCALE_EPOCH=small           the benchmarks' scale for the s3 cases (full:
#                                             the issue's 2,000 x ~100 KB and 1 GiB) and the
#                                             remote epoch (default small for both)
# Runs on any Linux node with Python 3.10+, cmake, ninja and pybind11 (NODE.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for v in .venv-bench .venv; do [ -x "$v/bin/python" ] && { PY=$v/bin/python; break; }; done
  PY=${PY:-python3}
fi
WORK=${SCALE_WORK:-$PWD/build/scale-check}
FILES=${SCALE_FILES:-4000}
KB=${SCALE_KB:-64}
ROUNDS=${SCALE_ROUNDS:-2}
ONLY=${SCALE_ONLY:-tree,tar,ceiling,s3,epoch}
mkdir -p "$WORK"

if [ "${SCALE_BUILD:-1}" != 0 ]; then
  echo "scale-check: building fastload (build/scale)" >&2
  cmake -S . -B build/scale -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
    -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" >/dev/null
  cmake --build build/scale -j"$(nproc)" >/dev/null
  rm -rf "$WORK/site" && mkdir -p "$WORK/site"
  cp -r python/fastload "$WORK/site/"
  rm -f "$WORK/site/fastload/"_core*.so && cp build/scale/_core*.so "$WORK/site/fastload/"
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
elif compgen -G "python/fastload/_core*.so" >/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
export AWS_EC2_METADATA_DISABLED=true

ALL=$(nproc)
CORES=${SCALE_CORES:-"2 4 8 $ALL"}
counts=()
for c in $CORES; do
  [ "$c" -le "$ALL" ] || continue
  [[ " ${counts[*]-} " == *" $c "* ]] || counts+=("$c")
done
if [ "$(id -u)" = 0 ] && [ -w /proc/sys/vm/drop_caches ]; then
  echo "scale-check: cold page cache for every round" >&2
else
  echo "scale-check: not root: every round runs WARM (the page cache cannot be dropped)" >&2
fi

rows="$WORK/rows.jsonl"
: >"$rows"
for c in "${counts[@]}"; do
  cpus="0-$((c - 1))"
  echo "scale-check: $c cores (taskset -c $cpus)" >&2
  taskset -c "$cpus" "$PY" scripts/scale_check.py --work "$WORK" --files "$FILES" --kb "$KB" \
    --rounds "$ROUNDS" --only "$ONLY" >>"$rows"
  # The object store and the remote epoch: the benchmarks' own cases, under the same
  # cores, each part at its own benchmark scale (SCALE_S3, SCALE_EPOCH: small or full).
  for part in s3 epoch; do
    [[ ",$ONLY," == *",$part,"* ]] || continue
    if [ "$part" = s3 ]; then
      bench=("benchmarks/test_bench_s3.py::test_small_objects"
        "benchmarks/test_bench_s3.py::test_large_object")
      scale=${SCALE_S3:-small}
    else
      bench=("benchmarks/test_bench_remote.py::test_remote_epoch")
      scale=${SCALE_EPOCH:-small}
    fi
    out="$WORK/bench-$c-$part"
    FASTLOAD_BENCH_SCALE=$scale taskset -c "$cpus" "$PY" -m pytest -q -p no:cacheprovider \
      "${bench[@]}" -k "fastload or (s5cmd and not webdataset) or litdata or mosaicml" \
      --benchmark-json="$out.json" >"$out.log" 2>&1 ||
      echo "scale-check: the $part benchmarks failed on $c cores: $out.log" >&2
    [ -f "$out.json" ] && "$PY" scripts/scale_check.py --from-bench "$out.json" \
      --cores "$c" >>"$rows"
  done
done
"$PY" scripts/scale_check.py --table "$rows"
