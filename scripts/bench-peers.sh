#!/usr/bin/env bash
# Sets up a venv in which the benchmarks run fastload side by side with its peers, each in
# its own format: MosaicML streaming (MDS), litdata (litdata.optimize chunks) and Hugging
# Face datasets (Arrow). Idempotent: a second run installs only what is missing, except
# fastload itself, which is rebuilt from this checkout so that the benchmarks time the
# current code (FASTLOAD_BENCH_NO_FASTLOAD=1 leaves an installed one alone; FASTLOAD_WHEEL=PATH
# installs that wheel of this checkout instead of compiling it again).
#
#   scripts/bench-peers.sh [VENV]        (default .venv-bench)
#   VENV/bin/python -m pytest benchmarks --bench-scale full --benchmark-json=/tmp/b.json
#
# Why a venv of its own: the peers' pins clash with the development venv
# (mosaicml-streaming wants numpy<2.2 and, at import, transformers<5, which caps
# huggingface-hub below 1, hence datasets<5, hence fsspec<=2026.2), and both litdata and
# mosaicml-streaming require torchvision, which has no CPU build here: pip would fetch a
# different torch with it (CUDA, gigabytes). So:
#   - torch goes in first, exactly $FASTLOAD_TORCH_VERSION (the CPU build the machine
#     provides), and every later pip call runs under a constraint that pins that build;
#   - fastload goes in with its test, torch and bench extras; the bench extra
#     (pyproject.toml) lists HF datasets and the peers' runtime dependencies for local
#     folders, which pip resolves normally;
#   - litdata and mosaicml-streaming go in pinned, with --no-deps. Left out on purpose:
#     torchvision (both), their cloud back ends (litdata: obstore; streaming: boto3 is
#     there anyway, google-cloud-storage, azure-*, oci, paramiko), litdata's tifffile (TIFF
#     serialiser) and streaming's matplotlib (simulator): nothing imports them for local
#     folders, so `pip check` lists exactly these as missing;
#   - `import streaming` imports torchvision (streaming.vision): the benchmarks put a stub
#     (benchmarks/_stubs/torchvision) on sys.path when the real one is absent.
# s3fs (the object store benchmark's peer, benchmarks/test_bench_s3.py, and webdataset's
# fsspec back end in benchmarks/test_bench_remote.py) gets a venv of its own, VENV-s3fs: it
# pins an aiobotocore that wants an older botocore than the boto3 here, and beside it pip
# falls back to s3fs 0.4.2. The benchmarks drive it in a subprocess.
# Environment: PYTHON (default python3), FASTLOAD_TORCH_VERSION (default 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-bench}
PY=${PYTHON:-python3}
TORCH=${FASTLOAD_TORCH_VERSION:-2.13.0}
NO_DEPS=(litdata==0.2.76 mosaicml-streaming==0.13.0)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
"$VPY" -m pip install -q --upgrade pip
# (torch warns on import while numpy is not installed yet: stderr is not wanted here.)
"$VPY" -c 'import torch' 2>/dev/null || "$VPY" -m pip install -q "torch==$TORCH"
TORCH_NOW=$("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_NOW" >"$CONSTRAINTS"

if [ "${FASTLOAD_BENCH_NO_FASTLOAD:-0}" = 1 ]; then
  # The bench extra alone, read from pyproject.toml.
  mapfile -t BENCH < <("$VPY" - <<'EOF'
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["bench"]))
EOF
  )
  "$VPY" -m pip install -q -c "$CONSTRAINTS" "${BENCH[@]}"
elif [ -n "${FASTLOAD_WHEEL:-}" ]; then
  # A wheel of this checkout already built (scripts/test.sh makes one): not compiled again.
  "$VPY" -m pip install -q -c "$CONSTRAINTS" --force-reinstall --no-deps "$FASTLOAD_WHEEL"
  "$VPY" -m pip install -q -c "$CONSTRAINTS" "$FASTLOAD_WHEEL[test,torch,bench]"
else
  "$VPY" -m pip install -q -c "$CONSTRAINTS" ".[test,torch,bench]"
fi
"$VPY" -m pip install -q --no-deps "${NO_DEPS[@]}"

"$VPY" - "$TORCH_NOW" <<'EOF'
import importlib.util
import sys
import warnings

import torch

want = sys.argv[1]
assert torch.__version__ == want, f"torch was replaced: {torch.__version__}, not {want}"
assert importlib.util.find_spec("torchvision") is None, "torchvision got installed"
sys.path.append("benchmarks/_stubs")  # what benchmarks/_peers.py does without torchvision
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import datasets
    import litdata
    import streaming

print(
    f"{sys.prefix}: torch {torch.__version__}, mosaicml-streaming {streaming.__version__}, "
    f"litdata {litdata.__version__}, datasets {datasets.__version__}"
)
EOF

# Best effort: without it only the s3fs cases skip. webdataset and torch go in beside s3fs
# for test_bench_remote.py's webdataset-over-fsspec case (benchmarks/_wds_s3fs.py), torch
# first and pinned as above (the wheel comes from pip's cache after the install above).
S3FS_VENV=$VENV-s3fs
S3PY=$S3FS_VENV/bin/python
if { [ -x "$S3PY" ] || "$PY" -m venv "$S3FS_VENV"; } &&
  { "$S3PY" -c 'import torch' 2>/dev/null || "$S3PY" -m pip install -q "torch==$TORCH"; } &&
  { "$S3PY" -c 'import s3fs, webdataset' 2>/dev/null ||
    "$S3PY" -m pip install -q -c "$CONSTRAINTS" s3fs webdataset; }; then
  "$S3PY" -c "import s3fs, sys, torch, webdataset
print(f'{sys.prefix}: s3fs {s3fs.__version__}, webdataset {webdataset.__version__}, torch {torch.__version__}')"
else
  echo "could not set up $S3FS_VENV: the s3fs benchmark cases will skip"
fi
