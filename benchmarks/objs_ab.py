"""Small objects from S3 (issue 33): builds of fastload against ``s5cmd cp``, rounds
interleaved, on a SeaweedFS server on loopback (tests/sources/s3server.py): CPU-seconds
per 1,000 objects, wall time, the busiest thread's share of the wall time, and how much
the GIL was held (a probe thread in each fastload process wakes every millisecond; its
mean lateness and the share of its wake-ups late by over a millisecond say how often
another thread held the GIL, its idle figures taken before the stage, in the same
process).

Each round stages the prefix into a fresh folder under ``--out`` once per build (each in
a new process whose ``PYTHONPATH`` is the build's folder: one holding ``fastload/``
with its ``_core``), then copies it with s5cmd. Nothing is deleted between rounds.

    python benchmarks/objs_ab.py --out O --build before=DIR1 --build after=DIR2 \\
        [--objects 2000] [--kb 100] [--rounds 5] [--workers 64]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _cpu import CpuMeter  # benchmarks/ is on the path: this script's folder

HERE = Path(__file__).resolve().parent
S3SERVER = HERE.parent / "tests" / "sources" / "s3server.py"

_CHILD = """
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[4])
from _cpu import CpuMeter
import fastload

def probe(stop, out):
    late = []
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(0.001)
        late.append(time.perf_counter() - t0 - 0.001)
    out.append(late)

def probed(work):
    stop, out = threading.Event(), []
    t = threading.Thread(target=probe, args=(stop, out), daemon=True)
    t.start()
    work()
    stop.set()
    t.join()
    late = out[0]
    return sum(late) / len(late), sum(1 for x in late if x > 0.001) / len(late)

idle = probed(lambda: time.sleep(1.0))
with CpuMeter() as m:
    busy = probed(lambda: fastload.stage(sys.argv[1], sys.argv[2], workers=int(sys.argv[3])))
r = m.result
print(json.dumps({"cpu": r.cpu_s, "busiest": r.busiest_s, "wall": r.wall_s,
                  "late_ms": busy[0] * 1e3, "late_share": busy[1],
                  "idle_late_ms": idle[0] * 1e3, "idle_late_share": idle[1]}))
"""


def _s3server() -> Any:
    spec = importlib.util.spec_from_file_location("_objs_s3server", S3SERVER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_objs_s3server"] = mod
    spec.loader.exec_module(mod)
    return mod


def _fastload(site: Path, url: str, dst: Path, workers: int, env: dict[str, str]
              ) -> dict[str, float]:  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, url, str(dst), str(workers), str(HERE)],
        env={**env, "PYTHONPATH": str(site)}, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    got: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return got


def _s5cmd(exe: str, endpoint: str, url: str, dst: Path, env: dict[str, str]
           ) -> dict[str, float]:  # fmt: skip
    dst.mkdir(parents=True)
    with CpuMeter() as m:
        subprocess.run([exe, "--endpoint-url", endpoint, "cp", url + "*", f"{dst}/"],
                       check=True, stdout=subprocess.DEVNULL, env=env)  # fmt: skip
    assert m.result is not None
    return {"cpu": m.result.cpu_s, "busiest": m.result.children_s, "wall": m.result.wall_s}


def parse_args(doc: str | None) -> argparse.Namespace:
    """The options of this script and of gil_ab.py: where, which builds, what objects."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--build", action="append", default=[], help="NAME=DIR (repeatable)")
    ap.add_argument("--objects", type=int, default=2000)
    ap.add_argument("--kb", type=float, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=64)
    a = ap.parse_args()
    a.builds = [tuple(b.split("=", 1)) for b in a.build]
    a.out.mkdir(parents=True, exist_ok=True)
    return a


@contextlib.contextmanager
def served(a: argparse.Namespace) -> Iterator[tuple[Any, Any]]:
    """``(server, the kit's module)``: a server on loopback holding ``a.objects`` objects
    of about ``a.kb`` KB (0.5x-1.5x) under ``s3://bench/small/``."""
    mod = _s3server()
    rng = random.Random(33)
    files = {f"small/c{i % 20:02d}/o{i:05d}.bin":
             rng.randbytes(max(1, int(a.kb * 1024 * rng.uniform(0.5, 1.5))))
             for i in range(a.objects)}  # fmt: skip
    with mod.s3_server(a.out / "server") as server:
        mod.make_bucket(server, "bench")
        mod.upload(server, "bench", files)
        yield server, mod


def main() -> None:
    a = parse_args(__doc__)
    builds = a.builds
    s5 = shutil.which("s5cmd") or str(Path(sys.executable).parent / "s5cmd")
    rows: dict[str, list[dict[str, float]]] = {}
    with served(a) as (server, _mod):
        env = {**os.environ, **server.env(server.endpoint)}
        url = "s3://bench/small/"
        for r in range(a.rounds):
            for name, site in builds:
                rows.setdefault(name, []).append(
                    _fastload(Path(site), url, a.out / f"{name}-{r}", a.workers, env))
            rows.setdefault("s5cmd", []).append(
                _s5cmd(s5, server.endpoint, url, a.out / f"s5cmd-{r}", env))
            print(f"round {r + 1}/{a.rounds}", {k: round(v[-1]["wall"], 3)
                                                for k, v in rows.items()}, flush=True)  # fmt: skip
            time.sleep(0.5)
    n = a.objects / 1000
    print(f"\n{a.objects} objects of ~{a.kb:g} KB, {a.rounds} rounds interleaved, medians")
    print("| tool | wall s | CPU s | CPU s/1,000 objects | busiest thread | GIL probe late ms "
          "(idle) | late > 1 ms (idle) |")
    print("|---|---|---|---|---|---|---|")
    for name, got in rows.items():
        def med(k: str, got: list[dict[str, float]] = got) -> float:
            return statistics.median(x[k] for x in got)
        share = med("busiest") / med("wall")
        gil = (f"{med('late_ms'):.2f} ({med('idle_late_ms'):.2f}) | "
               f"{med('late_share'):.0%} ({med('idle_late_share'):.0%})"
               if "late_ms" in got[0] else "- | -")  # fmt: skip
        print(f"| {name} | {med('wall'):.3f} | {med('cpu'):.3f} | {med('cpu') / n:.3f} | "
              f"{share:.0%} | {gil} |")
    peer = rows["s5cmd"]
    for name, _ in builds:
        speed = statistics.median(s["wall"] / b["wall"] for b, s in zip(rows[name], peer,
                                                                        strict=True))
        cpu = statistics.median(b["cpu"] / s["cpu"] for b, s in zip(rows[name], peer,
                                                                    strict=True))
        print(f"{name}: s5cmd's wall / its wall (speed) {speed:.2f}, its CPU / s5cmd's "
              f"{cpu:.2f} (medians of the rounds' ratios)")


if __name__ == "__main__":
    main()
