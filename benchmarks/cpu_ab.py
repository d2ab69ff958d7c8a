"""Two builds of fastload against ``cp -r`` on one tree, rounds interleaved (issue 33:
CPU per file): CPU-seconds per 1,000 files, wall time and the busiest thread's share.

Each round stages the tree into a fresh folder under ``--out`` once per build and engine
(each in a new process whose ``PYTHONPATH`` is the build's folder: one holding
``fastload/`` with its ``_core``), then copies it with ``cp -r``; the CPU is
:class:`_cpu.CpuMeter`'s (getrusage of the process and its children, the final sync
included, as scripts/scale_check.py counts it). ``--cold`` drops the page cache before
each (root only), else the tree is read first. Nothing is deleted: on ext4 without a
journal, files created soon after a large deletion cost more (see _harness.py).

    python benchmarks/cpu_ab.py --tree T --out O --build before=DIR1 --build after=DIR2 \\
        [--engines uring,pread] [--rounds 5] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _cpu import CpuMeter  # benchmarks/ is on the path: this script's folder

_CHILD = """
import json, os, sys
sys.path.insert(0, sys.argv[4])
from _cpu import CpuMeter
import fastload
with CpuMeter() as m:
    fastload.stage(sys.argv[1], sys.argv[2], engine=sys.argv[3])
    os.sync()
r = m.result
print(json.dumps({"cpu": r.cpu_s, "busiest": r.busiest_s, "wall": r.wall_s}))
"""


def _prepare(tree: Path, cold: bool) -> None:
    os.sync()
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    else:
        subprocess.run(f"find '{tree}' -type f -print0 | xargs -0 cat > /dev/null",
                       shell=True, check=True)  # fmt: skip


def _fastload(site: Path, engine: str, tree: Path, dst: Path) -> dict[str, float]:
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tree), str(dst), engine, here],
        env={**os.environ, "PYTHONPATH": str(site)}, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    got: dict[str, float] = json.loads(out)
    return got


def _cp(tree: Path, dst: Path) -> dict[str, float]:
    with CpuMeter() as m:
        subprocess.run(["cp", "-r", str(tree), str(dst)], check=True)
        os.sync()
    assert m.result is not None
    return {"cpu": m.result.cpu_s, "busiest": m.result.children_s, "wall": m.result.wall_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--build", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--engines", default="uring,pread")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    a = ap.parse_args()
    if not a.tree.is_dir():
        ap.error(f"--tree {a.tree}: not a directory")
    builds = {}
    for b in a.build:
        name, _, where = b.partition("=")
        if not where or not (Path(where) / "fastload").is_dir():
            ap.error(f"--build {b!r}: give NAME=DIR, DIR holding fastload/")
        builds[name] = Path(where).resolve()
    files = sum(len(names) for _d, _s, names in os.walk(a.tree))
    cases = [(n, e) for n in builds for e in a.engines.split(",")] + [("cp -r", "")]
    got: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in cases}
    a.out.mkdir(parents=True, exist_ok=True)
    for i in range(a.rounds):
        for name, engine in cases:
            dst = a.out / f"r{time.time_ns()}"
            _prepare(a.tree, a.cold)
            r = (_cp(a.tree, dst) if name == "cp -r"
                 else _fastload(builds[name], engine, a.tree, dst))  # fmt: skip
            got[(name, engine)].append(r)
        print(f"round {i + 1}/{a.rounds}", file=sys.stderr, flush=True)
    print(f"| case ({'cold' if a.cold else 'warm'}, {files} files) | CPU-s/1,000 files "
          "median (min..max) | wall s median | busiest thread share |")
    print("|---|---|---|---|")
    for (name, engine), rs in got.items():
        cpu = [1000 * r["cpu"] / files for r in rs]
        share = statistics.median(r["busiest"] / r["wall"] for r in rs)
        print(f"| {name} {engine} | {statistics.median(cpu):.4f} ({min(cpu):.4f}.."
              f"{max(cpu):.4f}) | {statistics.median(r['wall'] for r in rs):.3f} | "
              f"{share:.0%} |")


if __name__ == "__main__":
    main()
