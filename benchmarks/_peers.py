"""The peers that read their own formats: MosaicML streaming (MDS), litdata (its optimized
chunks) and Hugging Face ``datasets`` (Arrow), built from the same samples as fastload's
tar shards (data.mds_records, data.litdata_records, data.arrow_records) and read the way
their documentation recommends: local folders read in place (no remote, no copy into a
cache), each library's own shuffle, its own data loader where it has one.

None of them is a dependency of the project: ``scripts/bench-peers.sh`` installs them in a
benchmark venv (litdata and mosaicml-streaming with --no-deps: they require torchvision,
which would pull another torch). Where one is missing, its cases skip and say so.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from _guard import require_module
from _harness import IndexedShards, Source
from _peer_imports import (  # noqa: F401  (re-exported for the benchmarks)
    HINT,
    STUBS,
    import_datasets,
    import_litdata,
    import_streaming,
    quiet,
)


def is_peer(tool: str) -> bool:
    """Tool names, as report.py shows them: ``mosaicml``, ``litdata``, ``hf-datasets``, and
    variants (``mosaicml-local``: its LocalDataset; ``hf-datasets-batched``:
    ``Dataset.__getitems__`` a batch of indices at a time; ``litdata-nodrop``:
    drop_last=False)."""
    return tool.split("-")[0] in ("mosaicml", "litdata", "hf")


def importer(tool: str) -> Callable[[], ModuleType]:
    base = tool.split("-")[0]
    return {"mosaicml": import_streaming, "litdata": import_litdata, "hf": import_datasets}[base]


# --- the data sets ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PeerData:
    """One peer's copy of a set of tar shards, in its own format."""

    fmt: str  # mds, litdata, arrow
    path: Path
    samples: int
    bytes: int  # on disk
    shards: IndexedShards  # what it was written from

    def source(self) -> Source:
        """Samples and the payload bytes of the tar shards it holds (the same bytes every
        tool reads), so rates compare across tools."""
        return self.shards.source()

    @property
    def chunks(self) -> int:
        """Its shard / chunk / Arrow files."""
        return sum(
            1
            for _d, _s, names in os.walk(self.path)
            for n in names
            if n.endswith((".mds", ".bin", ".arrow"))
        )


FORMAT = {"mosaicml": "mds", "litdata": "litdata", "hf": "arrow"}


def peer_data(tool: str, shards: IndexedShards, *, per_chunk: int | None = None) -> PeerData:
    """``shards`` in the format ``tool`` reads (cached beside the shards). Chunking: each
    peer's default (MDS 64 MiB shards, litdata 64 MB chunks, Arrow 500 MB files), or about
    ``per_chunk`` samples per shard/chunk where given (litdata exactly)."""
    from data import arrow_records, keyed, litdata_records, mds_records, shard_records

    base = tool.split("-")[0]
    fmt = FORMAT[base]
    importer(tool)()
    src = shards.folder.name
    if fmt == "mds":
        limit: int | str = 1 << 26
        if per_chunk:  # MDSWriter limits bytes: per_chunk samples of the first shard's mean
            first = list(shard_records(shards.paths[:1]))
            mean = sum(len(v) + 8 for r in first for v in r.values()) / len(first)
            limit = int(per_chunk * mean)
        path = mds_records(keyed("mds", src=src, limit=limit), shards.folder, size_limit=limit)
    elif fmt == "litdata":
        path = litdata_records(
            keyed("litdata", src=src, per=per_chunk or 0),
            shards.folder,
            chunk_size=per_chunk,
        )
    else:
        path = arrow_records(keyed("arrow", src=src), shards.folder)
    nbytes = sum(
        os.path.getsize(os.path.join(d, n)) for d, _s, names in os.walk(path) for n in names
    )
    return PeerData(fmt, path, shards.samples, nbytes, shards)


# --- reading ------------------------------------------------------------------------------


def as_list(batch: list[Any]) -> list[Any]:
    """collate_fn: the batch as it is (payloads need no tensors to be counted)."""
    return batch


def clean_streaming() -> None:
    """Frees the shared memory a previous StreamingDataset of this process left behind,
    so the next one can take the same local folder (streaming refuses a reused one)."""
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    del streaming
    clean_stale_shared_memory()


def random_dataset(tool: str, d: PeerData, cache: Path) -> Any:
    """A dataset to index with ``ds[i]`` in this process."""
    with quiet():
        return _random_dataset(tool, d, cache)


def _random_dataset(tool: str, d: PeerData, cache: Path) -> Any:
    if tool == "mosaicml":
        clean_streaming()
        return import_streaming().StreamingDataset(local=str(d.path))
    if tool == "mosaicml-local":
        return import_streaming().LocalDataset(local=str(d.path))
    if tool == "litdata":
        return import_litdata().StreamingDataset(input_dir=str(d.path), cache_dir=str(cache))
    if tool.startswith("hf-datasets"):
        return import_datasets().load_from_disk(str(d.path))
    raise ValueError(tool)


def _loader_kwargs(
    batch: int, workers: int, collate_fn: Callable[[list[Any]], Any]
) -> dict[str, Any]:
    """A DataLoader's arguments, as every peer case gets them (fork workers)."""
    return {
        "batch_size": batch,
        "num_workers": workers,
        "collate_fn": collate_fn,
        "multiprocessing_context": multiprocessing.get_context("fork"),
    }


