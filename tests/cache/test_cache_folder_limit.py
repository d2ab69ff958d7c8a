"""The cache folder never holds more than ``cache_limit`` (issue 55), counting every file
in it (distinct inodes): shards, downloads in progress, the view with its index, the
listing, the event log, also while the index is built from shards that have no
``index.fidx`` (it once kept a sparse header copy of every shard beside them, in
``views/*/.build-*/``, 27 MB against a 27 MB limit)."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from remote_kit import cache_peak, epoch_keys, folder_bytes, put_shards, write_shards  # noqa: E402

import fastload  # noqa: E402
from fastload.cache import ShardCache  # noqa: E402

pytestmark = pytest.mark.native


def test_folder_within_limit_through_an_epoch_that_builds_the_index(
        tmp_path: Path, s3: Any, bucket: str) -> None:
    paths = write_shards(tmp_path / "local", [60] * 12)
    url = put_shards(s3, bucket, paths)
    limit = sum(p.stat().st_size for p in paths) // 4
    cache_dir = tmp_path / "c"
    with cache_peak(cache_dir, folder_bytes) as peak:
        ds = fastload.ShardIterableDataset(url, shuffle=True, seed=5, cache_dir=cache_dir,
                                           cache_limit=limit)  # builds the index
        got = epoch_keys(ds, workers=2)
    local = fastload.ShardIterableDataset([str(p) for p in paths], shuffle=True, seed=5)
    assert collections.Counter(map(str, got)) == collections.Counter(map(str, epoch_keys(local)))
    assert any(op == "evict" for _, op, _, _ in ShardCache(cache_dir).events())
    assert 0 < peak[0] <= limit
    assert not [p for p in (cache_dir / "views").rglob(".build-*")]
    assert len(list((cache_dir / "views").rglob("index.fidx"))) == 1
    assert os.path.getsize(next((cache_dir / "views").rglob("index.fidx"))) > 0
    assert folder_bytes(cache_dir) <= limit
