"""CPU spent by a staging round, not only its wall time (issue 33).

A round's CPU is getrusage(2) of this process (fastload runs in it) plus that of its
waited-for children (the peers run as processes: cp, rsync, GNU tar, s5cmd). The busiest
thread's share of the wall time comes from /proc/self/task/*/stat (utime + stime per
thread, in clock ticks), sampled while the round runs: threads a job starts and joins
within the round are gone from /proc by its end, so the last sample of each is what it
spent (up to one sampling interval of a thread that exits is lost). On 2 cores these say
what will not scale on 16: a stage keeping one thread at 100% of the wall time will not
go faster with more cores.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import threading
import time
from typing import Any

_TICK = 1.0 / os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.02


def _thread_ticks() -> dict[int, int]:
    """utime + stime (clock ticks) of each thread of this process now."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited between the listing and the read
            continue
        # Fields after the command (which may hold spaces) start after the last ')'.
        rest = stat[stat.rindex(b")") + 2 :].split()
        out[int(name)] = int(rest[11]) + int(rest[12])  # fields 14 and 15: utime, stime
    return out


def _usage() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@dataclasses.dataclass
class CpuRound:
    wall_s: float
    cpu_s: float
    """CPU-seconds of this process and its waited-for children, the sampler excluded."""
    children_s: float
    """Of which the children's (the peers' processes)."""
    busiest_s: float
    """CPU-seconds of the busiest thread of this process."""


class CpuMeter:
    """Measures one call: ``with CpuMeter() as m: work()``, then ``m.result``."""

    def __init__(self) -> None:
        self.result: CpuRound | None = None
        self._stop = threading.Event()
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._sampler_tid = 0
        self._thread = threading.Thread(target=self._sample, name="cpu-meter", daemon=True)

    def _take(self) -> None:
        for tid, ticks in _thread_ticks().items():
            self._first.setdefault(tid, 0)  # a thread first seen now was born in the call
            self._last[tid] = ticks

    def _sample(self) -> None:
        self._sampler_tid = threading.get_native_id()
        while not self._stop.wait(SAMPLE_S):
            self._take()

    def __enter__(self) -> CpuMeter:
        # Threads alive before the call: only what they spend during it counts.
        self._first = _thread_ticks()
        self._last = dict(self._first)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._children0 = c.ru_utime + c.ru_stime
        self._cpu0 = _usage()
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self._take()
        cpu = _usage() - self._cpu0
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = {t: (self._last[t] - self._first[t]) * _TICK for t in self._last}
        sampler = spent.pop(self._sampler_tid, 0.0)
        self.result = CpuRound(
            wall_s=wall,
            cpu_s=max(0.0, cpu - sampler),
            children_s=c.ru_utime + c.ru_stime - self._children0,
            busiest_s=max(spent.values(), default=0.0),
        )


def summary(
    rounds: list[CpuRound], files: int, nbytes: int, *, one_process: bool
) -> dict[str, Any]:
    """The figures of a case, means over its rounds, for pytest-benchmark's extra_info:
    CPU-seconds per round, per GB and per 1,000 files, and the busiest thread's share of
    the wall time (of this process; for a peer that is one single-threaded process,
    ``one_process``, its CPU over the wall time; else None)."""
    n = len(rounds)
    wall = sum(r.wall_s for r in rounds) / n
    cpu = sum(r.cpu_s for r in rounds) / n
    children = sum(r.children_s for r in rounds) / n
    busiest = sum(r.busiest_s for r in rounds) / n
    if children > 0.5 * cpu:  # the work ran in a child process
        share = children / wall if one_process and wall > 0 else None
    else:
        share = busiest / wall if wall > 0 else None
    return {
        "cpu_s": round(cpu, 4),
        "cpu_s_children": round(children, 4),
        "cpu_s_per_gb": round(cpu / (nbytes / 1e9), 3) if nbytes else None,
        "cpu_s_per_1000_files": round(cpu / (files / 1000), 4) if files else None,
        "busiest_thread_share": round(share, 3) if share is not None else None,
        "cpu_wall_s": round(wall, 4),
    }


def table(path: str) -> str:
    """A markdown table of the CPU figures in a pytest-benchmark JSON file."""
    import json

    with open(path) as f:
        doc = json.load(f)
    rows = [
        "| case | wall s | CPU s | CPU s/GB | CPU s/1,000 files | busiest thread |",
        "|---|---|---|---|---|---|",
    ]
    for b in doc["benchmarks"]:
        x = b["extra_info"]
        if "cpu_s" not in x:
            continue
        share = x.get("busiest_thread_share")
        rows.append(
            f"| {b['name']} | {x['cpu_wall_s']:.3f} | {x['cpu_s']:.3f} | {x['cpu_s_per_gb']} "
            f"| {x['cpu_s_per_1000_files']} | {'-' if share is None else f'{share:.0%}'} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(table(sys.argv[1]))
