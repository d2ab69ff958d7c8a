"""GIL-held Python time per small object (issue 33): builds of fastload staging the same
prefix of small objects from a SeaweedFS server on loopback (tests/sources/s3server.py),
rounds interleaved, each stage in a new process whose ``PYTHONPATH`` is the build's
folder (one holding ``fastload/`` with its ``_core``).

Per round and build it prints the CPU time (``time.thread_time()``) of the thread that
awaits the small objects' GETs (``fastload-gets``: SmallGets' event loop) and of the main
thread (the whole ``stage()`` call, and of it the transfer: taking the batches, handing
them to the writers, recording what was written), in microseconds per object, and the
process's CPU (getrusage: every thread, obstore's runtime included) per 1,000 objects.
On a loaded machine these stay put where wall times do not: a thread's CPU time is what
it ran, whatever waited. The thread's CPU is an upper bound of its GIL time (obstore
releases the GIL while it waits; the little it runs without it is counted too).

    python benchmarks/gil_ab.py --out O --build before=DIR1 --build after=DIR2 \\
        [--objects 2000] [--kb 100] [--rounds 5] [--workers 64]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from objs_ab import parse_args, served  # benchmarks/ is on the path: this script's folder

_CHILD = """
import json, resource, sys, time
import fastload
from fastload.staging import fetch, remote

got = {}
run = fetch.SmallGets._main
def _main(self):
    try:
        run(self)
    finally:
        got["gets"] = time.thread_time()
fetch.SmallGets._main = _main
transfer = remote.ObjectPrefix.transfer
def _transfer(self, *a, **k):
    t0 = time.thread_time()
    try:
        return transfer(self, *a, **k)
    finally:
        got["transfer"] = time.thread_time() - t0
remote.ObjectPrefix.transfer = _transfer

def usage():
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime

u0, m0 = usage(), time.thread_time()
res = fastload.stage(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]))
got["main"] = time.thread_time() - m0
got["process"] = usage() - u0
got["files"] = res.copied_files
print(json.dumps(got))
"""


def _stage(site: Path, url: str, dst: Path, workers: int, env: dict[str, str]
           ) -> dict[str, float]:  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, url, str(dst), str(workers)],
        env={**env, "PYTHONPATH": str(site)}, check=True, stdout=subprocess.PIPE, text=True,
    ).stdout  # fmt: skip
    got: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return got


def main() -> None:
    a = parse_args(__doc__)
    builds = a.builds
    rows: dict[str, list[dict[str, float]]] = {}
    n = a.objects
    with served(a) as (server, _mod):
        env = {**os.environ, **server.env(server.endpoint)}
        for r in range(a.rounds):
            # Alternated: each build goes first in every other round.
            for name, site in builds if r % 2 == 0 else builds[::-1]:
                got = _stage(Path(site), "s3://bench/small/", a.out / f"{name}-{r}",
                             a.workers, env)  # fmt: skip
                assert got["files"] == n, got
                rows.setdefault(name, []).append(got)
                print(f"round {r + 1} {name}: gets {got['gets'] / n * 1e6:.1f} us, main "
                      f"{got['main'] / n * 1e6:.1f} us (transfer "
                      f"{got['transfer'] / n * 1e6:.1f}), process "
                      f"{got['process'] / n * 1e3:.3f} s/1,000", flush=True)  # fmt: skip

    def col(got: list[dict[str, float]], k: str, scale: float) -> str:
        xs = [x[k] / n * scale for x in got]
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"

    print(f"\n{n} objects of ~{a.kb:g} KB, {a.workers} in flight, {a.rounds} rounds "
          "alternated: medians (min..max)")
    print("| build | fastload-gets us/object | main us/object | of it transfer | "
          "process CPU ms/1,000 objects |")
    print("|---|---|---|---|---|")
    for name, got in rows.items():
        print(f"| {name} | {col(got, 'gets', 1e6)} | {col(got, 'main', 1e6)} | "
              f"{col(got, 'transfer', 1e6)} | {col(got, 'process', 1e6)} |")


if __name__ == "__main__":
    main()
