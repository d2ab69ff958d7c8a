"""Which positions of an epoch's order each reader reads: pure functions on integers.

An epoch of ``n`` samples has positions ``0 .. n-1`` in its order (see :mod:`.shuffle`).
Readers ("consumers") are the ``world_size * num_workers`` DataLoader workers of all
ranks (``num_workers`` is 1 when a rank reads in its main process), numbered rank-major:
consumer ``c = rank * num_workers + worker_id``. Samples are cut into units: 1 sample, or
``unit`` samples when the dataset yields batches of ``unit``.

**A fresh epoch** (:func:`assign`): every consumer reads exactly ``s`` positions, a
contiguous range: consumer ``c`` reads ``c*s .. (c+1)*s - 1``, where
``s = share(n, consumers, drop_last, unit)``:

- ``drop_last``: ``s = (n // (consumers * unit)) * unit``, whole units only; the last
  ``n - s * consumers`` positions of the order (fewer than one unit per consumer: fewer
  than ``consumers`` samples when ``unit`` is 1) are dropped.
- otherwise: ``s = ceil(n / consumers)`` and the order is padded to ``s * consumers``
  positions by repeating it from its start, as ``DistributedSampler`` does (a position
  ``p >= n`` stands for sample ``p % n``; fewer than ``consumers`` positions are
  repeats). With ``unit > 1`` each consumer's last unit is short by the same amount.

So every consumer reads the same number of samples and of units (batches), no position
goes to two consumers, and together they read the whole epoch but the dropped remainder
(or the whole epoch and the padding). A rank reads ``num_workers * s`` positions: how many
depends on its worker count (by less than one unit per worker).

**A resumed epoch** (:func:`reassign`) shares the positions left unread. With
``whole_world`` (the states of every rank, e.g. for another world size) the ranks get
equal shares of them by the same rule with ``consumers = world_size`` (dropping fewer
than one unit per rank, or repeating fewer than ``world_size`` positions); otherwise
(one rank's own state, e.g. for another worker count) the rank keeps exactly what it
left. Either way a rank's share is cut among its workers into contiguous runs of whole
units differing by at most one unit (only the rank's last unit may be short): nothing
is dropped or repeated among workers, at the price of worker counts that may differ by
one unit when the remainder does not divide.

Ranges are half-open ``(start, stop)`` pairs and a reader's positions are a list of them
(:data:`Intervals`): a fresh epoch gives each reader one range; a resumed one may give
several.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "Intervals",
    "assign",
    "drop_first",
    "length",
    "normalize",
    "reassign",
    "share",
    "slice_intervals",
    "split",
]

Intervals = list[tuple[int, int]]


def _check(world_size: int, rank: int, num_workers: int, worker_id: int, unit: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"worker {worker_id} is not one of {num_workers} workers")
    if unit < 1:
        raise ValueError(f"unit must be positive, not {unit}")


def share(n: int, consumers: int, drop_last: bool, unit: int = 1) -> int:
    """Positions each of ``consumers`` readers gets of a pool of ``n``: with
    ``drop_last`` as many whole units of ``unit`` as every reader can have,
    ``(n // (consumers * unit)) * unit``; else ``ceil(n / consumers)`` (the pool padded
    by repeating positions). 0 for an empty pool."""
    if n < 0 or consumers < 1 or unit < 1:
        raise ValueError(f"no share of {n} samples among {consumers} readers in units of {unit}")
    if drop_last:
        return n // (consumers * unit) * unit
    return -(-n // consumers)


def length(intervals: Iterable[tuple[int, int]]) -> int:
    """The number of positions in ``intervals``."""
    return sum(b - a for a, b in intervals)


def normalize(intervals: Iterable[tuple[int, int]]) -> Intervals:
    """The union of ``intervals``, sorted, overlapping and touching ranges merged, empty
    ones removed."""
    out: Intervals = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def slice_intervals(intervals: Sequence[tuple[int, int]], start: int, stop: int) -> Intervals:
    """Positions ``start .. stop-1`` of the sequence that ``intervals`` list (counting
    from 0 at the first position of the first range)."""
    out: Intervals = []
    at = 0
    for a, b in intervals:
        n = b - a
        lo, hi = max(start, at), min(stop, at + n)
        if lo < hi:
            out.append((a + lo - at, a + hi - at))
        at += n
        if at >= stop:
            break
    return out


def drop_first(intervals: Sequence[tuple[int, int]], k: int) -> Intervals:
    """``intervals`` without their first ``k`` positions."""
    return slice_intervals(intervals, k, length(intervals))


def split(intervals: Sequence[tuple[int, int]], parts: int, unit: int = 1) -> list[Intervals]:
    """``intervals`` cut into ``parts`` contiguous pieces of whole units of ``unit``
    positions (the last unit may be short), as equal as possible: piece sizes differ by
    at most one unit."""
    if parts < 1 or unit < 1:
        raise ValueError(f"cannot split into {parts} parts of units of {unit}")
    total = length(intervals)
    units = -(-total // unit)
    bounds = [min(total, (i * units // parts) * unit) for i in range(parts + 1)]
    return [slice_intervals(intervals, bounds[i], bounds[i + 1]) for i in range(parts)]


def assign(
    n: int,
    *,
    world_size: int = 1,
    rank: int = 0,
    num_workers: int = 1,
    worker_id: int = 0,
    drop_last: bool = False,
    unit: int = 1,
) -> Intervals:
    """The positions one reader (worker ``worker_id`` of rank ``rank``) reads in a fresh
    epoch of ``n`` samples: every one of the ``world_size * num_workers`` readers reads
    the same number (:func:`share`), a contiguous range, rank-major."""
    _check(world_size, rank, num_workers, worker_id, unit)
    consumers = world_size * num_workers
    s = share(n, consumers, drop_last, unit)
    c = rank * num_workers + worker_id
    return [(c * s, (c + 1) * s)] if s else []


def _pad(intervals: Intervals, size: int) -> Intervals:
    """``intervals`` followed by their own positions again, from the start (as many
    times as needed), to ``size`` positions."""
    have = length(intervals)
    if have == 0 or size <= have:
        return slice_intervals(intervals, 0, size)
    out = list(intervals)
    while have < size:
        more = slice_intervals(intervals, 0, size - have)
        out += more
        have += length(more)
    return out


def reassign(
    remaining: Iterable[tuple[int, int]],
    *,
    world_size: int = 1,
    rank: int = 0,
    num_workers: int = 1,
    worker_id: int = 0,
    drop_last: bool = False,
    unit: int = 1,
    whole_world: bool = True,
) -> Intervals:
    """The positions one reader reads when an interrupted epoch resumes with the
    positions ``remaining`` left unread (in any order, overlaps merged).

    ``whole_world``: ``remaining`` is what every rank left; the ranks get equal shares of
    it (:func:`share` with ``world_size`` readers: with ``drop_last`` fewer than one unit
    per rank is dropped, else fewer than ``world_size`` positions are repeated).
    Otherwise ``remaining`` is what this rank left and it keeps all of it. The rank's
    share is then cut among its ``num_workers`` workers into contiguous runs of whole
    units differing by at most one unit: nothing dropped or repeated among them.
    """
    _check(world_size, rank, num_workers, worker_id, unit)
    left = normalize(remaining)
    if whole_world:
        s = share(length(left), world_size, drop_last, unit)
        left = slice_intervals(_pad(left, s * world_size), rank * s, (rank + 1) * s)
    return split(left, num_workers, unit)[worker_id]
