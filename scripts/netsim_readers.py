"""Readers one after the other on one latency mount (issue 33: the second reader).

Mounts a tree through netsim (tests/kit/netsim.c) and runs the steps in order, printing
each one's wall time, and the mount's own counts (opens, read requests, bytes served,
metadata requests) of everything read since it was mounted, at each ``new`` and at the
end. Each copy goes to a destination of its own under ``--dst``, removed after the step.

    python scripts/netsim_readers.py --work DIR [--dst DIR] [--files 1500] [--kb 100]
        [--us 2000] STEPS

STEPS, comma-separated: ``cp`` (cp -r), ``fl:ENGINE`` (fastload.stage, ENGINE auto, pread
or uring), ``cat`` (every file read by 32 cats, nothing written), ``new`` (unmount,
print the counts, mount again: nothing of the old mount is in the kernel), ``syncfs``.
For example ``fl:auto,new,cp,fl:auto`` is fastload alone, then fastload right after
cp -r read the same mount. Needs root and /dev/fuse (netsim is built on first use).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from _harness import syncfs  # noqa: E402
from data import imagenet_like_tree  # noqa: E402
from kit import netsim  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--work", type=Path, required=True, help="the tree and the mounts")
    ap.add_argument("--dst", type=Path, default=None, help="the copies (default: WORK/dst)")
    ap.add_argument("--files", type=int, default=1500)
    ap.add_argument("--kb", type=float, default=100)
    ap.add_argument("--us", type=int, default=2000, help="per metadata and read request")
    ap.add_argument("steps")
    a = ap.parse_args(argv)
    steps = a.steps.split(",")
    bad = [s for s in steps if s not in ("cp", "cat", "new", "syncfs") and not s.startswith("fl:")]
    if bad:
        ap.error(f"unknown steps {bad}")
    why = netsim.netsim_unavailable()
    if why:
        print(f"netsim_readers: {why}", file=sys.stderr)
        return 2
    import fastload

    a.work.mkdir(parents=True, exist_ok=True)
    dst_root = a.dst or a.work / "dst"
    dst_root.mkdir(parents=True, exist_ok=True)
    classes = max(1, a.files // 100)
    src = imagenet_like_tree(a.work / f"tree-{a.files}-{a.kb:g}", a.files, classes, a.kb, seed=2)
    n = 0

    def mount() -> netsim.Mount:
        nonlocal n
        n += 1
        return netsim.Mount(src, a.work / f"mnt{n}", a.us, a.us, direct=False)

    m = mount()
    for i, step in enumerate(steps):
        if step == "new":
            print("  counts", m.unmount(), flush=True)
            m = mount()
            continue
        if step == "syncfs":
            syncfs(dst_root)
            continue
        dst = dst_root / f"step{i}"
        t = time.perf_counter()
        if step == "cp":
            dst.mkdir()
            subprocess.run(["cp", "-r", f"{m.path}/.", str(dst)], check=True)
        elif step == "cat":
            subprocess.run(f"find {m.path} -type f -print0 | xargs -0 -P 32 -n 50 cat "
                           ">/dev/null", shell=True, check=True)  # fmt: skip
        else:
            fastload.stage(m.path, dst, engine=step.split(":", 1)[1])
        print(f"{step:10s} {time.perf_counter() - t:7.3f} s", flush=True)
        shutil.rmtree(dst, ignore_errors=True)
    print("  counts", m.unmount(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
