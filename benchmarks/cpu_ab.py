"""Two builds of fastload against ``cp -r`` on one tree or more, rounds interleaved
(issue 33: CPU per file): CPU-seconds per 1,000 files, wall time, the busiest thread's
share and, for fastload, its main (Python) thread's CPU.

Each round stages the tree into a fresh folder under ``--out`` once per build and engine
(each in a new process whose ``PYTHONPATH`` is the build's folder: one holding
``fastload/`` with its ``_core``), then copies it with ``cp -r``; the CPU is
:class:`_cpu.CpuMeter`'s (getrusage of the process and its children, the final sync
included, as scripts/scale_check.py counts it, unless ``--no-sync``). ``--cold`` drops
the page cache before each (root only), else the tree is read first; each copy's pages
are dropped from the page cache after it (no round reclaims another's). Nothing is deleted
unless ``--clean`` (a round's copies removed after it, the cases' order rotated each
round): on ext4 without a journal, files created soon after a large deletion cost more
(see _harness.py).

Given two trees or more (``--tree`` repeated: the same sizes of file, different counts),
it also splits each case's CPU into a fixed cost per stage (process work that does not
grow with the files: thread and ring setup, lazy imports, the manifest) and a marginal
cost per 1,000 files: the line through the medians of the smallest and largest tree.

    python benchmarks/cpu_ab.py --tree T [--tree T2] --out O --build before=DIR1 \\
        --build after=DIR2 [--engines uring,pread] [--rounds 5] [--cold] [--clean] \\
        [--no-sync]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _cpu import CpuMeter  # benchmarks/ is on the path: this script's folder

_CHILD = """
import json, os, sys, time
sys.path.insert(0, sys.argv[4])
from _cpu import CpuMeter
import fastload
with CpuMeter() as m:
    t0 = time.thread_time()
    fastload.stage(sys.argv[1], sys.argv[2], engine=sys.argv[3])
    main = time.thread_time() - t0
    if sys.argv[5] == "sync":
        os.sync()
os.sync()
r = m.result
print(json.dumps({"cpu": r.cpu_s, "busiest": r.busiest_s, "wall": r.wall_s, "main": main}))
"""


def _prepare(tree: Path, cold: bool) -> None:
    os.sync()
    if cold:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    else:
        subprocess.run(f"find '{tree}' -type f -print0 | xargs -0 cat > /dev/null",
                       shell=True, check=True)  # fmt: skip


def _evict(dst: Path) -> None:
    """Drops the copy's pages from the page cache (written back first): copies kept
    would fill memory, and a process allocating pages with little memory free reclaims
    them itself, on its own CPU time (the next round's)."""
    os.sync()
    for d, _s, names in os.walk(dst):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_HOLD = """
import mmap, sys
n = int(sys.argv[1]) << 20
m = mmap.mmap(-1, n)
try:
    m.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))  # backs every page at once
except OSError:
    for i in range(0, n, 4096):
        m[i] = 1
print("held", flush=True)
sys.stdin.read()  # until the benchmark ends
"""


def _hold_free(keep_mb: int) -> subprocess.Popen[str] | None:
    """A process holding (touched) all of the free memory but ``keep_mb`` MB, or None
    where there is not more than that free."""
    free = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemFree:"):
            free = int(line.split()[1]) // 1024
    if free <= keep_mb:
        return None
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(free - keep_mb)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "held":
        raise RuntimeError("the memory-holding process failed")
    print(f"holding {free - keep_mb} MB of {free} MB free", file=sys.stderr, flush=True)
    return proc


def _fastload(site: Path, engine: str, tree: Path, dst: Path, sync: bool) -> dict[str, float]:
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tree), str(dst), engine, here,
         "sync" if sync else "-"],
        env={**os.environ, "PYTHONPATH": str(site)}, check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    got: dict[str, float] = json.loads(out)
    return got


def _cp(tree: Path, dst: Path, sync: bool) -> dict[str, float]:
    with CpuMeter() as m:
        subprocess.run(["cp", "-r", str(tree), str(dst)], check=True)
        if sync:
            os.sync()
    os.sync()
    assert m.result is not None
    return {"cpu": m.result.cpu_s, "busiest": m.result.children_s, "wall": m.result.wall_s}


def _count(tree: Path) -> int:
    return sum(len(names) for _d, _s, names in os.walk(tree))


