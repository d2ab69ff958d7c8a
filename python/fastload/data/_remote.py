"""The datasets over object-store shards: where the cache is, and reading a batch with
each shard it touches pinned in the node-local cache (downloaded on a miss), or with one
ranged GET per sample (``fetch="range"``).

Pins follow one rule: a reader holds at most one pin, and never while it waits for
another (it lets go of the shard it holds first). The shard last read stays pinned until
the reader moves on (most batches of a stream fall in one shard), also while the reader
is idle, unless another reader of the node waits for room: then a thread of the idle
reader's process gives the pin back (:mod:`fastload.cache._holders`), so a dataset that
is not reading (a validation set beside a training set) never keeps room others need.
``k`` workers of an iterable dataset still check that the cache holds the ``k`` largest
shards (:meth:`RemoteReader.check_room`: each may be reading one at once). A shard let go
of may be evicted; the native index drops its mapping and descriptor of that shard
(``forget_shard``), so none keeps an evicted shard's bytes: the index is opened once per
reader and process, never reopened (no checksum of its tables per shard change).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._util import human, parse_size
from ..cache import Pin, RemoteShards, ShardCache, _holders
from ..env import current
from ..index import ShardIndex
from ..sources.objstore import StorageOptions
from . import _probe

__all__ = ["FETCH", "RemoteReader", "default_cache_dir", "open_remote"]

FETCH = ("shard", "range")


def default_cache_dir() -> Path:
    """The environment's node-local ``tmpdir``, folder ``cache``."""
    return Path(current().tmpdir) / "cache"


def open_remote(
    source: str | Sequence[str],
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: int | str | None,
    storage_options: StorageOptions | None,
    owner: str = "a dataset",
) -> RemoteReader:
    """The reader of ``source`` through the cache; ``owner`` (the dataset's class name)
    names it to readers that wait for room it holds."""
    limit = None if cache_limit is None else parse_size(cache_limit)
    what = source if isinstance(source, str) else f"{source[0]} and {len(source) - 1} more"
    cache = ShardCache(cache_dir if cache_dir is not None else default_cache_dir(), limit,
                       f"{owner} over {what}")
    shards = RemoteShards(source, cache, storage_options)
    index = shards.index()
    shards.check_one_fits()
    return RemoteReader(shards, index)


