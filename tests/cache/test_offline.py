"""Remote shards already in the node's cache are read while the store is down (issue 32):
the dataset is made from the last listing, with a one-line warning, and reads the same
samples; with a shard missing from the cache the store's error comes through, one
line. A real S3 server (SeaweedFS) behind a proxy that is closed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from remote_kit import plain, put_shards, write_shards

import fastload

pytestmark = pytest.mark.native


def _samples(ds: Any) -> list[Any]:
    return sorted((s["__key__"], sorted(plain(s).items())) for s in ds)


def test_cached_shards_read_while_the_store_is_down(
    tmp_path: Path, s3: Any, bucket: str, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    paths = write_shards(tmp_path / "local", [20, 30, 25])
    url = put_shards(s3, bucket, paths)
    cache = tmp_path / "cache"
    online = _samples(fastload.ShardIterableDataset(url, cache_dir=cache))
    assert len(online) == 75

    # Another set of the same bucket, never read: nothing of it is cached.
    other = url.replace("{000000..000002}", "{000000..000001}")
    proxy.close()  # the store is down from here on
    with caplog.at_level(logging.WARNING):
        offline = _samples(fastload.ShardIterableDataset(url, cache_dir=cache))
    assert offline == online
    said = [m for m in caplog.messages if "cannot reach" in m]
    assert len(said) == 1 and "\n" not in said[0] and "3 shards cached" in said[0]

    with pytest.raises(OSError, match="cannot reach") as e:
        fastload.ShardIterableDataset(other, cache_dir=cache)
    assert "\n" not in str(e.value)
    with pytest.raises(OSError, match="cannot reach"):
        fastload.ShardIterableDataset(url, cache_dir=tmp_path / "empty-cache")
