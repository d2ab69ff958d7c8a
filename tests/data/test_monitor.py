"""fastload.monitor (issue 36): the share of time a loop waits for data against the test's
own timing of loops of sleeps; counters against the work done (samples and bytes of a
real epoch; cache downloads and GETs against the loopback S3 proxy's count of GETs,
evictions against the shards downloaded and the files left in the cache folder: counts
the monitor does not make); the Chrome trace of 2 real workers;
the stall message for a slow transform, a small cache and a slow store (latency added by
the proxy). No durations are asserted: only shares of time, compared with what the test
times itself around the same loop (loops of sleeps set their shape), within 5 percentage
points.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from torch.utils.data import DataLoader, IterableDataset, get_worker_info  # noqa: E402

import fastload  # noqa: E402
from fastload import ShardIndex  # noqa: E402
from kit.shards import Sample, make_samples, write_tarfile  # noqa: E402

pytestmark = [pytest.mark.native]

#: How far the monitor's share of time may be from the one the test times itself.
TOLERANCE = 0.05


def keep(batch: Any) -> Any:
    return batch


class Sleepy(IterableDataset):  # type: ignore[misc]
    """``n`` items (split among the workers), each after ``delay`` seconds: not a
    fastload dataset."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        workers, me = (1, 0) if info is None else (info.num_workers, info.id)
        for i in range(me, self.n, workers):
            time.sleep(self.delay)
            yield i


def run(loop: Any, step: float = 0.0) -> int:
    n = 0
    for _ in loop:
        if step:
            time.sleep(step)
        n += 1
    return n


def run_timed(loop: Any, step: float) -> tuple[int, float]:
    """Runs the loop with steps of ``step`` seconds; returns how many batches came and
    the share of the time after the first batch that the loop spent waiting for the
    next, timed here around each ``next()``: what the monitor must report. (Sleeps set
    the shape; what a loaded machine makes of them is measured, not assumed.)"""
    it = iter(loop)
    n, wait, total, start = 0, 0.0, 0.0, None
    while True:
        t0 = time.monotonic()
        try:
            next(it)
        except StopIteration:
            break
        t1 = time.monotonic()
        if start is None:
            start = t1
        else:
            wait += t1 - t0
        n += 1
        time.sleep(step)
    if start is not None:
        total = time.monotonic() - start
    return n, wait / total if total > 0 else 0.0


# --- the share of time the loop waits ---------------------------------------------------------


@pytest.mark.parametrize(
    ("workers", "delay", "step"),
    [
        # Read in the main process: each batch waits its 30 ms, each step takes 20 ms
        # (idle, the loop waits 60% of the time).
        (0, 0.030, 0.020),
        # Two workers making a batch every 60 ms each (one every 30 ms between them),
        # steps of 15 ms: the loop waits 15 ms of every 30 (50%).
        (2, 0.060, 0.015),
        # Data faster than the step: the loop hardly waits.
        (2, 0.005, 0.050),
    ],
    ids=["main-process", "2-workers-slow-data", "2-workers-slow-step"],
)
def test_wait_share_matches_the_loop(workers: int, delay: float, step: float) -> None:
    loader = DataLoader(Sleepy(40, delay), batch_size=None, num_workers=workers,
                        collate_fn=keep)
    m = fastload.monitor(loader)
    n, share = run_timed(m, step)
    assert n == 40
    s = m.stats()
    assert s["data/steps"] == 40 and s["data/samples"] == 40
    assert abs(s["data/wait_share"] - share) < TOLERANCE, (s["data/wait_share"], share)
    assert s["data/wait_s"] > 0 and s["data/step_s"] > 0
    # The workers' side of a loader that is not fastload's: batches handed over.
    assert s["workers/batches"] == 40
    m.close()


def test_any_iterable() -> None:
    """A plain generator: the loop's side only."""

    def gen() -> Iterator[list[int]]:
        for i in range(30):
            time.sleep(0.030)
            yield [i, i]

    m = fastload.monitor(gen())
    n, share = run_timed(m, 0.030)
    assert n == 30
    s = m.stats()
    assert s["data/samples"] == 60
    assert abs(s["data/wait_share"] - share) < TOLERANCE, (s["data/wait_share"], share)
    assert "no stage times" in (m.stall() or "")