class RemoteReader:
    """An index over remote shards and the pins its reads need, in one process (made
    again after fork or unpickling: pins and native state stay in their process)."""

    def __init__(self, shards: RemoteShards, index: ShardIndex) -> None:
        self.shards = shards
        self.path = index.path
        self._first = np.array([s.first_sample for s in index.shards], dtype=np.int64)
        self._index: ShardIndex | None = index
        self._pid = os.getpid()
        self._held: tuple[int, Pin] | None = None
        self._lock = threading.Lock()
        #: Times this reader opened the index (once per process that reads).
        self.opens = 1

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_index=None, _held=None, _pid=-1, _lock=None, opens=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _here(self) -> threading.Lock:
        """This reader's lock in this process: in a process forked since (a DataLoader
        worker) its state is made again first, so that the lock a read holds is the one
        the give-back thread tries (a lock replaced under a read let that thread give the
        read's pin back: its shard was evicted mid-read, FileNotFoundError)."""
        if self._pid != os.getpid():
            # The parent's pin stays the parent's (cache.store leaves its lock there).
            self._index, self._held, self.opens = None, None, 0
            self._pid = os.getpid()
            self._lock = threading.Lock()
        assert self._lock is not None
        return self._lock

    def get(self) -> ShardIndex:
        """The index in this process (opened on first use in a process)."""
        self._here()
        if self._index is None:
            self._index = ShardIndex.open(self.path, check=False)
            self.opens += 1
        return self._index

    def check_room(self, readers: int, prefetch: int, shuffle_block: int) -> None:
        """Raises ValueError if the cache limit cannot hold what ``readers`` readers
        (DataLoader workers) pin at once: each keeps one shard pinned, so the cache must
        hold the ``readers`` largest shards (with less, a reader would wait for ever on
        a worker the DataLoader does not ask for anything until it is done). Prefetching
        and the shuffle block need no more room."""
        limit = self.shards.cache.limit
        need = self.shards.min_limit(readers)
        if limit is not None and limit < need:
            raise ValueError(
                f"cache_limit {human(limit)} ({limit} bytes) cannot hold the {readers} "
                f"largest shards that {readers} DataLoader workers keep pinned at once: "
                f"for num_workers={readers} the minimum cache_limit is {human(need)} "
                f"({need} bytes), whatever prefetch ({prefetch}) and shuffle_block "
                f"({shuffle_block}); raise cache_limit or use fewer workers"
            )

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.searchsorted(self._first, ids, side="right") - 1
        return out

    def release(self) -> None:
        """Lets go of the shard held."""
        if self._lock is not None:
            with self._here():
                self._let_go()

    def give_back(self) -> None:
        """Lets go of the shard held unless a read is in progress (called by the
        give-back thread while another reader waits for room)."""
        lock = self._lock
        if lock is None or not lock.acquire(blocking=False):
            return  # reading: the pin is in use
        try:
            if self._pid == os.getpid():
                self._let_go()
        finally:
            lock.release()

    def _let_go(self) -> None:
        """Lets go of the shard held, and of the index's mapping of it. Lock held."""
        if self._held is None:
            return
        shard, pin = self._held
        self._held = None
        _holders.busy(self.shards.cache.root, self)
        # Without a limit nothing is evicted: the mapping may stay.
        if self._index is not None and self.shards.cache.limit is not None:
            self._index._native.forget_shard(shard)
        pin.release()

    def _pin(self, shard: int) -> None:
        if self._held is not None and self._held[0] == shard:
            return
        self._let_go()
        # (timed as the stage "fetch" while a monitor is on: a download, or a wait for one)
        self._held = (shard, _probe.timed(_probe.FETCH, self.shards.pinned_one)(shard))
        _holders.idle(self.shards.cache.root, self)  # given back only outside a read

    def read(self, ids: Sequence[int], fetch: Callable[[ShardIndex, list[int]], Any]
             ) -> list[Any]:
        """``fetch(index, ids)`` per shard the ids fall in, each with its shard pinned;
        the results (lists) put back in the order of ``ids``."""
        if not len(ids):
            return []
        arr = np.asarray(ids, dtype=np.int64)
        with self._here():
            index = self.get()
            n = len(index)
            bad = np.flatnonzero((arr < -n) | (arr >= n))
            if len(bad):  # as the native fetch says it, before any shard is fetched
                i = int(arr[bad[0]])
                raise IndexError(f"sample index {i} out of range for {n} samples")
            shards = self.shard_of(np.where(arr < 0, arr + n, arr))
            if (shards == shards[0]).all():
                self._pin(int(shards[0]))
                out: list[Any] = fetch(index, arr.tolist())
                return out
            result: list[Any] = [None] * len(arr)
            held = -1 if self._held is None else self._held[0]
            # The shard held first (no wait), then the others in the order met.
            order = list(dict.fromkeys(shards.tolist()))
            if held in order:
                order.remove(held)
                order.insert(0, held)
            for s in order:
                where = np.flatnonzero(shards == s)
                self._pin(int(s))
                got = fetch(index, arr[where].tolist())
                for k, v in zip(where.tolist(), got, strict=True):
                    result[k] = v
            return result

    def read_one_shard(self, ids: Sequence[int], fetch: Callable[[ShardIndex, list[int]], Any]
                       ) -> Any:
        """``fetch(index, ids)`` with the one shard the ids fall in pinned; None when
        they span several shards."""
        arr = np.asarray(ids, dtype=np.int64)
        with self._here():
            shards = self.shard_of(arr)
            if not len(arr) or not (shards == shards[0]).all():
                return None
            self._pin(int(shards[0]))
            return fetch(self.get(), arr.tolist())

    def read_ranges(self, ids: Sequence[int], fields: Sequence[str] | None) -> list[Any]:
        """The samples at ``ids`` as dicts of bytes, each read with one ranged GET of
        its members' span (no cache), several in flight."""
        from concurrent.futures import ThreadPoolExecutor

        index = self.get()
        native = index._native
        want = None if fields is None else list(fields)

        def one(i: int) -> dict[str, Any]:
            key, shard, members = native.sample(i)
            if want is not None:
                have = {f for f, _, _ in members}
                for f in want:
                    if f not in have:
                        raise KeyError(f"sample '{key}' has no field '{f}'")
                members = [m for m in members if m[0] in want]
            d: dict[str, Any] = {"__key__": key}
            if not members:
                return d
            lo = min(o for _, o, _ in members)
            hi = max(o + s for _, o, s in members)
            data = self.shards.read_range(shard, lo, hi)
            for f, o, s in members:
                d[f] = bytes(data[o - lo:o - lo + s])
            return d

        n = len(index)
        idx = [i + n if i < 0 else i for i in ids]
        for i, j in zip(ids, idx, strict=True):
            if not 0 <= j < n:
                raise IndexError(f"sample index {i} out of range for {n} samples")
        if len(idx) == 1:
            return [one(idx[0])]
        with ThreadPoolExecutor(min(16, len(idx)), thread_name_prefix="fastload-range") as pool:
            return list(pool.map(one, idx))
