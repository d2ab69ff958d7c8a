"""fastload against ``unzip -q`` and ``bsdtar -xf`` on one zip, rounds interleaved (issue
53): on a shared, loaded machine, a ratio of two runs made one right after the other is
steadier than the medians of separate groups.

Each round runs every tool once, in a rotating order, each into a fresh folder (in a new
process for fastload too, so every tool pays its start), timed until its output is
synced (``--no-sync``: to its return); ``--cold`` drops the page cache before each run
(root only), else the zip is read first. ``--netsim US``: each run reads the zip through
a fresh netsim mount of its folder adding US microseconds per request (nothing of it
cached). ``--keep``: the outputs are removed at the end, not after each run (on ext4
without a journal, the 10,000 inodes a run frees make the next run's creations pass
over them for a minute: benchmarks/_harness.py ``settle_deletions``). Prints per tool
the median wall and CPU seconds, and per peer the median of the per-round ratios (peer
time / fastload time).

    python benchmarks/zip_ab.py ZIP --out DIR [--rounds 5] [--cold] [--no-sync]
        [--netsim US] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _harness import NETSIM, drop_caches, netsim_unavailable, syncfs, unmount_netsim

_STAGE = "import sys, fastload; fastload.stage(sys.argv[1], sys.argv[2])"
TOOLS = {
    "fastload": [sys.executable, "-c", _STAGE],
    "unzip -q": ["unzip", "-q"],
    "bsdtar -xf": ["bsdtar", "-xf"],
}


def command(tool: str, zip_path: Path, dst: Path) -> list[str]:
    if tool == "fastload":
        return [*TOOLS[tool], str(zip_path), str(dst)]
    if tool == "unzip -q":
        return [*TOOLS[tool], str(zip_path), "-d", str(dst)]
    dst.mkdir()
    return [*TOOLS[tool], str(zip_path), "-C", str(dst)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("zip", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--no-sync", action="store_true", help="time each tool to its return")
    ap.add_argument("--netsim", type=int, default=None, metavar="US",
                    help="read the zip through a fresh netsim mount, US per request")
    ap.add_argument("--keep", action="store_true", help="remove the outputs at the end")
    args = ap.parse_args()
    if args.netsim is not None and (why := netsim_unavailable()):
        raise SystemExit(f"--netsim: {why}")
    kept: list[Path] = []
    times: dict[str, list[tuple[float, float]]] = {t: [] for t in TOOLS}
    tools = list(TOOLS)
    for r in range(args.rounds):
        for tool in tools[r % len(tools):] + tools[: r % len(tools)]:
            dst = args.out / f"r{r}-{tool.split()[0]}"
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(dst.parent / f".{dst.name}.fastload", ignore_errors=True)
            args.out.mkdir(parents=True, exist_ok=True)
            syncfs(args.out)
            if args.cold:
                if not drop_caches():
                    raise SystemExit("--cold needs root")
            elif args.netsim is None:
                with open(args.zip, "rb") as f:
                    while f.read(8 << 20):
                        pass
            zip_path, mnt = args.zip, None
            if args.netsim is not None:
                mnt = args.out.parent / f".zip-ab-mnt-r{r}-{tool.split()[0]}"
                mnt.mkdir(exist_ok=True)
                us = str(args.netsim)
                subprocess.run([str(NETSIM), "mount", str(args.zip.parent), str(mnt), us, us],
                               check=True)  # fmt: skip
                zip_path = mnt / args.zip.name
            before = os.times()
            t0 = time.monotonic()
            try:
                subprocess.run(command(tool, zip_path, dst), check=True)
                if not args.no_sync:
                    syncfs(args.out)
                wall = time.monotonic() - t0
            finally:
                if mnt is not None:
                    unmount_netsim(mnt)
                    mnt.rmdir()
            after = os.times()
            cpu = (after.children_user - before.children_user
                   + after.children_system - before.children_system)  # fmt: skip
            times[tool].append((wall, cpu))
            if args.keep:
                kept.append(dst)
                continue
            shutil.rmtree(dst)
            shutil.rmtree(dst.parent / f".{dst.name}.fastload", ignore_errors=True)
    for dst in kept:
        shutil.rmtree(dst)
        shutil.rmtree(dst.parent / f".{dst.name}.fastload", ignore_errors=True)
    for tool, runs in times.items():
        print(f"{tool:12s} wall {statistics.median(w for w, _ in runs):6.2f} s  "
              f"cpu {statistics.median(c for _, c in runs):6.2f} s  "
              f"walls {[round(w, 2) for w, _ in runs]}")  # fmt: skip
    for peer in ("unzip -q", "bsdtar -xf"):
        ratios = [p[0] / f[0] for p, f in zip(times[peer], times["fastload"], strict=True)]
        print(f"{peer} / fastload: median {statistics.median(ratios):.2f}x "
              f"(rounds {[round(x, 2) for x in ratios]})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
