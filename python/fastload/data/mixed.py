"""Mix: several shard sets read as one ShardIterableDataset, each by weight.

The epoch's positions come from :class:`~fastload.data.mix.MixPlan` (which stream and
which of its samples each position reads); everything ShardIterableDataset does with
positions (the exact rank x worker split, ``drop_last``/padding, batches, ``len()``,
resume with the same or another worker count or world size) is inherited unchanged.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np
from torch.utils.data import get_worker_info

from .._util import human
from ..cache import is_remote
from ..env.world import World, world
from ..index import ShardIndex
from ..sources.objstore import StorageOptions
from . import _probe, partition
from ._fetch import LocalIndex, check_fields, fetch, index_of
from ._options import check_options
from ._prefetch import Prefetcher
from ._reading import CHUNK, batch_of, packed_fetch, rechunk, samples_of
from ._remote import RemoteReader, open_remote
from ._tally import SharedCounts
from .iterable import BatchBy, ShardIterableDataset, _find_states, _Run
from .mix import MixPlan, Stream, stream_name
from .mix import takes as mix_takes
from .shuffle import DEFAULT_BLOCK

__all__ = ["Mix", "Stream"]

BATCHING = ("mixed", "per_stream")


@dataclasses.dataclass
class _Part:
    """A stream as this process reads it."""

    name: str
    local: LocalIndex | None
    remote: RemoteReader | None
    counts: np.ndarray  # samples per shard

    def index(self) -> ShardIndex:
        if self.remote is not None:
            return self.remote.get()
        assert self.local is not None
        return self.local.get()


class Mix(ShardIterableDataset):
    """Several shard sets (:class:`Stream`) read as one stream of samples, each by its
    weight: a :class:`~fastload.ShardIterableDataset` whose epoch interleaves them.

    **The epoch.** Each stream gives an epoch a fixed number of samples (its *take*):
    ``choose``, ``floor(repeat x its samples)``, or with ``proportion`` its share of
    ``samples_per_epoch`` (default: the streams' samples together), rounded so the takes
    add up exactly. ``len(ds)``, the split among ranks and workers, ``drop_last`` and
    padding, ``batch_size``, ``batch_by`` and resume are those of ShardIterableDataset
    over the epoch's positions. Each stream is shuffled on its own from ``(seed, epoch)``
    and its name; a stream taking fewer samples than it has reads the next ones the
    next epoch; one taking more reads its order again.

    **Proportions, at every scale.** ``batching="mixed"`` (default): the streams are
    interleaved by a deterministic smooth weighted round-robin (the same for every seed,
    epoch, rank and worker): in every window of ``W`` consecutive samples of the epoch
    (so in every batch of a fresh epoch) each stream's count is within 1 of its weight x
    ``W`` for two streams, for equal weights and for weights like 0.7/0.2/0.1; for three
    or more unequal weights no interleaving can promise 1 for every weight, and it is
    within 2 (every prefix within 1). See :mod:`fastload.data.mix`.
    ``batching="per_stream"`` (needs ``batch_size``, not ``batch_by``): each batch holds
    ``batch_size`` samples of one stream, and the batches are interleaved by the same
    round-robin over each stream's whole batches (takes cut down to whole batches);
    positions, ``len()`` and states then count batches.

    **Which stream.** Every sample has ``"__stream__"``: its stream's name (packed
    batches keep it in ``batch.meta``). ``stats()`` gives the samples read per stream by
    this reader (in the main process with workers: nothing; pass the loader's
    ``state_dict()`` to sum its workers', or every rank's states for the world's).
    After a resume a reader's counts include what it (a worker restored in place), or
    the same rank number (a state loaded into the dataset: given to worker 0), had read
    of the epoch before.

    **Resume.** As ShardIterableDataset; the state also holds the mix (stream names,
    sizes, takes) and the samples read per stream. Loaded into a mix with other weights
    or more streams, the interrupted epoch finishes on its saved plan and the new mix
    applies from the next epoch; a stream of the state missing (or of another size), or
    another ``batching``, is a ValueError saying so.

    **Remote streams** are read through the node cache as ShardIterableDataset reads
    them: a reader pins one shard at a time across all its streams, so ``cache_limit``
    must hold the ``k`` largest shards of the remote streams together for ``k`` readers
    (a ValueError naming that minimum otherwise); each remote stream downloads this
    reader's next ``prefetch`` shards of it ahead.
    """

    def __init__(
        self,
        streams: Sequence[Stream],
        *,
        samples_per_epoch: int | None = None,
        batching: str = "mixed",
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
                 collate_fn=collate_fn)  # fmt: skip
        check_options(o)
        if not streams or not all(isinstance(s, Stream) for s in streams):
            raise ValueError("streams must be a non-empty list of fastload.Stream")
        if batching not in BATCHING:
            raise ValueError(f"batching must be 'mixed' or 'per_stream', not {batching!r}")
        if batching == "per_stream" and (batch_size is None or batch_by is not None):
            raise ValueError("batching='per_stream' needs batch_size (and no batch_by)")
        if samples_per_epoch is not None and (
            isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, int)
            or samples_per_epoch < 0
        ):
            raise ValueError(f"samples_per_epoch must be a non-negative integer, not "
                             f"{samples_per_epoch!r}")  # fmt: skip
        names = [stream_name(s, i) for i, s in enumerate(streams)]
        if len(set(names)) != len(names):
            raise ValueError(f"stream names must differ: {names} (give each a name=)")
        self._parts: list[_Part] = []
        for s, name in zip(streams, names, strict=True):
            remote = None
            if is_remote(s.source):
                assert isinstance(s.source, (str, list, tuple))
                remote = open_remote(s.source, cache_dir, cache_limit, storage_options)
                index = remote.get()
            else:
                index = index_of(s.source)
            self.fields = check_fields(index, fields)
            counts = np.array([sh.samples for sh in index.shards], dtype=np.int64)
            local = None if remote is not None else LocalIndex(index)
            self._parts.append(_Part(name, local, remote, counts))
        sizes = [int(p.counts.sum()) for p in self._parts]
        per_epoch = mix_takes(
            sizes, proportion=[s.proportion for s in streams],
            choose=[s.choose for s in streams], repeat=[s.repeat for s in streams],
            samples_per_epoch=samples_per_epoch,
        )
        for p, size, t in zip(self._parts, sizes, per_epoch, strict=True):
            if t and not size:
                raise ValueError(f"stream {p.name!r} has no samples but an epoch takes {t}")
        self.batching = batching
        self.batch_size = batch_size
        self._takes = dict(zip(names, per_epoch, strict=True))
        self._sizes = dict(zip(names, sizes, strict=True))
        self._n = sum(self._positions(self._takes).values())
        self._override: tuple[int, dict[str, int]] | None = None
        self._plans: dict[tuple[int, tuple[int, ...]], MixPlan] = {}
        self._carried = np.zeros(len(names), dtype=np.int64)
        self._carry_to = 0  # the worker whose counts include the carried ones
        self._tally: tuple[Any, int, np.ndarray] | None = None
        self._shared = SharedCounts(len(names))  # the workers' counts, for stats() here
        self._remote = None  # streams hold their own
        self.prefetch = prefetch
        self._ahead: dict[int, Prefetcher] = {}
        if num_workers is not None:
            self._check_room(max(1, num_workers))
        self.shuffle, self.seed, self.shuffle_block = bool(shuffle), o["seed"], o["shuffle_block"]
        self.drop_last, self.transform, self.batch_by = bool(drop_last), transform, batch_by
        self.collate_fn, self.copy, self.access = collate_fn, copy, access
        self.num_workers = num_workers
        self._epoch = 0
        self._resume: dict[str, Any] | None = None
        self._run: _Run | None = None
        self._world = world(os.environ)
        self.plan()  # the interleaving made once here, inherited by forked workers

    # --- the plan -----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The streams' names, in order."""
        return [p.name for p in self._parts]

    @property
    def takes(self) -> dict[str, int]:
        """Samples each stream gives an epoch (whole batches with ``per_stream``)."""
        return {k: v * self._per for k, v in self._positions(self._takes).items()}

    @property
    def _per(self) -> int:
        """Samples per position: ``batch_size`` with per-stream batches, else 1."""
        return self.batch_size if self.batching == "per_stream" and self.batch_size else 1

    def _positions(self, per_epoch: dict[str, int]) -> dict[str, int]:
        return {k: v // self._per for k, v in per_epoch.items()}

    @property
    def _unit(self) -> int:
        if self.batching == "per_stream":
            return 1
        return self.batch_size if self.batch_size is not None and self.batch_by is None else 1

    def plan(self, epoch: int | None = None) -> MixPlan:
        """The plan of epoch ``epoch`` (default: the next one read)."""
        e = self._epoch if epoch is None else epoch
        per_epoch = self._takes
        if self._override is not None and self._override[0] == e:
            per_epoch = self._override[1]
        pos = self._positions(per_epoch)
        counts = tuple(pos.get(n, 0) for n in self.names)
        key = (e, counts)
        if key not in self._plans:
            self._plans.clear()
            self._plans[key] = MixPlan(
                [p.counts for p in self._parts], self.names, counts, seed=self.seed, epoch=e,
                shuffle=self.shuffle, block=self.shuffle_block, unit=self._per,
            )
        return self._plans[key]

    def layout(self, world_size: int, num_workers: int) -> list[list[dict[str, int]]]:
        """Samples per stream of each worker of each rank in a fresh epoch (the next
        one): ``[rank][worker] -> {name: samples}`` (``num_workers=0``: one reader per
        rank)."""
        plan = self.plan()
        out = []
        for rank in range(world_size):
            row = []
            for worker in range(max(1, num_workers)):
                got = partition.assign(
                    self._n, world_size=world_size, rank=rank, num_workers=max(1, num_workers),
                    worker_id=worker, drop_last=self.drop_last, unit=self._unit,
                )
                row.append(dict(zip(self.names, plan.counts(got).tolist(), strict=True)))
            out.append(row)
        return out

    def __len__(self) -> int:
        if self.batching != "per_stream":
            return super().__len__()
        w = self._reader()
        readers = 1
        if get_worker_info() is None and self.num_workers:
            readers = self.num_workers
            w = dataclasses.replace(w, num_workers=readers, worker_id=0)
        return readers * partition.length(self._fresh(w))

    # --- reading ------------------------------------------------------------------------

    @property
    def index(self) -> ShardIndex:
        """The first stream's index (see ``stream_index`` for the others)."""
        return self._parts[0].index()

    def stream_index(self, name: str) -> ShardIndex:
        """The index of the stream ``name``."""
        return self._parts[self.names.index(name)].index()

    def _read_fn(self) -> Callable[[np.ndarray], list[Any]]:
        """Reads mix-wide sample ids: each stream's from its index, ``__stream__`` set.

        Per call: the ids sorted (which groups them by stream: ids are stream offsets
        plus the stream's sample; with remote streams grouped by stream only), one native
        fetch per stream, the samples put back in the ids' order by one ``itemgetter``."""
        plan = self.plan()
        offsets = plan.offsets
        fields, copy, access = self.fields, self.copy, self.access
        parts = self._parts
        names = [p.name for p in parts]
        all_local = all(p.remote is None for p in parts)

        def one(s: int, local: list[int]) -> list[Any]:
            got: list[Any] = self._fetch(parts[s], local, lambda ix, p: fetch(
                ix, p, fields, copy, access))  # fmt: skip
            name = names[s]
            for sample in got:
                sample["__stream__"] = name
            return got

        def read(ids: np.ndarray) -> list[Any]:
            if len(ids) < 2:
                if not len(ids):
                    return []
                s = int(np.searchsorted(offsets, ids[0], side="right")) - 1
                return one(s, [int(ids[0] - offsets[s])])
            if all_local:
                # Sorted, the ids fall into the streams' ranges in stream order, each
                # stream's ascending: a fetch so walks each shard forwards (cheaper than
                # the shuffled order: fewer cache and TLB misses).
                order = np.argsort(ids)
                ranked = ids[order]
                bounds = np.searchsorted(ranked, offsets).tolist()
            else:  # remote streams are read in the plan's order (their prefetchers follow it)
                which = np.searchsorted(offsets, ids, side="right") - 1
                order = np.argsort(which, kind="stable")
                ranked = ids[order]
                bounds = [0, *np.cumsum(np.bincount(which, minlength=len(parts))).tolist()]
            got: list[Any] = []
            for s in range(len(parts)):
                lo, hi = bounds[s], bounds[s + 1]
                if hi > lo:
                    got += one(s, (ranked[lo:hi] - offsets[s]).tolist())
            back = np.argsort(order).tolist()  # where each id's sample is in got
            return list(operator.itemgetter(*back)(got))

        return read

    def _fetch(self, part: _Part, local: list[int],
               fn: Callable[[ShardIndex, list[int]], Any]) -> Any:  # fmt: skip
        if part.remote is None:
            return fn(part.index(), local)
        self._let_go(part)
        if local:
            ahead = self._ahead.get(self._parts.index(part))
            if ahead is not None:
                ahead.reading(int(part.remote.shard_of(np.asarray(local[-1:]))[0]))
        return part.remote.read(local, fn)

    def _let_go(self, part: _Part) -> None:
        """Lets go of the pins of the other streams: one pin per reader at a time."""
        for other in self._parts:
            if other is not part and other.remote is not None:
                other.remote.release()

    def _check_room(self, readers: int) -> None:
        """ValueError unless the cache holds the ``readers`` largest shards of the
        remote streams together (what ``readers`` readers pin at once)."""
        remotes = [p.remote for p in self._parts if p.remote is not None]
        if not remotes:
            return
        limit = remotes[0].shards.cache.limit
        sizes = sorted((e.size for r in remotes for e in r.shards.entries), reverse=True)
        need = sum(sizes[: max(1, readers)])
        if limit is not None and limit < need:
            raise ValueError(
                f"cache_limit {human(limit)} ({limit} bytes) cannot hold the {readers} "
                f"largest shards of the mix's remote streams that {readers} DataLoader "
                f"workers keep pinned at once: for num_workers={readers} the minimum "
                f"cache_limit is {human(need)} ({need} bytes); raise cache_limit or use "
                "fewer workers"
            )

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        self._check_room(1 if info is None else int(info.num_workers))
        it = super().__iter__()
        return it if info is None else self._published(it, int(info.id))

    def _published(self, it: Iterator[Any], worker: int) -> Iterator[Any]:
        """A worker's items, its counts shown to the process that made the mix (every
        tenth of a second, and at the end)."""
        run, last = self._run, 0.0
        try:
            for item in it:
                if time.monotonic() - last >= 0.1:
                    self._shared.publish(worker, run.epoch if run else 0, self._read_counts())
                    last = time.monotonic()
                yield item
        finally:
            self._shared.publish(worker, run.epoch if run else 0, self._read_counts())

    def _prefetchers(self, run: _Run, plan: MixPlan) -> dict[int, Prefetcher]:
        """Per remote stream, a prefetcher of this reader's shards of it, in the order
        it reads them."""
        remote = [s for s, p in enumerate(self._parts) if p.remote is not None]
        if not remote or not self.prefetch:
            return {}
        orders: dict[int, dict[int, None]] = {s: {} for s in remote}
        for ids in plan.take(run.positions, 1 << 16):
            which = np.searchsorted(plan.offsets, ids, side="right") - 1
            for s in remote:
                part = self._parts[s]
                assert part.remote is not None
                local = ids[which == s] - plan.offsets[s]
                orders[s].update(dict.fromkeys(part.remote.shard_of(local).tolist()))
        out = {}
        for s in remote:
            r = self._parts[s].remote
            assert r is not None
            out[s] = Prefetcher(r.shards, list(orders[s]), self.prefetch)
        return out

    def _generate(self, run: _Run) -> Iterator[Any]:
        if self._run is run:
            self._resume = None
            self._epoch = run.epoch + 1
        plan = self.plan(run.epoch)
        self._tally = (run, 0, np.zeros(len(self._parts), dtype=np.int64))
        read = _probe.timed(_probe.READ, self._read_fn())
        transform = _probe.timed(_probe.TRANSFORM, self.transform)
        collate = _probe.timed(_probe.COLLATE, self.collate_fn)
        self._ahead = self._prefetchers(run, plan)
        whole = False  # every shard of the plan read (not closed early, no error)
        try:
            if self.batching == "per_stream":
                yield from self._per_stream(run, plan, read)
                whole = True
                return
            unit = self._unit
            chunks = rechunk(plan.take(run.positions, 1 << 12), unit if unit > 1 else CHUNK)
            if self.batch_size is None:
                yield from samples_of(run, chunks, read, transform)
            elif self.batch_by is None:
                for ids in chunks:
                    yield batch_of(run, ids, read, transform, collate)
            else:
                yield from self._sized_batches(run, chunks, read)
            whole = True
        finally:
            for ahead in self._ahead.values():
                ahead.stop(settle=whole)
            self._ahead = {}
            for p in self._parts:
                if p.remote is not None:
                    p.remote.release()

    def _per_stream(self, run: _Run, plan: MixPlan,
                    read: Callable[[np.ndarray], list[Any]]) -> Iterator[Any]:  # fmt: skip
        """One batch per position, all of one stream: packed straight from the stream's
        index where the collate_fn allows it."""
        transform = _probe.timed(_probe.TRANSFORM, self.transform)
        collate = _probe.timed(_probe.COLLATE, self.collate_fn)
        packed = None
        if transform is None:
            packed = _probe.timed(_probe.READ, packed_fetch(self.collate_fn, self.fields,
                                                            self.access))
        for ids in plan.take(run.positions, 1):
            if packed is not None:
                s = int(np.searchsorted(plan.offsets, ids[:1], side="right")[0]) - 1
                local = (ids - plan.offsets[s]).tolist()
                part = self._parts[s]
                if part.remote is None:
                    out = packed(part.index(), local)
                else:
                    self._let_go(part)
                    ahead = self._ahead.get(s)
                    if ahead is not None:
                        ahead.reading(int(part.remote.shard_of(ids[-1:] - plan.offsets[s])[0]))
                    out = part.remote.read_one_shard(local, packed)
                if out is None:  # the batch spans shards of a remote stream
                    assert self.collate_fn is not None
                    out = self.collate_fn(read(ids))
                else:
                    out.meta["__stream__"] = [part.name] * len(local)
            else:
                out = batch_of(run, ids, read, transform, collate)
                run.done -= len(ids)
            run.done += 1
            yield out

    # --- counts and states --------------------------------------------------------------

    def _read_counts(self) -> np.ndarray:
        """Samples per stream this reader read of its epoch (carried over a resume
        included)."""
        run = self._run
        if run is None or self._tally is None or self._tally[0] is not run:
            return self._carried.copy()
        carried = self._carried if run.world.worker_id == self._carry_to else self._carried * 0
        _, done, counts = self._tally
        if run.done > done:
            plan = self.plan(run.epoch)
            got = partition.slice_intervals(run.positions, done, run.done)
            counts = counts + plan.counts(got)
            self._tally = (run, run.done, counts)
        return counts + carried

    def stats(self, state: Any = None) -> dict[str, Any]:
        """Samples read per stream this epoch: this reader's (``{"epoch", "streams"}``),
        or with ``state`` (a loader's state, or the states of every rank) per rank and in
        all (``{"epoch", "streams", "ranks": {rank: {name: samples}}}``)."""
        if state is None:
            run = self._run
            epoch = run.epoch if run is not None else self._epoch
            got = self._read_counts()
            workers = self._shared.latest() if run is None else None
            if workers is not None:  # read by DataLoader workers, not here
                epoch, got = workers
            return {"epoch": epoch, "streams": dict(zip(self.names, got.tolist(), strict=True))}
        found = list(_find_states(state))
        if not found:
            raise ValueError("no Mix state found in what was given to stats()")
        ranks: dict[int, dict[str, int]] = {}
        total: dict[str, int] = {}
        for s in found:
            row = ranks.setdefault(int(s["rank"]), {})
            for name, n in s.get("stream_counts", {}).items():
                row[name] = row.get(name, 0) + int(n)
                total[name] = total.get(name, 0) + int(n)
        return {"epoch": int(found[0]["epoch"]), "streams": total, "ranks": ranks}

    def _state(self, epoch: int, w: World, remaining: partition.Intervals) -> dict[str, Any]:
        st = super()._state(epoch, w, remaining)
        per_epoch = self._takes
        if self._override is not None and self._override[0] == epoch:
            per_epoch = self._override[1]
        st["mix"] = [[n, self._sizes.get(n, 0), int(t)] for n, t in per_epoch.items() if t]
        st["samples"] = sum(self._positions(per_epoch).values())  # the epoch's positions
        st["batching"] = [self.batching, self._per]
        counts = self._read_counts() if self._run is not None else self._carried
        st["stream_counts"] = dict(zip(self.names, counts.tolist(), strict=True))
        return st

    def load_state_dict(self, state: Any) -> None:
        """As :meth:`ShardIterableDataset.load_state_dict`; a state of another mix
        finishes its epoch on its own plan (see the class)."""
        states = list(_find_states(state))
        if not states:
            raise ValueError("no ShardIterableDataset state found in what was loaded")
        if any("mix" not in s for s in states):
            raise ValueError("the state is that of a ShardIterableDataset, not of a Mix")
        saved = states[0]["mix"]
        if any(s["mix"] != saved for s in states):
            raise ValueError("the states loaded together are of different mixes")
        if states[0]["batching"] != [self.batching, self._per]:
            raise ValueError(
                f"the state was saved with batching {states[0]['batching']} but this mix has "
                f"{[self.batching, self._per]}: its positions would name other batches"
            )
        mine = [[n, self._sizes[n], t] for n, t in self._takes.items() if t]
        override = None
        if saved != mine:
            for name, size, _ in saved:
                if self._sizes.get(name) != size:
                    have = "no such stream" if name not in self._sizes else (
                        f"{self._sizes[name]} samples")
                    raise ValueError(
                        f"the state's stream {name!r} of {size} samples is not in this mix "
                        f"({have}): its interrupted epoch cannot be finished; load it into a "
                        "Mix with the state's streams, or start the next epoch without it"
                    )
            override = (int(states[0]["epoch"]), {n: int(t) for n, _, t in saved})
        n_saved = sum(self._positions({n: t for n, _, t in saved}).values())
        fixed = [{**s, "samples": self._n} for s in states if s["samples"] == n_saved]
        if len(fixed) != len(states):
            raise ValueError("the state's sample count does not match its mix")
        carried = np.zeros(len(self._parts), dtype=np.int64)
        rank = self._reader().rank
        for s in states:  # this rank's old counts (given to its worker 0)
            if int(s["rank"]) == rank:
                for name, n in s.get("stream_counts", {}).items():
                    if name in self._sizes:
                        carried[self.names.index(name)] += int(n)
        super().load_state_dict(fixed)
        self._override = override if self._resume is not None else None
        self._carried = carried if self._resume is not None else carried * 0
        own = self._resume is not None and self._resume["scope"] == "consumer"
        self._carry_to = int(self._resume["worker_id"]) if own else 0  # type: ignore[index]
        self._tally = None

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self._resume is None:
            self._carried = self._carried * 0

    # --- pickling -----------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_plans"] = {}
        state["_tally"] = None
        state["_ahead"] = {}
        return state

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {t}" for n, t in self.takes.items())
        return (
            f"Mix({{{parts}}}, batching={self.batching!r}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last}, batch_size={self.batch_size}, "
            f"num_workers={self.num_workers}, epoch={self._epoch})"
        )
