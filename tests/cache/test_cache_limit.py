"""ShardIterableDataset over shards in a real S3 server (SeaweedFS on loopback) through a
tight node-local cache, read by a DataLoader's real worker processes (issue 32): every
limit that holds what the workers pin at once completes the epoch (the smallest such
limit included), a smaller one is a ValueError naming the minimum when the dataset is
made or the loader starts (never a wait for room), and prefetching never takes room a
reader needs.

Each reader keeps the shard it reads pinned until it moves on, also while the DataLoader
waits on another worker (it asks the workers in turn), so ``k`` workers pin the ``k``
largest shards at once.
"""

from __future__ import annotations

import collections
import fcntl
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from remote_kit import cache_bytes, cache_peak, issue_shards, plain, put_shards, with_index_only  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload.cache import ShardCache, store  # noqa: E402

pytestmark = [
    pytest.mark.native,
    # Three workers on a machine of two cores: slower, not wrong.
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

SHARDS = 12
PER_SHARD = 310
#: A hang shows as a failure after this long, not as a stuck run: a reader that waits
#: for room gives up after it (a batch the DataLoader does not get, after twice that).
GUARD = 60.0


def keep(sample: Any) -> Any:
    return sample


@pytest.fixture
def bucket_shards(tmp_path: Path, s3: Any, bucket: str) -> tuple[list[Path], str]:
    """12 shards of 310 samples of 5-11 KB (the issue's shape, smaller samples)."""
    paths = issue_shards(tmp_path / "local", seed=32, shards=SHARDS, per_shard=PER_SHARD)
    return paths, put_shards(s3, bucket, paths)


@pytest.fixture(autouse=True)
def _guard(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read where the downloads happen: this process (it serves its forked workers).
    monkeypatch.setattr(store, "WAIT_FOR_ROOM", GUARD)


def sizes_of(paths: list[Path]) -> list[int]:
    return sorted((p.stat().st_size for p in paths), reverse=True)


def loader_epoch(ds: Any, workers: int) -> list[Any]:
    loader = DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=keep,
                        timeout=2 * GUARD)
    return [plain(s) for s in loader]


def downloads(cache_dir: Path) -> int:
    return sum(1 for e in ShardCache(cache_dir).events() if e[1] == "download")


# --- limits that hold what the workers pin complete the epoch ------------------------------


@pytest.mark.parametrize(
    ("workers", "limit_of", "kw"),
    [
        # The smallest that must work: the two largest shards, one pinned per worker.
        (2, lambda sizes: sizes[0] + sizes[1], {}),
        # The issue's: a quarter of the data, with the default prefetch and block.
        (2, lambda sizes: sum(sizes) // 4, {}),
        # Several shards, a deep prefetch and blocks of a few shards.
        (2, lambda sizes: sum(sizes[:3]), {"prefetch": 6, "shuffle_block": 700}),
        # Three workers at their minimum.
        (3, lambda sizes: sum(sizes[:3]), {}),
    ],
    ids=["2-workers-minimum", "2-workers-quarter", "2-workers-deep-prefetch",
         "3-workers-minimum"],
)
def test_epoch_completes_under_limit(bucket_shards: tuple[list[Path], str], tmp_path: Path,
                                     workers: int, limit_of: Any, kw: dict[str, Any]) -> None:
    paths, url = bucket_shards
    limit = int(limit_of(sizes_of(paths)))
    cache_dir = tmp_path / "c"
    ds = fastload.ShardIterableDataset(url, shuffle=True, seed=5, cache_dir=cache_dir,
                                       cache_limit=limit, **kw)
    local = fastload.ShardIterableDataset([str(p) for p in paths], shuffle=True, seed=5,
                                          **{k: v for k, v in kw.items() if k != "prefetch"})
    with cache_peak(cache_dir) as peak:
        got = loader_epoch(ds, workers)
    want = [plain(s) for s in local]
    assert collections.Counter(map(str, got)) == collections.Counter(map(str, want))
    assert len(got) == SHARDS * PER_SHARD
    assert 0 < peak[0] <= limit
    events = ShardCache(cache_dir).events()
    assert any(op == "evict" for _, op, _, _ in events)  # the limit was reached
    # Shards were fetched again when the shuffle came back to them.
    assert downloads(cache_dir) > SHARDS


# --- a limit below it is an error up front -------------------------------------------------


def test_too_small_for_the_workers_when_made(bucket_shards: tuple[list[Path], str],
                                             tmp_path: Path) -> None:
    paths, url = bucket_shards
    sizes = sizes_of(paths)
    need = sizes[0] + sizes[1]
    with pytest.raises(ValueError, match=rf"minimum cache_limit is .* \({need} bytes\)") as e:
        fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", cache_limit=need - 1,
                                      num_workers=2)
    assert "num_workers=2" in str(e.value) and "prefetch (2)" in str(e.value)
    assert "\n" not in str(e.value)
    # At the minimum it is made.
    fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", cache_limit=need,
                                  num_workers=2)