# --- counters against the work done -------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    root = tmp_path_factory.mktemp("mon")
    samples: list[Sample] = []
    paths = []
    for s in range(4):
        part = make_samples(60, seed=300 + s, prefix=f"m{s}/")
        samples += part
        paths.append(write_tarfile(root / f"shard-{s}.tar", part))
    ShardIndex.build(paths, root / "all.fidx")
    return root / "all.fidx", samples


def payload(samples: list[Sample]) -> int:
    return sum(len(v) for _, fields in samples for v in fields.values())


@pytest.mark.parametrize("workers", [0, 2])
def test_counters_match_the_epoch(local: tuple[Path, list[Sample]], workers: int) -> None:
    path, samples = local
    ds = fastload.ShardIndexDataset(path)
    loader = DataLoader(ds, batch_size=16, num_workers=workers, collate_fn=keep)
    m = fastload.monitor(loader)
    got = [s["__key__"] for b in m for s in b]
    assert sorted(got) == sorted(k for k, _ in samples)
    s = m.stats()
    batches = -(-len(samples) // 16)
    assert s["data/steps"] == batches and s["data/samples"] == len(samples)
    assert s["workers/batches"] == batches and s["workers/samples"] == len(samples)
    assert s["data/bytes"] == payload(samples)
    assert s["workers/read_s"] > 0 and s["workers/transform_s"] == 0
    who = ["main"] if workers == 0 else [str(w) for w in range(workers)]
    assert sum(s[f"worker/{w}/samples"] for w in who) == len(samples)
    if workers:
        assert all(s[f"worker/{w}/batches"] > 0 for w in who)
        assert s["worker/main/batches"] == 0
    # A second epoch adds to the counts.
    run(m)
    assert m.stats()["workers/samples"] == 2 * len(samples)
    m.close()


def test_packed_iterable_counts(local: tuple[Path, list[Sample]]) -> None:
    """Batches packed by the dataset (shared memory): samples and bytes still counted."""
    path, samples = local
    ds = fastload.ShardIterableDataset(path, batch_size=16, collate_fn=fastload.collate,
                                       shuffle=False)  # fmt: skip
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=fastload.collate)
    m = fastload.monitor(loader)
    run(m)
    s = m.stats()
    assert s["data/samples"] == len(samples) == s["workers/samples"]
    assert s["data/bytes"] == payload(samples)
    m.close()


def test_summary_through_logging(local: tuple[Path, list[Sample]],
                                 caplog: pytest.LogCaptureFixture) -> None:
    path, _ = local
    loader = DataLoader(fastload.ShardIndexDataset(path), batch_size=8, num_workers=0,
                        collate_fn=keep)
    m = fastload.monitor(loader, log_every=0.0)
    with caplog.at_level(logging.INFO, logger="fastload.monitor"):
        run(m)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastload.monitor"]
    assert lines and all(line.startswith("data wait ") for line in lines)
    assert "samples/s" in lines[-1]

    class Bar:
        postfix = ""

        def set_postfix_str(self, s: str) -> None:
            self.postfix = s

    bar = Bar()
    run(fastload.monitor(loader, log_every=0.0, progress=bar))
    assert bar.postfix.startswith("data wait ")


# --- the trace -------------------------------------------------------------------------------


def slow_transform(sample: Any) -> Any:
    time.sleep(0.002)
    return sample


def test_trace_of_two_workers(local: tuple[Path, list[Sample]], tmp_path: Path) -> None:
    path, _ = local
    ds = fastload.ShardIterableDataset(path, batch_size=8, transform=slow_transform,
                                       collate_fn=keep)  # fmt: skip
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=keep)
    trace = tmp_path / "trace.json"
    m = fastload.monitor(loader, trace=trace, trace_steps=10)
    run(m, 0.002)
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    for e in events:
        assert {"ph", "pid", "name"} <= set(e)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float | int)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}  # fmt: skip
    workers = {pid for pid, name in names.items() if name.startswith("worker ")}
    assert sorted(names[p] for p in workers) == ["worker 0", "worker 1"]
    spans = Counter((names.get(e["pid"]), e["name"]) for e in events if e["ph"] == "X")
    for w in ("worker 0", "worker 1"):
        for stage in ("read", "transform", "collate"):
            assert spans[(w, stage)] > 0, (w, stage, spans)
    # The loop's first 10 steps: a wait before each, a step between.
    assert spans[("main process", "wait for batch")] == 10
    assert spans[("main process", "step")] == 9
    assert m.stats()["data/steps"] == 240 // 8