def loader(
    tool: str,
    d: PeerData,
    cache: Path,
    *,
    batch: int,
    workers: int,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] = as_list,
) -> Any:
    """A shuffled epoch of ``d`` through a DataLoader of ``workers`` fork workers and
    batches of ``batch`` lists of samples, each library's own way:
    mosaicml      StreamingDataset(local=..., shuffle=True, batch_size=batch) in a torch
                  DataLoader (its py1e shuffle over shards and blocks)
    litdata       StreamingDataset(input_dir=..., shuffle=True) in litdata's
                  StreamingDataLoader (chunk order and within-chunk shuffle);
                  litdata-nodrop: the same with drop_last=False
    hf-datasets   load_from_disk (memory-mapped Arrow), DataLoader(shuffle=True): a map-style
                  dataset fetched a batch at a time (Dataset.__getitems__)
    """
    with quiet():
        return _loader(tool, d, cache, batch, workers, seed, collate_fn)


def _loader(
    tool: str,
    d: PeerData,
    cache: Path,
    batch: int,
    workers: int,
    seed: int,
    collate_fn: Callable[[list[Any]], Any],
) -> Any:
    data = require_module("torch.utils.data")
    torch = require_module("torch")
    common = _loader_kwargs(batch, workers, collate_fn)
    if tool == "mosaicml":
        clean_streaming()
        ds = import_streaming().StreamingDataset(
            local=str(d.path), shuffle=True, shuffle_seed=seed, batch_size=batch
        )
        return data.DataLoader(ds, **common)
    if tool in ("litdata", "litdata-nodrop"):
        ld = import_litdata()
        shutil.rmtree(cache, ignore_errors=True)
        # drop_last: its default (None) is True in a distributed setting, where it drops
        # each worker's last partial batch; "litdata-nodrop" asks for every sample.
        drop = {"drop_last": False} if tool == "litdata-nodrop" else {}
        ds = ld.StreamingDataset(input_dir=str(d.path), cache_dir=str(cache), shuffle=True,
                                 seed=seed, **drop)  # fmt: skip
        return ld.StreamingDataLoader(ds, **common)
    if tool == "hf-datasets":
        ds = import_datasets().load_from_disk(str(d.path))
        return data.DataLoader(
            ds, shuffle=True, generator=torch.Generator().manual_seed(seed), **common
        )
    raise ValueError(tool)


def remote_loader(
    tool: str,
    url: str,
    cache: Path,
    *,
    cache_limit: int,
    endpoint: str,
    batch: int,
    workers: int,
    seed: int = 0,
    shuffle_block: int | None = None,
    collate_fn: Callable[[list[Any]], Any] = as_list,
) -> Any:
    """A shuffled epoch of the peer's copy at ``url`` (an ``s3://`` prefix) through its
    own cache in ``cache`` (fresh), holding at most ``cache_limit`` bytes, each library's
    documented way, with a DataLoader of ``workers`` fork workers and batches of
    ``batch`` lists of samples:
    mosaicml  StreamingDataset(remote=url, local=cache, cache_limit, shuffle=True,
              batch_size, shuffle_block_size=shuffle_block) in a torch DataLoader; boto3,
              the endpoint from ``S3_ENDPOINT_URL`` (its documented variable), which the
              caller sets. Its default block (262,144 samples) spans every shard of
              these shapes: under a cache of a quarter of the shards nearly every batch
              misses and shards are fetched again and again (an epoch of 40,000 x 3 KB
              in 40 shards did not end in 12 minutes), so give it blocks that fit
    litdata   StreamingDataset(url, cache_dir=cache, max_cache_size=cache_limit,
              shuffle=True, storage_options={"endpoint_url": endpoint}) in its
              StreamingDataLoader, boto3 for index.json and the chunks. (litdata 0.2.76
              fetches chunks with obstore where obstore is installed, as it is in the
              benchmark venv for fastload; its obstore stores cannot reach an http://
              endpoint (no allow_http), so it is told obstore is absent: the boto3 path
              it takes where obstore is not installed.) Set in this process, so run it
              in a process of its own (test_bench_remote.py: benchmarks/_remote_peer.py)
    """
    with quiet():
        return _remote_loader(tool, url, cache, cache_limit, endpoint, batch, workers, seed,
                              shuffle_block, collate_fn)  # fmt: skip


def _remote_loader(
    tool: str,
    url: str,
    cache: Path,
    cache_limit: int,
    endpoint: str,
    batch: int,
    workers: int,
    seed: int,
    shuffle_block: int | None,
    collate_fn: Callable[[list[Any]], Any],
) -> Any:
    data = require_module("torch.utils.data")
    require_module("boto3")
    common = _loader_kwargs(batch, workers, collate_fn)
    if tool == "mosaicml":
        clean_streaming()
        ds = import_streaming().StreamingDataset(
            remote=url, local=str(cache), cache_limit=cache_limit, shuffle=True,
            shuffle_seed=seed, batch_size=batch, shuffle_block_size=shuffle_block,
        )  # fmt: skip
        return data.DataLoader(ds, **common)
    if tool == "litdata":
        ld = import_litdata()
        from litdata.streaming import downloader

        downloader._OBSTORE_AVAILABLE = False  # read in each (forked) worker
        shutil.rmtree(cache, ignore_errors=True)
        ds = ld.StreamingDataset(
            url, cache_dir=str(cache), max_cache_size=cache_limit, shuffle=True, seed=seed,
            storage_options={"endpoint_url": endpoint},
        )  # fmt: skip
        return ld.StreamingDataLoader(ds, **common)
    raise ValueError(tool)


def drain_keys(batches: Iterator[list[dict[str, Any]]]) -> tuple[list[str], int]:
    """(keys, payload bytes) of every sample of an epoch of lists of samples."""
    keys: list[str] = []
    total = 0
    for b in batches:
        for s in b:
            keys.append(s["__key__"])
            total += sum(len(v) for k, v in s.items() if not k.startswith("__"))
    return keys, total
