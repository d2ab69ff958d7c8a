"""How ShardIterableDataset reads an epoch's sample ids: cut into chunks (a batch, or
:data:`CHUNK` samples), fetched packed where the ``collate_fn`` allows it, and over
remote shards: each read with its shard pinned in the cache, this reader's next shards
downloaded ahead meanwhile, after a check that the cache can hold what its readers pin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..index import ShardIndex
from . import _probe
from ._fetch import fetch
from ._prefetch import Prefetcher
from .collate import collate as _collate
from .collate import fetch_packed, finish

if TYPE_CHECKING:
    from ._remote import RemoteReader
    from .iterable import ShardIterableDataset, _Run
    from .shuffle import EpochOrder

__all__ = ["CHUNK", "packed_fetch", "rechunk", "remote_epoch"]

#: Samples fetched per native call when the dataset yields single samples.
CHUNK = 256


def rechunk(pieces: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The concatenation of ``pieces`` cut into arrays of ``size`` (the last shorter)."""
    buf: list[np.ndarray] = []
    have = 0
    for piece in pieces:
        p = piece
        while len(p):
            part = p[: size - have]
            buf.append(part)
            have += len(part)
            p = p[len(part) :]
            if have == size:
                yield buf[0] if len(buf) == 1 else np.concatenate(buf)
                buf, have = [], 0
    if have:
        yield np.concatenate(buf)


def packed_fetch(
    collate_fn: Callable[[list[Any]], Any] | None, fields: Sequence[str] | None, access: str
) -> Callable[[ShardIndex, list[int]], Any] | None:
    """A fetch that makes what ``collate_fn`` would make of a batch of untransformed
    samples, straight from the index (:func:`~fastload.data.collate.fetch_packed`), when
    ``collate_fn`` is ``fastload.collate`` or a ``functools.partial`` of it setting
    ``allow_missing``, ``stack`` or ``ints``; else ``None``."""
    options: dict[str, Any] = {}
    if isinstance(collate_fn, functools.partial) and collate_fn.func is _collate:
        if collate_fn.args or set(collate_fn.keywords) - {"allow_missing", "stack", "ints"}:
            return None
        options = dict(collate_fn.keywords)
    elif collate_fn is not _collate:
        return None
    allow_missing = bool(options.get("allow_missing", False))
    stack, ints = options.get("stack", ()), options.get("ints", ())

    def fetch_batch(index: ShardIndex, ids: list[int]) -> Any:
        batch = fetch_packed(index, ids, fields, access, allow_missing=allow_missing)
        return finish(batch, stack, ints)

    return fetch_batch


def samples_of(run: Any, chunks: Iterable[np.ndarray], read: Callable[[np.ndarray], list[Any]],
               transform: Callable[[Any], Any] | None) -> Iterator[Any]:  # fmt: skip
    """One sample at a time (``batch_size=None``), counted in ``run``."""
    for ids in chunks:
        for s in read(ids):
            run.done += 1
            yield s if transform is None else transform(s)


def batch_of(run: Any, ids: np.ndarray, read: Callable[[np.ndarray], list[Any]],
             transform: Callable[[Any], Any] | None, collate: Callable[[list[Any]], Any] | None
             ) -> Any:  # fmt: skip
    """The batch of samples ``ids``: read, transformed, collated, counted in ``run``."""
    batch = read(ids)
    if transform is not None:
        batch = [transform(s) for s in batch]
    run.done += len(batch)
    return batch if collate is None else collate(batch)


def remote_epoch(ds: ShardIterableDataset, run: _Run, remote: RemoteReader,
                 order: EpochOrder) -> Iterator[Any]:
    """The epoch ``run`` of ``ds`` over remote shards: as for local ones, each read with
    its shard pinned (one at a time, the last kept until the next), the next
    ``ds.prefetch`` shards of this reader downloaded ahead meanwhile where the cache has
    room no reader needs."""
    fields, copy, access, transform = ds.fields, ds.copy, ds.access, ds.transform
    unit = ds._unit
    ids_all = [ids for ids in order.take(run.positions)]
    flat = np.concatenate(ids_all) if ids_all else np.empty(0, dtype=np.int64)
    seq = remote.shard_of(flat)
    # This reader's shards in the order it reads them (first appearance).
    shard_order = list(dict.fromkeys(seq.tolist())) if len(seq) else []
    ahead = Prefetcher(remote.shards, shard_order, ds.prefetch)
    chunks = rechunk(iter(ids_all), unit if unit > 1 else CHUNK)

    def read(ids: np.ndarray) -> list[Any]:
        ahead.reading(int(remote.shard_of(ids[-1:])[0]))
        return remote.read(ids.tolist(), lambda ix, part: fetch(ix, part, fields, copy,
                                                                access))

    # Timed stage by stage while a monitor is on (else the functions themselves).
    read = _probe.timed(_probe.READ, read)
    transform = _probe.timed(_probe.TRANSFORM, transform)

    whole = False  # every shard of the order read (not closed early, no error)
    try:
        if ds.batch_size is None:
            yield from samples_of(run, chunks, read, transform)
        elif ds.batch_by is None:
            collate = _probe.timed(_probe.COLLATE, ds.collate_fn)
            packed = packed_fetch(ds.collate_fn, fields, access) if transform is None else None
            read_one = _probe.timed(_probe.READ, remote.read_one_shard)
            for ids in chunks:
                if packed is not None:
                    ahead.reading(int(remote.shard_of(ids[-1:])[0]))
                    out = read_one(ids.tolist(), packed)
                    if out is None:  # the batch spans shards: pack what was read
                        assert collate is not None
                        out = collate(read(ids))
                    run.done += len(out)
                    yield out
                    continue
                yield batch_of(run, ids, read, transform, collate)
        else:
            yield from ds._sized_batches(run, chunks, read)
        whole = True
    finally:
        ahead.stop(settle=whole)
        remote.release()
