"""One pass of scripts/scale-check.sh on the cores this process may run on (taskset).

Times the local staging work (a tree, its tar) for fastload and its peers (``cp -r``,
``find | xargs -P<cores> cp --parents``, GNU tar) beside the machine's ceilings (a
parallel read of the tree, a direct read and a direct write of as many bytes as its
tar), each round cold where the page cache can be dropped (root), else warm (said in
the output). For each: the wall time, CPU-seconds per GB and per 1,000 files, and the
busiest thread's share of the wall time (benchmarks/_cpu.py). Prints one JSON line per
case; scale-check.sh gathers them (and the object-store and remote-epoch cases, run
through the benchmarks under the same taskset) into one table.

    python scripts/scale_check.py --work DIR [--files N] [--kb K] [--rounds R] [--only ...]
    python scripts/scale_check.py --from-bench BENCH.json --cores C   (rows of a benchmark run)
    python scripts/scale_check.py --table ROWS.jsonl                    (the one table)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _cpu import CpuMeter, summary  # noqa: E402


def make_tree(root: Path, files: int, kb: float) -> tuple[int, int]:
    """``files`` files of about ``kb`` KB (sizes spread 0.25x-1.75x) in folders of 100,
    made once and kept (a marker file says it is complete)."""
    done = root.parent / f"{root.name}.complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        rnd = random.Random(33)
        for i in range(files):
            d = root / f"c{i // 100:04d}"
            d.mkdir(parents=True, exist_ok=True)
            size = int(kb * 1024 * rnd.uniform(0.25, 1.75))
            (d / f"f{i:06d}.bin").write_bytes(os.urandom(size))
        done.write_text("")
    n = total = 0
    for dirpath, _d, names in os.walk(root):
        for name in names:
            n += 1
            total += os.path.getsize(os.path.join(dirpath, name))
    return n, total


def drop_caches() -> bool:
    if os.geteuid() != 0:
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def warm(root: Path) -> None:
    subprocess.run(f"find '{root}' -type f -print0 | xargs -0 cat > /dev/null", shell=True,
                   check=True)


def sh(cmd: str) -> Callable[[Path], None]:
    def run(dst: Path) -> None:
        subprocess.run(cmd.format(dst=dst), shell=True, check=True, stdout=subprocess.DEVNULL)

    return run


def measure(name: str, work: str, fn: Callable[[Path], Any], *, src: Path, out: Path,
            files: int, nbytes: int, rounds: int, one_process: bool = False) -> dict[str, Any]:
    """``rounds`` rounds of ``fn(dst)``, each into a new folder under ``out`` and timed to
    its data on disk (sync). The copies stay until the pass ends: on ext4 without a
    journal, files created within a minute of a large deletion pay for it (see
    benchmarks/_harness.py, RECENTLY_DELETED_S), which would charge a tool for the round
    before it."""
    rs = []
    cold = False
    for _ in range(rounds):
        dst = out / f"r{len(list(out.glob('r*'))) if out.exists() else 0}" / "dst"
        dst.parent.mkdir(parents=True)
        os.sync()
        cold = drop_caches()
        if not cold:
            warm(src)
        with CpuMeter() as m:
            fn(dst)
            os.sync()
        assert m.result is not None
        rs.append(m.result)
    row = {"work": work, "tool": name, "cores": len(os.sched_getaffinity(0)),
           "cache": "cold" if cold else "warm", "files": files, "bytes": nbytes,
           "wall_s": min(r.wall_s for r in rs)}
    row.update(summary(rs, files, nbytes, one_process=one_process))
    return row


def from_bench(path: Path, cores: int) -> None:
    """Rows of a pytest-benchmark JSON file (the s3 and remote-epoch cases)."""
    with open(path) as f:
        doc = json.load(f)
    for b in doc["benchmarks"]:
        x = b["extra_info"]
        row = {"work": b.get("group") or b["name"], "tool": x.get("tool", b["name"]),
               "cores": cores, "cache": x.get("cache", ""), "files": x.get("files"),
               "bytes": x.get("bytes"), "wall_s": b["stats"]["min"]}
        for k in ("cpu_s", "cpu_s_per_gb", "cpu_s_per_1000_files", "busiest_thread_share"):
            row[k] = x.get(k)
        print(json.dumps(row))


def table(path: Path) -> None:
    """The one table: a row per work and tool, wall time and CPU figures per core count,
    and fastload's ratio (best peer's time / fastload's; ceilings are not peers)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    best: dict[tuple[str, int], float] = {}
    for r in rows:
        # A floor that only copies bytes (s5cmd-cp-only beside the epoch) is no peer.
        floor = r["work"] == "ceiling" or str(r["tool"]).endswith("-only")
        if not str(r["tool"]).startswith("fastload") and not floor:
            key = (r["work"], r["cores"])
            best[key] = min(best.get(key, float("inf")), r["wall_s"])
    print("| work | tool | cores | cache | wall s | vs best peer | CPU s/GB "
          "| CPU s/1,000 files | busiest thread |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["work"], r["tool"], r["cores"])):
        ratio = ""
        peer = best.get((r["work"], r["cores"]))
        if str(r["tool"]).startswith("fastload") and peer and r["wall_s"]:
            ratio = f"{peer / r['wall_s']:.2f}x"
        share = r.get("busiest_thread_share")

        def fmt(v: Any) -> str:
            return "-" if v is None else f"{v:g}"

        print(f"| {r['work']} | {r['tool']} | {r['cores']} | {r['cache']} | {r['wall_s']:.3f} "
              f"| {ratio} | {fmt(r.get('cpu_s_per_gb'))} | {fmt(r.get('cpu_s_per_1000_files'))} "
              f"| {'-' if share is None else f'{share:.0%}'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--from-bench", type=Path)
    ap.add_argument("--cores", type=int, default=0)
    ap.add_argument("--table", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--kb", type=float, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="tree,tar,ceiling")
    a = ap.parse_args()
    if a.from_bench:
        return from_bench(a.from_bench, a.cores)
    if a.table:
        return table(a.table)
    if a.work is None:
        ap.error("--work is required")
    import fastload

    cores = len(os.sched_getaffinity(0))
    work = a.work
    tree = work / f"tree-{a.files}-{a.kb:g}"
    files, nbytes = make_tree(tree, a.files, a.kb)
    tar = work / f"{tree.name}.tar"
    if not tar.exists():
        subprocess.run(["tar", "-cf", f"{tar}.part", "-C", str(tree), "."],
                       check=True)
        os.rename(f"{tar}.part", tar)
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    only = set(a.only.split(","))
    kw = {"src": tree, "out": out, "files": files, "nbytes": nbytes, "rounds": a.rounds}

    def fl_stage(src: Path, **opts: Any) -> Callable[[Path], None]:
        return lambda dst: (fastload.stage(src, dst, **opts), None)[1]

    cases: list[tuple[str, str, Callable[[Path], None], dict[str, Any]]] = []
    if "tree" in only:
        cases += [
            ("fastload", "tree", fl_stage(tree), {}),
            ("fastload pread", "tree", fl_stage(tree, engine="pread"), {}),
            ("fastload uring", "tree", fl_stage(tree, engine="uring"), {}),
            ("cp -r", "tree", sh(f"cp -r '{tree}' {{dst}}"), {"one_process": True}),
            (f"xargs -P{cores} cp", "tree",
             # (folders first: concurrent cp --parents race to create them)
             sh(f"mkdir -p {{dst}} && cd '{tree}' && find . -type d -print0 | "
                f"(cd {{dst}} && xargs -0 mkdir -p) && find . -type f -print0 | "
                f"xargs -0 -P{cores} -n64 cp --parents -t {{dst}}"), {}),
        ]
    if "tar" in only:
        cases += [
            ("fastload", "tar", fl_stage(tar), {}),
            ("GNU tar", "tar", sh(f"mkdir -p {{dst}} && tar -xf '{tar}' -C {{dst}}"),
             {"one_process": True}),
        ]
    if "ceiling" in only:
        size_mb = max(1, nbytes >> 20)
        cases += [
            (f"{cores} parallel cat", "ceiling",
             sh(f"cd '{tree}' && find . -type f -print0 | xargs -0 -P{cores} -n64 cat "
                "> /dev/null"), {}),
            ("dd iflag=direct read", "ceiling",
             sh(f"dd if='{tar}' of=/dev/null bs=4M iflag=direct status=none"),
             {"one_process": True}),
            ("dd oflag=direct write", "ceiling",
             sh(f"mkdir -p {{dst}} && dd if=/dev/zero of={{dst}}/w bs=4M count={size_mb // 4 + 1} "
                "oflag=direct status=none"), {"one_process": True}),
        ]
    for name, what, fn, extra in cases:
        if name == "fastload uring" and "uring" not in fastload.available_engines():
            continue
        t0 = time.monotonic()
        kw["out"] = work / "out" / f"{what}-{name}".replace(" ", "_")
        row = measure(name, what, fn, **kw, **extra)  # type: ignore[arg-type]
        row["case_s"] = round(time.monotonic() - t0, 2)
        print(json.dumps(row), flush=True)
    shutil.rmtree(work / "out", ignore_errors=True)


if __name__ == "__main__":
    main()
