"""ShardIndexDataset: fields, transforms, batched fetch, both access paths on both I/O
backends, pickling, DataLoader workers under fork and spawn, DistributedSampler."""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import fastload  # noqa: E402
from fastload import ShardIndex  # noqa: E402
from kit.shards import Sample, check_samples, make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    """Four shards of 50 samples and their index."""
    root = tmp_path_factory.mktemp("ds")
    samples: list[Sample] = []
    paths = []
    for s in range(4):
        part = make_samples(50, seed=100 + s, prefix=f"p{s}/")
        samples += part
        paths.append(write_tarfile(root / f"shard-{s}.tar", part, "pax"))
    ShardIndex.build(paths, root / "all.fidx")
    return root / "all.fidx", samples


def as_bytes(sample: dict[str, Any]) -> dict[str, Any]:
    """A module-level transform (spawn workers must be able to import it)."""
    return {k: (v if k == "__key__" else bytes(v)) for k, v in sample.items()}


def keep_list(batch: list[Any]) -> list[Any]:
    return batch


def test_sources(shards: tuple[Path, list[Sample]], tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    path, samples = shards
    check_samples(fastload.ShardIndexDataset(path), samples)
    check_samples(fastload.ShardIndexDataset(ShardIndex.open(path)), samples)
    # Shards without an index: built once into the cache folder, reused after.
    monkeypatch.setenv("FASTLOAD_INDEX_CACHE", str(tmp_path / "cache"))
    ds = fastload.ShardIndexDataset(str(path.parent / "shard-*.tar"))
    check_samples(ds, samples)
    (cached,) = (tmp_path / "cache").iterdir()
    mtime = cached.stat().st_mtime_ns
    fastload.ShardIndexDataset(str(path.parent / "shard-*.tar"))
    assert cached.stat().st_mtime_ns == mtime


def test_fields_transform_and_errors(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, fields=["cls", "jpg"], transform=as_bytes, copy=True)
    s = ds[-1]
    assert s == {"__key__": samples[-1][0], "cls": samples[-1][1]["cls"],
                 "jpg": samples[-1][1]["jpg"]}
    assert all(type(v) is bytes for k, v in s.items() if k != "__key__")
    assert ds.get(samples[7][0])["cls"] == samples[7][1]["cls"]
    assert [b["__key__"] for b in ds.__getitems__([3, 1, 3])] == [samples[i][0] for i in (3, 1, 3)]
    with pytest.raises(IndexError):
        ds[len(samples)]
    with pytest.raises(IndexError):
        ds.__getitems__([0, -len(samples) - 1])
    with pytest.raises(ValueError, match="no field 'png'"):
        fastload.ShardIndexDataset(path, fields=["png"])
    with pytest.raises(ValueError, match="access"):
        fastload.ShardIndexDataset(path, access="mmap2")
    with pytest.raises(KeyError):
        ds.get("p0/nope")


def test_missing_field_in_one_sample(tmp_path: Path) -> None:
    samples = make_samples(3, seed=1)
    del samples[1][1]["jpg"]
    idx = ShardIndex.build([write_tarfile(tmp_path / "s.tar", samples)], tmp_path / "s.fidx")
    ds = fastload.ShardIndexDataset(idx, fields=["jpg"])
    assert bytes(ds[0]["jpg"]) == samples[0][1]["jpg"]
    with pytest.raises(KeyError, match="has no field 'jpg'"):
        ds[1]
    assert "jpg" not in fastload.ShardIndexDataset(idx)[1]


def test_read_access_on_each_engine(
    shards: tuple[Path, list[Sample]], engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLOAD_ENGINE", engine)
    path, samples = shards
    for copy in (False, True):
        ds = fastload.ShardIndexDataset(path, access="read", copy=copy)
        check_samples(ds, samples)
        assert ds.index._native.engine == engine


def test_pickle_carries_no_mapping(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, fields=["jpg"], access="read")
    ds[0]
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    again = pickle.loads(blob)
    assert again._index is None
    assert bytes(again[5]["jpg"]) == samples[5][1]["jpg"]


@pytest.mark.parametrize(
    ("start", "access"), [("fork", "mmap"), ("fork", "read"), ("spawn", "mmap")]
)
def test_dataloader_workers(shards: tuple[Path, list[Sample]], start: str, access: str) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, transform=as_bytes, access=access)
    ds.__getitems__([0, 1])  # the parent has used it (and, for "read", started an engine)
    loader = DataLoader(
        ds,
        batch_size=16,
        shuffle=True,
        num_workers=2,
        collate_fn=keep_list,
        multiprocessing_context=multiprocessing.get_context(start),
        generator=torch.Generator().manual_seed(0),
    )
    seen = {s["__key__"]: s for batch in loader for s in batch}
    assert len(seen) == len(samples)
    for key, fields in samples:
        assert seen[key] == {"__key__": key, **fields}


def test_payloads_cross_worker_boundary(shards: tuple[Path, list[Sample]]) -> None:
    """Zero-copy payloads from a worker arrive as bytes (they pickle so)."""
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, fields=["cls"])
    loader = DataLoader(ds, batch_size=50, num_workers=1, collate_fn=keep_list,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    first = next(iter(loader))
    assert first[0]["cls"] == samples[0][1]["cls"]


def test_distributed_sampler(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, fields=["cls"], copy=True)
    keys: list[list[str]] = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(1)
        loader = DataLoader(ds, batch_size=32, sampler=sampler, collate_fn=keep_list)
        keys.append([s["__key__"] for batch in loader for s in batch])
    assert len(keys[0]) == len(keys[1]) == len(samples) // 2
    assert set(keys[0]).isdisjoint(keys[1])
    assert set(keys[0]) | set(keys[1]) == {k for k, _ in samples}
