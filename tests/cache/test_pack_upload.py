"""Packing into a bucket (the real S3 server on loopback): ShardWriter uploads each shard
as it closes and the index last; ``fastload pack SRC s3://bucket/prefix/`` does the same
for a folder; both read back through the remote datasets, the index from the object."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from remote_kit import plain

import fastload
from fastload import _core
from fastload.cache import ShardCache
from fastload.cli import main as cli
from kit.shards import make_samples

pytestmark = pytest.mark.native


def zst_copy(key: str) -> list[str]:
    """The compressed copy of an index, uploaded beside it where libzstd is present."""
    return [key] if _core.zstd_available() else []


def keys_in(s3: Any, bucket: str, prefix: str) -> list[str]:
    got = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in got)


def test_shard_writer_uploads_shards_then_index(tmp_path: Path, s3: Any, bucket: str) -> None:
    samples = make_samples(60, seed=4, long_keys="none")
    url = f"s3://{bucket}/w/"
    with fastload.ShardWriter(url, max_count=16) as w:
        for i, (key, fields) in enumerate(samples):
            w.write({"__key__": key, **fields})
            if i == 40:  # two shards closed and uploaded (the writer waits for neither)
                w._uploader.wait()
                assert keys_in(s3, bucket, "w/") == ["w/shard-000000.tar", "w/shard-000001.tar"]
    assert keys_in(s3, bucket, "w/") == [
        "w/index.fidx", *zst_copy("w/index.fidx.zst"), *[f"w/shard-{i:06d}.tar" for i in range(4)]
    ]
    assert not w.out_dir.exists()  # the local copies are gone
    ds = fastload.ShardIndexDataset(url, cache_dir=tmp_path / "c", fetch="range")
    assert not ShardCache(tmp_path / "c").events()  # the index object: no shard downloaded
    got = ds.__getitems__(list(range(len(ds))))
    assert [(s["__key__"], {k: bytes(v) for k, v in s.items() if k != "__key__"})
            for s in got] == [(k, f) for k, f in samples]


def test_shard_writer_error_uploads_no_index(s3: Any, bucket: str) -> None:
    with pytest.raises(RuntimeError), fastload.ShardWriter(f"s3://{bucket}/bad/",
                                                            max_count=8) as w:
        for key, fields in make_samples(20, seed=1, long_keys="none"):
            w.write({"__key__": key, **fields})
        raise RuntimeError("stop")
    assert "bad/index.fidx" not in keys_in(s3, bucket, "bad/")


def test_cli_pack_to_bucket_reads_back(tmp_path: Path, s3: Any, bucket: str) -> None:
    src = tmp_path / "src"
    for key, fields in make_samples(50, seed=2, long_keys="none"):
        for field, data in fields.items():
            p = src / f"{key}.{field}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    assert cli(["pack", str(src), str(tmp_path / "local"), "--max-count", "12"]) == 0
    assert cli(["pack", str(src), f"s3://{bucket}/p/", "--max-count", "12"]) == 0
    local = sorted(p.name for p in (tmp_path / "local").iterdir() if not p.name.startswith("."))
    assert keys_in(s3, bucket, "p/") == sorted([f"p/{n}" for n in local]
                                                + zst_copy("p/index.fidx.zst"))
    remote = fastload.ShardIterableDataset(f"s3://{bucket}/p/", cache_dir=tmp_path / "c", seed=3)
    here = fastload.ShardIterableDataset(str(tmp_path / "local" / "index.fidx"), seed=3)
    assert [plain(s) for s in remote] == [plain(s) for s in here]


def test_pack_into_a_bucket_returns_the_bucket_places(tmp_path: Path, s3: Any, bucket: str) -> None:
    src = tmp_path / "src"
    for key, fields in make_samples(30, seed=5, long_keys="none"):
        for field, data in fields.items():
            p = src / f"{key}.{field}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    r = fastload.pack(src, f"s3://{bucket}/api", max_count=8)
    base = f"s3://{bucket}/api/"
    # The result names where the shards are (the bucket), not the temporary folder they
    # were packed in and uploaded from.
    assert r.out_dir == base and r.index == base + "index.fidx"
    assert list(r.shards) == [f"{base}shard-{i:06d}.tar" for i in range(4)]
    assert keys_in(s3, bucket, "api/") == sorted(
        ["api/index.fidx", *zst_copy("api/index.fidx.zst")]
        + [str(s)[len(f"s3://{bucket}/"):] for s in r.shards]
    )
    assert r.samples == 30 and r.total_shards == 4