@pytest.mark.parametrize("workers", [2, 3])
def test_too_small_for_the_workers_when_the_loader_starts(
        bucket_shards: tuple[list[Path], str], tmp_path: Path, workers: int) -> None:
    """The issue's limit (a quarter of the data: about three shards) with workers that
    pin more than it holds; the dataset does not know the worker count until they start."""
    paths, url = bucket_shards
    sizes = sizes_of(paths)
    limit = sum(sizes) // 4 if workers == 3 else int(1.5 * sizes[0])
    need = sum(sizes[:workers])
    assert limit < need
    cache_dir = tmp_path / "c"
    ds = fastload.ShardIterableDataset(url, shuffle=True, seed=5, cache_dir=cache_dir,
                                       cache_limit=limit)
    before = downloads(cache_dir)  # the index was built from the shards' headers
    start = time.monotonic()
    it = iter(DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=keep,
                         timeout=2 * GUARD))  # fmt: skip
    try:
        with pytest.raises(ValueError, match=rf"num_workers={workers} the minimum cache_limit "
                                             rf"is .* \({need} bytes\)"):
            list(it)
    finally:
        # torch's shutdown sends no end marker to a worker whose iteration ended in an
        # error, and waits up to 5 s for it to notice: send every worker one, now rather
        # than when the iterator is collected in some later test.
        it._workers_done_event.set()  # type: ignore[attr-defined]
        for q in it._index_queues:  # type: ignore[attr-defined]
            q.put(None)
        it._shutdown_workers()  # type: ignore[attr-defined]
    assert time.monotonic() - start < GUARD  # an error up front, not a wait for room
    assert downloads(cache_dir) == before  # before any shard was fetched


# --- prefetching never takes room a reader needs --------------------------------------------


def test_prefetch_leaves_room_for_a_reader(bucket_shards: tuple[list[Path], str],
                                           tmp_path: Path) -> None:
    paths, url = bucket_shards
    sizes = sizes_of(paths)
    cache_dir = tmp_path / "c"
    limit = 3 * sizes[0] + with_index_only(url, cache_dir)  # three shards, and the index
    ds = fastload.ShardIterableDataset(url, cache_dir=cache_dir, cache_limit=limit)
    assert ds._remote is not None
    shards = ds._remote.shards
    for s in range(SHARDS):
        shards.cache.drop(shards.urls[s])  # what building the index left
    first = shards.pinned_one(0)
    # One reader holds a shard: a prefetch may take one more, leaving room for the next.
    assert shards.prefetch(1) is True
    second = shards.pinned_one(2)  # a second reader
    try:
        # Two pinned: the last shard's room is a reader's, not a prefetch's.
        assert shards.prefetch(3) is False
        third = shards.pinned_one(3, wait=False)  # a reader gets it at once (evicts 1)
        assert third is not None
        third.release()
        # While a reader waits for room, no prefetch starts, however much room is free.
        second.release()
        shards.cache.drop(shards.urls[3])
        fd = os.open(cache_dir / "state" / "waiting", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # as a waiting reader does
            assert shards.prefetch(4) is False
        finally:
            os.close(fd)
        assert shards.prefetch(4) is True
    finally:
        first.release()
    assert cache_bytes(cache_dir) <= limit
