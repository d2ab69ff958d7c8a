"""The cache folder never holds more than ``cache_limit`` (issue 55), counting every file
in it (distinct inodes): shards, downloads in progress, the view with its index, the
listing, the event log, also while the index is built from shards that have no
``index.fidx`` (it once kept a sparse header copy of every shard beside them, in
``views/*/.build-*/``, 27 MB against a 27 MB limit), and while the index object that
``pack`` uploads beside them is fetched."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from remote_kit import (  # noqa: E402
    after_last_modified,
    cache_peak,
    epoch_keys,
    folder_bytes,
    put_shards,
    write_shards,
)

import fastload  # noqa: E402
from fastload.cache import ShardCache  # noqa: E402
from fastload.packing.upload import Uploader  # noqa: E402

pytestmark = pytest.mark.native


@pytest.mark.parametrize("index", ["built", "fetched"])
def test_folder_within_limit_through_an_epoch(tmp_path: Path, s3: Any, bucket: str,
                                              index: str) -> None:
    """``built``: from the shards' headers; ``fetched``: the index object beside them
    (what pack uploads: the zstd copy is read where libzstd is present)."""
    paths = write_shards(tmp_path / "local", [60] * 12)
    url = put_shards(s3, bucket, paths)
    if index == "fetched":
        fastload.ShardIndex.build(paths, tmp_path / "local" / "index.fidx")
        after_last_modified(s3, bucket, "data/")
        up = Uploader(f"s3://{bucket}/data/")
        up.submit_index(tmp_path / "local" / "index.fidx", "index.fidx")
        up.wait()
        up.close()
    limit = sum(p.stat().st_size for p in paths) // 4
    cache_dir = tmp_path / "c"
    with cache_peak(cache_dir, folder_bytes) as peak:
        ds = fastload.ShardIterableDataset(url, shuffle=True, seed=5, cache_dir=cache_dir,
                                           cache_limit=limit)  # builds or fetches the index
        made = len(ShardCache(cache_dir).events())  # downloads to build it
        got = epoch_keys(ds, workers=2)
    local = fastload.ShardIterableDataset([str(p) for p in paths], shuffle=True, seed=5)
    assert collections.Counter(map(str, got)) == collections.Counter(map(str, epoch_keys(local)))
    assert any(op == "evict" for _, op, _, _ in ShardCache(cache_dir).events())
    assert 0 < peak[0] <= limit
    assert (made == 0) == (index == "fetched")
    assert not [p for p in (cache_dir / "views").rglob(".build-*")]
    assert len(list((cache_dir / "views").rglob("index.fidx"))) == 1
    assert os.path.getsize(next((cache_dir / "views").rglob("index.fidx"))) > 0
    assert folder_bytes(cache_dir) <= limit
