"""Which positions of an epoch's order each reader reads: pure functions on integers.

An epoch of ``n`` samples has positions ``0 .. n-1`` in its order (see :mod:`.shuffle`).
Readers ("consumers") are ``world_size`` ranks, each reading through ``num_workers``
DataLoader workers (1 when it reads in its main process).

- Ranks: every rank gets exactly ``share`` positions, a contiguous range: rank ``r``
  reads ``r*share .. (r+1)*share - 1``. With ``drop_last`` the ``n % world_size``
  positions at the end of the order are dropped (``share = n // world_size``); without
  it the order is padded to ``share * world_size`` positions by repeating it from its
  start, as ``DistributedSampler`` does (a position ``p >= n`` stands for ``p % n``).
- Workers: a rank's positions are cut into units (1 sample, or ``unit`` samples when the
  dataset yields batches) and each worker gets a contiguous run of whole units, the runs
  differing by at most one unit. The rank's total is the same for any worker count, so a
  rank's epoch length does not depend on ``num_workers``.

Ranges are half-open ``(start, stop)`` pairs and a reader's positions are a list of them
(:data:`Intervals`): a fresh epoch gives each reader one range; a resumed one (see
:func:`reassign`) may give several.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "Intervals",
    "assign",
    "drop_first",
    "length",
    "normalize",
    "rank_share",
    "reassign",
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


def rank_share(n: int, world_size: int, drop_last: bool) -> int:
    """Positions each rank reads in an epoch of ``n``: ``n // world_size`` with
    ``drop_last``, else ``ceil(n / world_size)`` (0 for an empty epoch)."""
    if n < 0 or world_size < 1:
        raise ValueError(f"no share of {n} samples among {world_size} ranks")
    if n == 0:
        return 0
    return n // world_size if drop_last else -(-n // world_size)


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
    """The positions one reader reads in a fresh epoch of ``n`` samples."""
    _check(world_size, rank, num_workers, worker_id, unit)
    share = rank_share(n, world_size, drop_last)
    mine = [(rank * share, (rank + 1) * share)] if share else []
    return split(mine, num_workers, unit)[worker_id]


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

    ``whole_world``: ``remaining`` is what every rank left; it is shared among
    ``world_size`` ranks as a fresh epoch is (equal shares; what does not divide is
    dropped with ``drop_last``, else padded by repeating positions). Otherwise
    ``remaining`` is what this rank left, and only its workers share it: nothing is
    dropped or repeated.
    """
    _check(world_size, rank, num_workers, worker_id, unit)
    left = normalize(remaining)
    if whole_world:
        share = rank_share(length(left), world_size, drop_last)
        left = slice_intervals(_pad(left, share * world_size), rank * share, (rank + 1) * share)
    return split(left, num_workers, unit)[worker_id]