# --- stalls ------------------------------------------------------------------------------------


def test_stall_slow_transform(local: tuple[Path, list[Sample]]) -> None:
    path, _ = local
    ds = fastload.ShardIndexDataset(path, transform=slow_transform)
    m = fastload.monitor(DataLoader(ds, batch_size=8, num_workers=2, collate_fn=keep))
    run(m)
    why = m.stall()
    assert why is not None and why.startswith("workers busy in transform"), why
    assert "add workers" in why
    assert "stall: workers busy in transform" in m.summary()


# --- remote shards: the cache and the store -------------------------------------------------

SHARDS = 6


@pytest.fixture
def remote(tmp_path: Path, s3: Any, bucket: str) -> tuple[str, list[int]]:
    """6 shards of 100 samples of 3-6 KB in the bucket, their index beside them (so that
    nothing is downloaded before the epoch); returns their URL pattern and sizes."""
    from sources.s3server import upload

    rng = random.Random(36)
    paths = []
    for s in range(SHARDS):
        samples = [(f"r{s}/k{i:04d}", {"bin": rng.randbytes(rng.randrange(3000, 6000))})
                   for i in range(100)]  # fmt: skip
        paths.append(write_tarfile(tmp_path / "local" / f"train-{s:06d}.tar", samples))
    upload(s3, bucket, {f"data/{p.name}": p.read_bytes() for p in paths})
    index = tmp_path / "local" / "index.fidx"
    ShardIndex.build(paths, index)
    newest = max(o["LastModified"] for o in
                 s3.client().list_objects_v2(Bucket=bucket, Prefix="data/")["Contents"])
    import datetime

    while datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) <= newest:
        time.sleep(0.05)
    upload(s3, bucket, {"data/index.fidx": index.read_bytes()})
    url = f"s3://{bucket}/data/train-{{000000..{SHARDS - 1:06d}}}.tar"
    return url, sorted((p.stat().st_size for p in paths), reverse=True)


def cached_files(cache: Path) -> int:
    """Whole shards in the cache folder (its layout: shards/<entry>, .part while one
    downloads), counted on disk."""
    shards = cache / "shards"
    if not shards.is_dir():
        return 0
    return sum(1 for p in shards.iterdir() if not p.name.endswith(".part"))


def test_cache_counters_and_gets(remote: tuple[str, list[int]], tmp_path: Path,
                                 proxy: Any) -> None:
    url, sizes = remote
    cache = tmp_path / "cache"
    ds = fastload.ShardIterableDataset(url, batch_size=20, shuffle=False, cache_dir=cache,
                                       collate_fn=keep)  # fmt: skip
    assert cached_files(cache) == 0  # the index came from index.fidx
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=keep)
    proxy.reset_counts()
    m = fastload.monitor(loader)
    run(m)
    s = m.stats()
    assert s["data/samples"] == SHARDS * 100
    # Each worker reads 3 whole shards in order: one pin each, hit or miss.
    assert s["cache/hits"] + s["cache/misses"] == SHARDS
    assert s["cache/hit_rate"] == s["cache/hits"] / SHARDS
    assert s["cache/downloads"] == cached_files(cache) == SHARDS
    assert s["cache/download_bytes"] == sum(sizes)
    assert s["store/gets"] == proxy.gets() == SHARDS
    assert s["cache/evictions"] == 0
    # A second epoch over a cache that holds every shard: all hits, no GET.
    proxy.reset_counts()
    m2 = fastload.monitor(loader)
    run(m2)
    s2 = m2.stats()
    assert (s2["cache/hits"], s2["cache/misses"], s2["cache/downloads"]) == (SHARDS, 0, 0)
    assert s2["cache/hit_rate"] == 1.0
    assert s2["store/gets"] == proxy.gets() == 0
    assert "cache 100% hit" in m2.summary()