def _med(rs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def _report(got: dict[tuple[str, str, Path], list[dict[str, Any]]],
            files: dict[Path, int], cold: bool) -> None:  # fmt: skip
    print(f"| case ({'cold' if cold else 'warm'}) | files | CPU-s/1,000 files median "
          "(min..max) | / cp -r, same round: median (min..max) | main thread CPU-s/1,000 "
          "| wall s median | busiest thread share |")
    print("|---|---|---|---|---|---|---|")
    for (name, engine, tree), rs in got.items():
        n = files[tree]
        cpu = [1000 * r["cpu"] / n for r in rs]
        # A loaded machine inflates every process's CPU time alike for a while: the ratio
        # to cp -r of the same round keeps less of that than the figures themselves.
        cp = got.get(("cp -r", "", tree), [])
        ratios = [r["cpu"] / c["cpu"] for r, c in zip(rs, cp, strict=False) if c["cpu"] > 0]
        ratio = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
                 if ratios else "-")  # fmt: skip
        share = statistics.median(r["busiest"] / r["wall"] for r in rs)
        main = f"{1000 * _med(rs, 'main') / n:.4f}" if "main" in rs[0] else "-"
        print(f"| {name} {engine} | {n} | {statistics.median(cpu):.4f} ({min(cpu):.4f}.."
              f"{max(cpu):.4f}) | {ratio} | {main} | {_med(rs, 'wall'):.3f} | {share:.0%} |")
    trees = sorted(files, key=files.__getitem__)
    if len(trees) < 2:
        return
    small, big = trees[0], trees[-1]
    dn = files[big] - files[small]
    print(f"\nFixed cost per stage and marginal CPU per 1,000 files ({files[small]} and "
          f"{files[big]} files, medians):\n")
    print("| case | fixed CPU-s per stage | marginal CPU-s/1,000 files | "
          "main thread: fixed, marginal |")
    print("|---|---|---|---|")
    cases = dict.fromkeys((name, engine) for name, engine, _t in got)
    for name, engine in cases:
        a, b = got[(name, engine, small)], got[(name, engine, big)]
        slope = (_med(b, "cpu") - _med(a, "cpu")) / dn
        fixed = _med(a, "cpu") - slope * files[small]
        main = "-"
        if "main" in a[0]:
            ms = (_med(b, "main") - _med(a, "main")) / dn
            main = f"{_med(a, 'main') - ms * files[small]:.4f}, {1000 * ms:.4f}"
        print(f"| {name} {engine} | {fixed:.4f} | {1000 * slope:.4f} | {main} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tree", type=Path, action="append", required=True,
                    help="a tree to copy (repeatable)")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--build", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--engines", default="uring,pread")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--no-sync", dest="sync", action="store_false",
                    help="stop the CPU count when the copy returns: the final sync, done "
                    "after it, writes back (in this process) what others sharing the disk "
                    "left dirty too, which a loaded machine charges to the round")
    ap.add_argument("--clean", action="store_true",
                    help="remove each round's copies after it (big trees, little disk)")
    ap.add_argument("--hold-free", type=int, default=0, metavar="MB",
                    help="hold all of the free memory but MB for the run, and keep each "
                    "copy's pages (see above: a VM giving free pages back to its host)")
    a = ap.parse_args()
    for t in a.tree:
        if not t.is_dir():
            ap.error(f"--tree {t}: not a directory")
    builds = {}
    for b in a.build:
        name, _, where = b.partition("=")
        if not where or not (Path(where) / "fastload").is_dir():
            ap.error(f"--build {b!r}: give NAME=DIR, DIR holding fastload/")
        builds[name] = Path(where).resolve()
    files = {t: _count(t) for t in a.tree}
    cases = [(n, e) for n in builds for e in a.engines.split(",")] + [("cp -r", "")]
    got: dict[tuple[str, str, Path], list[dict[str, Any]]] = {
        (n, e, t): [] for t in a.tree for n, e in cases
    }
    a.out.mkdir(parents=True, exist_ok=True)
    for tree in a.tree:
        _prepare(tree, False)  # the trees in the page cache before the free memory is held
    holder = _hold_free(a.hold_free) if a.hold_free else None
    try:
        _rounds(a, builds, cases, got)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    _report(got, files, a.cold)


def _rounds(a: argparse.Namespace, builds: dict[str, Path], cases: list[tuple[str, str]],
            got: dict[tuple[str, str, Path], list[dict[str, Any]]]) -> None:  # fmt: skip
    for i in range(a.rounds):
        made = []
        k = i % len(cases) if a.clean else 0  # rotated: no case always follows a deletion
        for tree in a.tree:
            for name, engine in cases[k:] + cases[:k]:
                dst = a.out / f"r{time.time_ns()}"
                _prepare(tree, a.cold)
                r = (_cp(tree, dst, a.sync) if name == "cp -r"
                     else _fastload(builds[name], engine, tree, dst, a.sync))  # fmt: skip
                got[(name, engine, tree)].append(r)
                made.append(dst)
                if a.hold_free:
                    os.sync()  # kept: reclaimed (and its pages reused) as rounds go on
                else:
                    _evict(dst)
        if a.clean:
            for d in made:
                shutil.rmtree(d, ignore_errors=True)
                shutil.rmtree(d.parent / f".{d.name}.fastload", ignore_errors=True)
        print(f"round {i + 1}/{a.rounds}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
