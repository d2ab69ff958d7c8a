"""A remote reader opens its index once (issue 55): letting go of a shard drops the
index's mapping of that shard only, instead of reopening the index (one mmap and a
checksum of all its tables: a full pass over an index of millions of samples per shard
change). No mapping keeps an evicted shard's bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from remote_kit import put_shards, write_shards

import fastload
from fastload import _core
from fastload.cache import ShardCache

pytestmark = pytest.mark.native


def deleted_mappings(cache_dir: Path) -> set[str]:
    """Files of ``cache_dir`` this process maps that were removed (evicted)."""
    out = set()
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            if str(cache_dir) in line and line.rstrip().endswith("(deleted)"):
                out.add(line.split(None, 5)[5])
    return out


def test_an_epoch_that_changes_shards_opens_the_index_once(
        tmp_path: Path, s3: Any, bucket: str) -> None:
    paths = write_shards(tmp_path / "local", [30] * 8)
    url = put_shards(s3, bucket, paths)
    sizes = sorted((p.stat().st_size for p in paths), reverse=True)
    cache_dir = tmp_path / "c"
    ds = fastload.ShardIndexDataset(url, cache_dir=cache_dir, cache_limit=sizes[0] + sizes[1])
    local = fastload.ShardIndexDataset([str(p) for p in paths])
    assert ds._remote is not None
    checksummed = _core.index_tables_checksummed()
    for start in range(0, len(ds), 20):  # batches of 20: every shard, in turn, twice
        ids = list(range(start, min(start + 20, len(ds))))
        got = ds.__getitems__(ids)
        assert [s["__key__"] for s in got] == [s["__key__"] for s in local.__getitems__(ids)]
        assert [bytes(s["jpg"]) for s in got] == [bytes(s["jpg"]) for s in
                                                  local.__getitems__(ids)]
        del got
        assert deleted_mappings(cache_dir) == set()  # the let go of shards: not mapped
    events = ShardCache(cache_dir).events()
    assert sum(op == "evict" for _, op, _, _ in events) >= len(paths) - 2  # shards changed
    assert ds._remote.opens == 1
    assert _core.index_tables_checksummed() == checksummed