def test_small_cache_stall_and_trace(remote: tuple[str, list[int]], tmp_path: Path,
                                     proxy: Any) -> None:
    url, sizes = remote
    cache = tmp_path / "cache"
    limit = sizes[0] + sizes[1]  # what 2 workers pin at once: nothing more
    ds = fastload.ShardIterableDataset(url, batch_size=20, cache_dir=cache, cache_limit=limit,
                                       collate_fn=keep, shuffle_block=50)  # fmt: skip
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=keep)
    proxy.reset_counts()
    trace = tmp_path / "trace.json"
    m = fastload.monitor(loader, trace=trace, trace_steps=1000)
    run(m)
    s = m.stats()
    # Counted outside the monitor and the cache: each download is one GET at the proxy
    # (no faults here), and each shard downloaded that is not in the folder now was
    # evicted.
    gets = proxy.gets()
    assert s["cache/downloads"] == gets >= SHARDS
    assert s["cache/evictions"] == gets - cached_files(cache) > 0
    assert s["store/gets"] == gets
    assert s["cache/misses"] > 0
    pins = s["cache/hits"] + s["cache/misses"]
    assert s["cache/hit_rate"] == s["cache/hits"] / pins < 1
    why = m.stall()
    assert why is not None and why.startswith("cache misses"), (why, s)
    assert "raise cache_limit or prefetch" in why
    events = json.loads(trace.read_text())["traceEvents"]
    kinds = Counter(e["name"].split(" ")[0] for e in events if e.get("cat") == "cache")
    assert kinds["download"] == gets and kinds["evict"] == gets - cached_files(cache)


def test_slow_store_stall(remote: tuple[str, list[int]], tmp_path: Path, proxy: Any) -> None:
    url, _ = remote
    ds = fastload.ShardIterableDataset(url, batch_size=20, cache_dir=tmp_path / "cache",
                                       collate_fn=keep, prefetch=1)  # fmt: skip
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=keep)
    proxy.latency = 0.3
    m = fastload.monitor(loader)
    run(m)
    s = m.stats()
    assert s["cache/evictions"] == 0 and s["store/gets"] == SHARDS
    why = m.stall()
    assert why is not None and why.startswith("store bound"), (why, s)
    assert "GETs in flight" in why
    assert "| s3 " in m.summary()


@pytest.mark.parametrize("workers", [0, 2])
def test_store_retries_are_the_faults(remote: tuple[str, list[int]], tmp_path: Path,
                                      proxy: Any, workers: int) -> None:
    """503s, resets and bodies cut short while the cache downloads the shards: each is
    one retry in ``store/retries`` (the main process's row with workers: it serves their
    downloads), and the epoch is whole."""
    url, sizes = remote
    ds = fastload.ShardIterableDataset(url, batch_size=20, shuffle=False,
                                       cache_dir=tmp_path / "cache", collate_fn=keep)  # fmt: skip
    loader = DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=keep)
    proxy.faults = 0
    # Under half the requests fail (48 %): a download's 8 retries are not all spent.
    proxy.fail_every, proxy.reset_every, proxy.truncate_every = 7, 11, 3
    proxy.truncate_at = 100_000  # the shards are about 450 kB
    m = fastload.monitor(loader)
    run(m)
    s = m.stats()
    assert s["data/samples"] == SHARDS * 100
    assert s["cache/downloads"] == SHARDS and s["cache/download_bytes"] == sum(sizes)
    assert proxy.faults >= 2
    assert s["store/retries"] == s["workers/retries"] == proxy.faults
    assert s["worker/main/retries"] == proxy.faults
    # Without faults: none.
    proxy.fail_every = proxy.reset_every = proxy.truncate_every = 0
    again = fastload.monitor(DataLoader(
        fastload.ShardIterableDataset(url, batch_size=20, shuffle=False,
                                      cache_dir=tmp_path / "cache2", collate_fn=keep),
        batch_size=None, num_workers=workers, collate_fn=keep,
    ))  # fmt: skip
    run(again)
    assert again.stats()["store/retries"] == 0
