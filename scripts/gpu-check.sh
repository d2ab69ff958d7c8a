#!/usr/bin/env bash
# Issue 34's table on a GPU node, in under 3 minutes: builds fastload, writes JPEG shards
# (6 x 1,000 samples of about 63 KB), and prints, for 2/4/8/14 DataLoader workers,
# samples/s, GB/s and the main process's CPU per batch with pin_memory=False, with
# pin_memory=True and b.to("cuda", non_blocking=True), and through fastload.to_device;
# then the ceilings: a pinned host-to-GPU copy, a registered shared-memory block, torch's
# own DataLoader pin path for 16 MB uint8 batches, and nvJPEG decode (batched, GPU)
# against torchvision's CPU decode. Each loader cell first checks every byte it copied
# (each copy queued behind GPU work, its batch dropped at once: a block handed back too
# early shows as wrong bytes, and fails the run) and says whether its batches came in
# registered blocks. Then, over 3 epochs with the first worker count, persistent workers
# on and off, pin_memory on and off: blocks registered (of them on the registrar thread)
# and unregistered per epoch, ms in cudaHostRegister, and the main thread's ms in
# registration. Where torch has no CUDA it says "no CUDA" and exits 0.
#
#   scripts/gpu-check.sh                 build into a temporary folder, then measure
#   scripts/gpu-check.sh --no-build      measure the package already importable (or the
#                                        working tree's python/ when it holds _core*.so)
#   FASTLOAD_GPU_CHECK_CPU=1 scripts/gpu-check.sh --no-build --samples 512
#                                        the CPU columns only (a smoke run without a GPU)
# Other options go to scripts/gpu_check.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=1
args=()
for a in "$@"; do
  case "$a" in
    --no-build) BUILD=0 ;;
    *) args+=("$a") ;;
  esac
done
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if [ -z "${FASTLOAD_GPU_CHECK_CPU:-}" ]; then
    echo "gpu-check: no CUDA (torch: $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null \
      || echo 'not installed')); nothing to measure here"
    exit 0
  fi
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastload-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [ "$BUILD" = 1 ]; then
  echo "gpu-check: building fastload into $WORK/site"
  t0=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-build-isolation --no-deps \
    --target "$WORK/site" . >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
  echo "gpu-check: built in $(( $(date +%s) - t0 )) s"
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
elif compgen -G "python/fastload/_core*.so" >/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
# Not exec: the EXIT trap must run to remove $WORK.
"$PY" scripts/gpu_check.py --work "$WORK" ${args[@]+"${args[@]}"}
