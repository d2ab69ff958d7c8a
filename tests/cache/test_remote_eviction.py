"""The node cache under pressure, against the loopback S3 server: an epoch through a
cache a quarter of the data set's size, and a pinned shard never evicted."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from remote_kit import (  # noqa: E402
    cache_bytes,
    cache_peak,
    epoch_keys,
    put_shards,
    with_index_only,
    write_shards,
)

import fastload  # noqa: E402
from fastload.cache import ShardCache  # noqa: E402

pytestmark = pytest.mark.native


def test_quarter_limit_epoch(tmp_path: Path, s3: Any, bucket: str) -> None:
    sizes = [20] * 16
    paths = write_shards(tmp_path / "local", sizes)
    url = put_shards(s3, bucket, paths)
    total = sum(p.stat().st_size for p in paths)
    limit = total // 4
    cache_dir = tmp_path / "c"
    ds = fastload.ShardIterableDataset(url, cache_dir=cache_dir, cache_limit=limit, seed=3)
    local = fastload.ShardIterableDataset([str(p) for p in paths], seed=3)
    with cache_peak(cache_dir) as peak:
        got = epoch_keys(ds, workers=2)
    assert collections.Counter(map(str, got)) == collections.Counter(map(str, epoch_keys(local)))
    assert 0 < peak[0] <= limit
    # No shard downloaded twice unless it was evicted in between (the limit needed the
    # room); every shard downloaded at least once.
    events = ShardCache(cache_dir).events()
    cached: set[str] = set()
    downloads: collections.Counter[str] = collections.Counter()
    for _, op, name, _ in events:
        if op == "download":
            assert name not in cached, f"{name} downloaded again while cached"
            cached.add(name)
            downloads[name] += 1
        else:
            cached.discard(name)
    assert len(downloads) == len(paths)


def test_pinned_shard_is_never_evicted(tmp_path: Path, s3: Any, bucket: str) -> None:
    paths = write_shards(tmp_path / "local", [20] * 6)
    url = put_shards(s3, bucket, paths)
    sizes = [p.stat().st_size for p in paths]
    assert min(sizes[1:]) * 2 > max(sizes[1:])  # never room for two others beside 0
    cache_dir = tmp_path / "c"
    # Shard 0 and one other, beside the cache's own files.
    limit = sizes[0] + max(sizes[1:]) + with_index_only(url, cache_dir)
    ds = fastload.ShardIndexDataset(url, cache_dir=cache_dir, cache_limit=limit)
    assert ds._remote is not None
    shards = ds._remote.shards
    before = len(ShardCache(cache_dir).events())
    pin = shards.pinned_one(0)  # the least recently used from now on
    try:
        for s in range(1, len(paths)):
            shards.pinned_one(s).release()  # evicts the one before, never 0
            assert pin.path.exists()
            assert cache_bytes(cache_dir) <= limit
        second = shards.pinned_one(1)
        assert shards.prefetch(2) is False  # both pinned: no room, and the prefetch gives up
        assert cache_bytes(cache_dir) <= limit
        second.release()
    finally:
        pin.release()
    events = ShardCache(cache_dir).events()[before:]
    evicted = [n for _, op, n, _ in events if op == "evict"]
    assert shards.entries[0].name not in evicted
    assert len(evicted) >= len(paths) - 2  # 1..4 at least, each for the next
    # Unpinned, 0 is the least recently used: the next miss evicts it.
    shards.pinned_one(3).release()
    assert not pin.path.exists()


# --- failures ----------------------------------------------------------------------------
