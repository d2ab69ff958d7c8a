"""ShardIterableDataset: every DataLoader worker of every rank reads exactly the same
number of samples of a shuffled epoch of indexed tar shards, and an interrupted epoch
resumes where it stopped.

Over 500 lines on purpose: the module is one class (plus two small helpers), and a
fifth of it is the class's docstring, the user's reference. Its epoch plan, iteration and
resumable state all read and write the same few fields; split, one object would be spread
over several files. How an epoch's ids are read (chunks, packed batches, remote shards
with pins and prefetching) is in :mod:`fastload.data._reading`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Union

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from ..cache import is_remote
from ..env.world import World, world
from ..index import ShardIndex
from ..sources.objstore import StorageOptions
from . import _probe, partition
from ._fetch import LocalIndex, Source, check_fields, fetch, index_of
from ._options import check_options
from ._reading import CHUNK, batch_of, packed_fetch, rechunk, remote_epoch, samples_of
from ._remote import RemoteReader, open_remote
from .partition import Intervals
from .shuffle import DEFAULT_BLOCK, EpochOrder


class _NoGroup:
    """A torch.distributed stand-in that has no process group (see ``_reader``)."""

    @staticmethod
    def is_available() -> bool:
        return False


_NO_GROUP = _NoGroup()
__all__ = ["ShardIterableDataset"]

#: Marks a state dict as this dataset's (see ``state_dict``).
_FORMAT = "fastload.ShardIterableDataset"
#: 2: epoch orders are fastload's one permutation (data/shuffle.py), no longer numpy's
#: PCG64: a version-1 state's positions name other samples in today's order.
_VERSION = 2
#: What must agree between a state and the dataset loading it (the positions of a state
#: name the same samples only for the same data and the same order).
_ORDER_KEYS = ("samples", "seed", "shuffle", "shuffle_block")

BatchBy = Union[str, Callable[[Any], float]]


@dataclasses.dataclass
class _Run:
    """An epoch being read in this process: the positions this reader reads and how
    many of them it has yielded."""

    epoch: int
    world: World
    positions: Intervals
    done: int = 0


def _payload_bytes(sample: Mapping[str, Any]) -> int:
    return sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def _find_states(obj: Any) -> Iterator[dict[str, Any]]:
    """Every state of this dataset inside ``obj``: a state itself, or any nesting of
    dicts, lists and tuples holding states (a StatefulDataLoader's state, a list of the
    states of every rank)."""
    if isinstance(obj, Mapping):
        if obj.get("format") == _FORMAT:
            yield dict(obj)
            return
        for v in obj.values():
            yield from _find_states(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _find_states(v)


# Where torch is not installed mypy sees IterableDataset as Any; the ignore covers that.
class ShardIterableDataset(IterableDataset[Any]):  # type: ignore[misc, unused-ignore]
    """The samples of webdataset-style tar shards as a stream, every DataLoader worker of
    every rank reading exactly the same number of samples of each epoch.

    ``source``: a :class:`~fastload.ShardIndex`, the path of an index file, or shards (a
    list of paths, a glob, a directory; their index is built once and cached).

    **Partition.** Samples, not shards, are shared among the ``world_size x
    num_workers`` readers of an epoch: the DataLoader workers of every rank (ranks from
    ``torch.distributed``, else ``RANK``/``WORLD_SIZE``, else
    ``SLURM_PROCID``/``SLURM_NTASKS``: see :func:`fastload.env.world`), or the rank
    itself when it reads in its main process (``num_workers=0``: one reader per rank).
    Every reader reads exactly the same number of samples, a contiguous run of the
    epoch's order; no sample goes to two readers; together they read the epoch: with
    ``drop_last`` the last ``n % readers`` samples of the order are left out (see
    **Batches** for ``batch_size``), else the order is padded by repeating its first
    samples (fewer than ``readers`` repeats), as ``DistributedSampler`` does. This holds
    for any shard count, fewer shards than readers included (see
    :mod:`fastload.data.partition`). A rank therefore reads ``num_workers`` times a
    worker's share, which depends (by less than one sample per worker) on its worker
    count.

    **Order.** Per epoch, the shard order and then the sample order within blocks of
    ``shuffle_block`` consecutive samples are permuted from ``(seed, epoch)`` only (see
    :mod:`fastload.data.shuffle`): the same on every rank, in every start method, bit
    for bit. Each reader reads a contiguous stretch of the shuffled shards, so its reads
    stay within a few shards at a time; a larger ``shuffle_block`` mixes more shards into
    each batch. ``shuffle=False`` reads the stored order.

    **Epochs.** ``set_epoch(e)`` before each epoch, as with ``DistributedSampler``. In the
    main process (``num_workers=0``) and in persistent workers the epoch also counts up by
    itself at each new iteration; workers that are not persistent start from the epoch the
    main process's dataset holds, so call ``set_epoch`` there.

    **Values.** Samples are dicts: ``"__key__"`` and one entry per field (``fields``: only
    these; ``None``: every field of the sample), zero-copy read-only buffers as in
    :class:`~fastload.ShardIndexDataset` (bytes with ``copy=True``; bytes once they cross
    a worker boundary), then ``transform(sample)``. Reads are batched native fetches
    with the GIL released (``access="mmap"`` or ``"read"``, as for ShardIndexDataset).

    **Batches.** ``batch_size=B`` yields lists of ``B`` samples (``collate_fn(list)`` if
    given): use ``DataLoader(ds, batch_size=None)``, with a ``collate_fn`` that returns
    its argument unless the dataset's ``collate_fn`` already makes tensors (the
    DataLoader's default walks every value of every sample of a list). Every reader
    yields the same number of samples and of batches: with ``drop_last`` every batch is
    full (each reader reads ``n // (readers * B)`` batches; the fewer than ``readers *
    B`` samples at the end of the order are left out), else each reader reads
    ``ceil(n / readers)`` samples and its last batch is short by the same amount on
    every reader. With ``batch_by="bytes"`` a batch instead takes samples while their
    payload bytes stay within ``batch_size`` (a bigger sample makes a batch of its own);
    ``batch_by=f`` does the same with ``f(sample)`` (after ``transform``) as the size,
    e.g. a token count. Such batches are cut from each reader's (equal) samples, so
    their counts depend on the data and may differ between readers.

    **Length.** ``len(ds)``: the samples (or batches, with ``batch_size``) this reader
    yields in a fresh epoch. In a worker, the worker's. In the main process, the rank's
    when it reads in the main process; the main process cannot see the DataLoader's
    worker count, so pass it as ``num_workers=k`` (the DataLoader's ``num_workers``) to
    make ``len(ds)`` the rank's total through ``k`` workers (``k`` times a worker's) and
    ``len(DataLoader(ds, batch_size=None, num_workers=k))`` exact. With ``num_workers``
    given, reading with another number of workers (or in the main process when ``k >
    0``) is a ``ValueError`` rather than an epoch of another length. (With the
    DataLoader batching single samples, each worker's samples are batched apart, so the
    loader yields ``k * ceil(len(ds) / k / batch_size)`` batches where torch's
    ``len(loader)`` says ``ceil(len(ds) / batch_size)``: let the dataset make the
    batches for an exact count.) Not defined with ``batch_by``. A resumed epoch yields
    only what was left.

    **Resume.** ``state_dict()``/``load_state_dict()`` follow the protocol of
    ``torchdata.stateful_dataloader.StatefulDataLoader``.

    - Same world size and worker count: restoring the loader's state
      (``loader.load_state_dict``) resumes each worker at its next unread sample, in the
      order of an uninterrupted epoch: nothing repeated, nothing lost.
    - Another worker count (same world size; 0 included): load the loader's state into
      the dataset instead (``ds.load_state_dict(loader.state_dict())``) and build a new
      loader over it without loading state into the loader. The rank reads exactly the
      positions its old workers had left, nothing lost or repeated, cut among the new
      workers into contiguous runs of whole batches (samples without ``batch_size``)
      differing by at most one: in the resumed epoch the workers' counts are equal only
      when what is left divides among them (only the rank's last batch may be short).
    - Another world size: load the states of every rank (e.g. gathered with
      ``all_gather_object``) on each rank. The ranks get equal shares of what every rank
      left (with ``drop_last`` fewer than one sample, or batch, per rank is left out,
      else fewer than ``world_size`` samples are repeated), cut among each rank's workers
      as above. Loading every rank's state also works with the same world size.

    A state is plain ints and lists. The next epoch is again a fresh one.

    **Object storage.** ``source`` may name shards in a bucket (``"s3://bucket/train-
    {000000..000999}.tar"``, globs, a prefix ending in ``/``, a list of URLs), read
    through the node-local cache (``cache_dir``, ``cache_limit``, ``storage_options``: as
    for :class:`~fastload.ShardIndexDataset`). Each reader knows its shards in the order
    it will read them, and downloads the next ones ahead in background threads while
    the cache has room no reader needs (``prefetch`` shards at most; 0: none). Samples,
    order, split and resume are those of the same shards read locally.

    A reader keeps the shard it reads pinned (one at a time, until it moves on to the
    next), also while the DataLoader waits on another worker, so ``cache_limit`` must
    hold the ``k`` largest shards at once for ``k`` readers (``num_workers``, or 1 in
    the main process): a smaller limit is a ``ValueError`` naming that minimum when the
    dataset is made (with ``num_workers`` given) or the loader starts, before any shard
    is fetched. ``prefetch`` and ``shuffle_block`` add nothing to it (prefetching only
    takes room beyond that of the largest shard, and none while a reader waits for
    room; a block's shards are read one at a time). Readers of other processes sharing
    the cache folder need their room too. Pick ``shuffle_block`` so that a block's
    shards fit the cache: a block mixes ``shuffle_block / samples per shard``
    consecutive shards of the epoch's shard order, and a reader needs all of them in turn
    (the default block, 65,536 samples, spans 64 shards of 1,000; with a cache of fewer,
    shards are fetched again as the block's batches come back to them).
    """

    def __init__(
        self,
        source: Source,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_block: int = DEFAULT_BLOCK,
        drop_last: bool = False,
        fields: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        batch_size: int | None = None,
        batch_by: BatchBy | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        copy: bool = False,
        access: str = "mmap",
        num_workers: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: StorageOptions | None = None,
        prefetch: int = 2,
    ) -> None:
        o: dict[str, Any] = dict(
            access=access, prefetch=prefetch, num_workers=num_workers, seed=seed,
                 shuffle_block=shuffle_block, batch_size=batch_size, batch_by=batch_by,
                 collate_fn=collate_fn)
        check_options(o)
        seed, shuffle_block = o["seed"], o["shuffle_block"]
        self._remote: RemoteReader | None = None
        if is_remote(source):
            assert isinstance(source, (str, list, tuple))
            self._remote = open_remote(source, cache_dir, cache_limit, storage_options,
                                       "ShardIterableDataset")
            if num_workers is not None:
                self._remote.check_room(max(1, num_workers), prefetch, shuffle_block)
            index = self._remote.get()
        else:
            index = index_of(source)
        self.prefetch = prefetch
        self.fields: list[str] | None = check_fields(index, fields)
        self._index = LocalIndex(index)
        self._counts = np.array([s.samples for s in index.shards], dtype=np.int64)
        self._n = len(index)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.shuffle_block = shuffle_block
        self.drop_last = bool(drop_last)
        self.transform = transform
        self.batch_size = batch_size
        self.batch_by = batch_by
        self.collate_fn = collate_fn
        self.copy = copy
        self.access = access
        self.num_workers = num_workers
        self._epoch = 0
        self._resume: dict[str, Any] | None = None
        self._run: _Run | None = None
        self._world = world(os.environ)

    # --- who reads what -----------------------------------------------------------------

    @property
    def index(self) -> ShardIndex:
        """The index, (re)opened in this process on first use."""
        return self._index.get() if self._remote is None else self._remote.get()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (unless a loaded state resumes another)."""
        return self._epoch

    def _reader(self) -> World:
        """This reader: the rank as the main process sees it, the worker as the DataLoader
        says."""
        info = get_worker_info()
        if info is None:
            self._world = world(os.environ)
            return self._world
        main = self._world
        # A worker takes the rank the main process saw from its process group: a spawned
        # worker has none, and a forked one does not call into the group it inherited
        # (its threads did not come along; nothing in it may be used after fork).
        here = world(os.environ, info, dist=_NO_GROUP if main.source == "dist" else None)
        if main.source == "dist" or (here.source == "single" and main.source != "single"):
            here = dataclasses.replace(
                here, rank=main.rank, world_size=main.world_size,
                local_rank=main.local_rank, source=main.source,
            )
        return here

    @property
    def _unit(self) -> int:
        return self.batch_size if self.batch_size is not None and self.batch_by is None else 1

    def _fresh(self, w: World) -> Intervals:
        return partition.assign(
            self._n, world_size=w.world_size, rank=w.rank, num_workers=w.num_workers,
            worker_id=w.worker_id, drop_last=self.drop_last, unit=self._unit,
        )

    def _plan(self, w: World) -> tuple[int, Intervals]:
        """The epoch the next iteration reads and this reader's positions in it."""
        r = self._resume
        if r is None:
            return self._epoch, self._fresh(w)
        remaining = [(int(a), int(b)) for a, b in r["remaining"]]
        scope = r["scope"]
        here = f"rank {w.rank} of {w.world_size}, worker {w.worker_id} of {w.num_workers}"
        if scope == "consumer":
            there = (r["world_size"], r["rank"], r["num_workers"], r["worker_id"])
            if there != (w.world_size, w.rank, w.num_workers, w.worker_id):
                raise ValueError(
                    f"the loaded state is that of one DataLoader worker (rank {there[1]} of "
                    f"{there[0]}, worker {there[3]} of {there[2]}) and cannot resume {here}: "
                    "load the states of every worker (e.g. the whole StatefulDataLoader "
                    "state) to resume with another number of workers"
                )
            return r["epoch"], remaining
        if scope == "rank" and (r["world_size"], r["rank"]) != (w.world_size, w.rank):
            raise ValueError(
                f"the loaded state holds rank {r['rank']} of {r['world_size']} only and cannot "
                f"resume {here}: to change the world size, load the states of every rank"
            )
        return r["epoch"], partition.reassign(
            remaining, world_size=w.world_size, rank=w.rank, num_workers=w.num_workers,
            worker_id=w.worker_id, drop_last=self.drop_last, unit=self._unit,
            whole_world=scope == "world",
        )

    def set_epoch(self, epoch: int) -> None:
        """Reads epoch ``epoch`` next. A loaded state of another epoch is dropped."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, not {epoch!r}")
        self._epoch = epoch
        self._run = None
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None
        if get_worker_info() is None:
            self._world = world(os.environ)

    def _check_workers(self) -> None:
        """A dataset told its DataLoader's worker count is read by that many workers."""
        if self.num_workers is None:
            return
        info = get_worker_info()
        actual = 0 if info is None else int(info.num_workers)
        if actual != self.num_workers:
            where = "in the main process" if info is None else f"by {actual} DataLoader workers"
            raise ValueError(
                f"this ShardIterableDataset was made for num_workers={self.num_workers} "
                f"(len(ds) counts that many readers) but is read {where}: pass the "
                "DataLoader's num_workers, or num_workers=None"
            )

    def __len__(self) -> int:
        if self.batch_by is not None:
            raise TypeError("the number of batches made with batch_by depends on the data")
        w = self._reader()
        readers = 1
        if get_worker_info() is None and self.num_workers:
            # The rank's total through its workers: every worker reads the same.
            readers = self.num_workers
            w = dataclasses.replace(w, num_workers=readers, worker_id=0)
        samples = partition.length(self._fresh(w))
        per_reader = samples if self.batch_size is None else -(-samples // self.batch_size)
        return readers * per_reader

    # --- reading ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._check_workers()
        if self._remote is not None:  # before any shard is fetched, in every worker
            info = get_worker_info()
            readers = 1 if info is None else int(info.num_workers)
            self._remote.check_room(readers, self.prefetch, self.shuffle_block)
        w = self._reader()
        epoch, positions = self._plan(w)
        run = _Run(epoch, w, positions)
        self._run = run
        return self._generate(run)

    def _generate(self, run: _Run) -> Iterator[Any]:
        # The epoch counts as started once read from (StatefulDataLoader makes iterators
        # it never reads from when it restores a finished epoch).
        if self._run is run:
            self._resume = None
            self._epoch = run.epoch + 1
        order = EpochOrder(
            self._counts, seed=self.seed, epoch=run.epoch, shuffle=self.shuffle,
            block=self.shuffle_block,
        )
        fields, copy, access, transform = self.fields, self.copy, self.access, self.transform
        unit = self._unit
        chunks = rechunk(order.take(run.positions), unit if unit > 1 else CHUNK)
        remote = self._remote
        if remote is not None:
            yield from remote_epoch(self, run, remote, order)
            return
        index = self._index.get()

        def read(ids: np.ndarray) -> list[Any]:
            return fetch(index, ids.tolist(), fields, copy, access)

        # Timed stage by stage while a monitor is on (else the functions themselves).
        read = _probe.timed(_probe.READ, read)
        transform = _probe.timed(_probe.TRANSFORM, transform)
        if self.batch_size is None:
            yield from samples_of(run, chunks, read, transform)
        elif self.batch_by is None:
            collate = _probe.timed(_probe.COLLATE, self.collate_fn)
            packed = packed_fetch(self.collate_fn, fields, access) if transform is None else None
            packed = _probe.timed(_probe.READ, packed)
            if packed is not None:
                # fastload.collate over untransformed samples: read the batch straight
                # into its packed block, no dict or Payload per sample.
                for ids in chunks:
                    out = packed(index, ids.tolist())
                    run.done += len(out)
                    yield out
                return
            for ids in chunks:
                yield batch_of(run, ids, read, transform, collate)
        else:
            yield from self._sized_batches(run, chunks, read)

    def _sized_batches(
        self, run: _Run, chunks: Iterator[np.ndarray], read: Callable[[np.ndarray], list[Any]]
    ) -> Iterator[Any]:
        limit, by = self.batch_size, self.batch_by
        transform = _probe.timed(_probe.TRANSFORM, self.transform)
        collate = _probe.timed(_probe.COLLATE, self.collate_fn)
        assert limit is not None
        batch: list[Any] = []
        size = 0.0
        for ids in chunks:
            for s in read(ids):
                t = s if transform is None else transform(s)
                n = by(t) if callable(by) else _payload_bytes(s)
                if batch and size + n > limit:
                    run.done += len(batch)
                    yield batch if collate is None else collate(batch)
                    batch, size = [], 0.0
                batch.append(t)
                size += n
        if batch:
            run.done += len(batch)
            yield batch if collate is None else collate(batch)

    # --- resuming -----------------------------------------------------------------------

    def _state(self, epoch: int, w: World, remaining: Intervals) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "samples": self._n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block,
            "epoch": epoch,
            "scope": "consumer",
            "world_size": w.world_size,
            "rank": w.rank,
            "num_workers": w.num_workers,
            "worker_id": w.worker_id,
            "remaining": [[a, b] for a, b in remaining],
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this reader stands: its epoch and the positions of that epoch's order
        it has still to read (ints and lists only). Called by StatefulDataLoader in each
        worker after each batch; cheap."""
        run = self._run
        if run is not None:
            return self._state(run.epoch, run.world, partition.drop_first(run.positions, run.done))
        w = self._reader()
        epoch, positions = self._plan(w)
        return self._state(epoch, w, positions)

    def load_state_dict(self, state: Any) -> None:
        """Resumes from a state: one reader's (what StatefulDataLoader hands each worker),
        or any dict or list holding the states of every worker of one rank (a
        StatefulDataLoader's ``state_dict()``), or of every rank. The next iteration
        reads what those readers had not read of their epoch, shared among this
        dataset's readers; a state with nothing left starts the next epoch."""
        states = list(_find_states(state))
        if not states:
            raise ValueError("no ShardIterableDataset state found in what was loaded")
        for s in states:
            if s.get("version") != _VERSION:
                raise ValueError(
                    f"ShardIterableDataset state version {s.get('version')!r} is not "
                    f"supported (this version reads {_VERSION})"
                )
            for key in _ORDER_KEYS:
                mine = getattr(self, key) if key != "samples" else self._n
                if s[key] != mine:
                    raise ValueError(
                        f"the state was saved with {key}={s[key]!r} but this dataset has "
                        f"{key}={mine!r}: its positions would name other samples"
                    )
        first = states[0]
        for s in states[1:]:
            for key in ("epoch", "world_size"):
                if s[key] != first[key]:
                    raise ValueError(
                        f"the states loaded together disagree on {key} "
                        f"({first[key]!r} and {s[key]!r})"
                    )
        by_reader: dict[tuple[int, int], dict[str, Any]] = {}
        for s in states:
            reader = (int(s["rank"]), int(s["worker_id"]))
            if reader in by_reader and by_reader[reader] != s:
                raise ValueError(f"two different states for rank {reader[0]} worker {reader[1]}")
            by_reader[reader] = s
        epoch, size = int(first["epoch"]), int(first["world_size"])
        merged: dict[str, Any] = {"epoch": epoch, "world_size": size}
        if len(by_reader) == 1 and first["scope"] == "consumer" and first["num_workers"] > 1:
            # One worker's own state, as StatefulDataLoader restores it in that worker.
            merged.update(scope="consumer", rank=first["rank"], num_workers=first["num_workers"],
                          worker_id=first["worker_id"], remaining=first["remaining"])
        else:
            ranks: dict[int, list[dict[str, Any]]] = {}
            for (rank, _), s in sorted(by_reader.items()):
                ranks.setdefault(rank, []).append(s)
            for rank, got in ranks.items():
                workers = {int(s["num_workers"]) for s in got}
                if len(workers) != 1 or len(got) != workers.pop():
                    have = sorted(int(s["worker_id"]) for s in got)
                    raise ValueError(
                        f"the states of rank {rank} are incomplete (workers {have} of "
                        f"{got[0]['num_workers']}): load every worker's state"
                    )
            if len(ranks) == size:
                scope = "world"
            elif len(ranks) == 1:
                scope = "rank"
            else:
                missing = sorted(set(range(size)) - set(ranks))
                raise ValueError(f"the states of ranks {missing} of {size} are missing")
            remaining = partition.normalize(
                (int(a), int(b)) for s in by_reader.values() for a, b in s["remaining"]
            )
            if not remaining:
                self._resume, self._run = None, None
                self._epoch = epoch + 1
                return
            merged.update(scope=scope, rank=next(iter(ranks)), remaining=remaining)
        self._resume = merged
        self._run = None
        self._epoch = epoch

    # --- pickling -----------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        if get_worker_info() is None:
            self._world = world(os.environ)
        state = dict(self.__dict__)
        state["_run"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.setdefault("_remote", None)
        self.__dict__.setdefault("prefetch", 2)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"ShardIterableDataset({os.fspath(self._index.path)!r}, {self._n} samples, "
            f"shuffle={self.shuffle}, seed={self.seed}, shuffle_block={self.shuffle_block}, "
            f"drop_last={self.drop_last}, batch_size={self.batch_size}, "
            f"num_workers={self.num_workers}, epoch={self._epoch})"
        )
