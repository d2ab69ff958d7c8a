"""The pure functions behind ShardIterableDataset: an epoch's order (shard permutation and
block shuffle) and its partition among ranks and workers, fresh and resumed.

Property tests (hypothesis; ``HYPOTHESIS_PROFILE=ci|dev|thorough`` picks the example
count): for random shard sizes, world sizes 1-8 and 0-4 DataLoader workers (0: the rank
reads in its main process, one reader), and batch units 1-5, every one of the
``world_size x workers`` readers gets exactly the same number of samples and of batches
(only with padding is the last batch short, identically for all), no position goes to
two readers, and together they cover the epoch but a dropped remainder of less than one
unit per reader (or the epoch and a padding of fewer than one sample per reader,
repeating its first samples); the order is a permutation, a pure function of (seed,
epoch), and resuming an interrupted epoch with another layout reads exactly what was
left (another worker count) or equal rank shares of it (another world size).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.data import partition
from fastload.data.partition import Intervals
from fastload.data.shuffle import EpochOrder, epoch_order, permutation

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile("thorough", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=12)
layout_st = st.tuples(st.integers(1, 8), st.integers(0, 4))  # world size, DataLoader workers


def positions(iv: Intervals) -> list[int]:
    return [p for a, b in iv for p in range(a, b)]


def readers(world_size: int, workers: int) -> list[tuple[int, int, int]]:
    """(rank, worker, workers of the rank): 0 DataLoader workers read in the main
    process, which is one reader per rank."""
    nw = max(workers, 1)
    return [(r, w, nw) for r in range(world_size) for w in range(nw)]


# --- the order of an epoch -----------------------------------------------------------------


@given(counts=counts_st, seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 1000),
       block=st.integers(1, 64), shuffle=st.booleans())
def test_order_is_a_deterministic_permutation(
    counts: list[int], seed: int, epoch: int, block: int, shuffle: bool
) -> None:
    n = sum(counts)
    order = epoch_order(counts, seed=seed, epoch=epoch, block=block, shuffle=shuffle)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(n))
    again = epoch_order(list(counts), seed=seed, epoch=epoch, block=block, shuffle=shuffle)
    assert np.array_equal(order, again)
    if not shuffle:
        assert order.tolist() == list(range(n))


@given(counts=counts_st, seed=st.integers(0, 1000), block=st.integers(1, 64))
def test_order_is_a_block_shuffle_of_shuffled_shards(
    counts: list[int], seed: int, block: int
) -> None:
    eo = EpochOrder(counts, seed=seed, epoch=3, block=block)
    order = eo.ids(0, eo.n)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    # Before the block shuffle: the shards, permuted, each in its stored order.
    seq = [first[s] + i for s in eo.shards for i in range(counts[s])]
    assert sorted(eo.shards.tolist()) == list(range(len(counts)))
    assert eo.sequence(0, eo.n).tolist() == seq
    # The block shuffle moves samples only within their block.
    for lo in range(0, eo.n, block):
        assert sorted(order[lo : lo + block].tolist()) == sorted(seq[lo : lo + block])
    if block == 1:
        assert order.tolist() == seq


@given(counts=counts_st, seed=st.integers(0, 1000), block=st.integers(1, 16),
       cuts=st.lists(st.integers(0, 200), max_size=6), chunk=st.integers(1, 50))
def test_any_range_alone(
    counts: list[int], seed: int, block: int, cuts: list[int], chunk: int
) -> None:
    """Any positions are computed without the rest of the epoch, with the same result;
    positions past the end wrap around (the padding of an epoch)."""
    order = epoch_order(counts, seed=seed, epoch=1, block=block)
    n = len(order)
    eo = EpochOrder(counts, seed=seed, epoch=1, block=block)
    bounds = sorted(cuts)
    iv = [(a, b) for a, b in zip(bounds[::2], bounds[1::2], strict=False) if b > a]
    if n == 0:
        iv = []
    got = [x for piece in eo.take(iv, chunk) for x in piece.tolist()]
    assert got == [int(order[p % n]) for p in positions(iv)]
    assert all(len(piece) <= chunk for piece in eo.take(iv, chunk))


def test_order_is_pinned() -> None:
    """Bit-for-bit the same order on every machine and numpy version: a change here
    reshuffles every saved run's data and invalidates saved resume states."""
    order = epoch_order([5, 3, 0, 4], seed=7, epoch=2, block=4).tolist()
    assert order == PINNED
    assert permutation(6, 1, 2, 3).tolist() == PINNED_PERMUTATION


# Since resume-state version 2: fastload's one permutation (cpp/common/permutation.hpp);
# version 1's orders came from numpy's PCG64 (README, "Streaming epochs").
PINNED = [7, 5, 6, 0, 4, 2, 1, 3, 8, 9, 10, 11]
PINNED_PERMUTATION = [4, 5, 2, 1, 0, 3]


def test_epochs_and_seeds_differ() -> None:
    counts = [100] * 10
    a = epoch_order(counts, seed=0, epoch=0, block=1000)
    assert not np.array_equal(a, epoch_order(counts, seed=0, epoch=1, block=1000))
    assert not np.array_equal(a, epoch_order(counts, seed=1, epoch=0, block=1000))
    # A block of 1,000 mixes about ten shards into any 100 consecutive samples.
    window = a[:100] // 100
    assert len(set(window.tolist())) >= 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": -1}, "seed"),
        ({"epoch": -1}, "epoch"),
        ({"block": 0}, "shuffle block"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_order_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EpochOrder([1, 2], **kwargs)  # type: ignore[arg-type]


# --- partition of a fresh epoch ------------------------------------------------------------


def check_partition(n: int, world_size: int, workers: int, drop_last: bool, unit: int) -> None:
    nr = len(readers(world_size, workers))
    s = partition.share(n, nr, drop_last, unit)
    seen: collections.Counter[int] = collections.Counter()
    got: list[Intervals] = []
    for rank, worker, nw in readers(world_size, workers):
        iv = partition.assign(n, world_size=world_size, rank=rank, num_workers=nw,
                              worker_id=worker, drop_last=drop_last, unit=unit)
        assert len(iv) <= 1  # one contiguous run: sequential reads
        seen.update(positions(iv))
        got.append(iv)
    # Exact and balanced: every reader of every rank the same number of samples, hence
    # the same number of units (batches) with the same sizes; full units with drop_last.
    assert [partition.length(iv) for iv in got] == [s] * nr
    if drop_last:
        assert s % unit == 0
        # As many whole units as every reader can have: less than a unit each dropped.
        assert s * nr <= n < (s + unit) * nr
    else:
        assert s == -(-n // nr)
        # Padding: fewer than one sample per reader, only when n does not divide.
        assert 0 <= s * nr - n < nr
    # Disjoint and covering: positions 0 .. s*readers-1, each read once, rank-major.
    assert seen == collections.Counter(range(s * nr))
    assert got == [[(c * s, (c + 1) * s)] if s else [] for c in range(nr)]


@given(counts=counts_st, layout=layout_st, drop_last=st.booleans(), unit=st.integers(1, 5))
def test_fresh_partition(
    counts: list[int], layout: tuple[int, int], drop_last: bool, unit: int
) -> None:
    check_partition(sum(counts), *layout, drop_last, unit)


@given(counts=counts_st, layout=layout_st, drop_last=st.booleans(), seed=st.integers(0, 99),
       block=st.integers(1, 16), unit=st.integers(1, 5))
def test_fresh_partition_samples(
    counts: list[int], layout: tuple[int, int], drop_last: bool, seed: int, block: int,
    unit: int,
) -> None:
    """The samples read: each at most once with drop_last (less than one unit per reader
    left out, the end of the order), else each at least once, the repeats being the
    first samples of the order (fewer than one per reader)."""
    world_size, workers = layout
    nr = len(readers(world_size, workers))
    n = sum(counts)
    order = epoch_order(counts, seed=seed, epoch=0, block=block)
    read: collections.Counter[int] = collections.Counter()
    per_reader = []
    for rank, worker, nw in readers(world_size, workers):
        iv = partition.assign(n, world_size=world_size, rank=rank, num_workers=nw,
                              worker_id=worker, drop_last=drop_last, unit=unit)
        ids = [int(order[p % n]) for p in positions(iv)]
        per_reader.append(len(ids))
        read.update(ids)
    assert len(set(per_reader)) <= 1
    if drop_last:
        assert max(read.values(), default=1) == 1
        kept = per_reader[0] * nr if per_reader else 0
        assert set(read) == {int(i) for i in order[:kept]}
        assert n - len(read) < nr * unit
        if unit == 1:
            assert n - len(read) == n % nr
    else:
        assert set(read) == set(range(n))
        extra = sum(read.values()) - n
        assert extra == (-n) % nr
        twice = collections.Counter(int(order[p % n]) for p in range(n, n + extra))
        assert read == collections.Counter(range(n)) + twice


def test_fewer_shards_than_readers() -> None:
    """Two shards, 8 ranks x 4 workers: samples, not shards, are shared."""
    n = 3 + 70
    for drop_last in (True, False):
        for unit in (1, 2, 4):
            check_partition(n, 8, 4, drop_last, unit)
    assert partition.share(n, 32, True) == 2  # 9 of 73 dropped
    assert partition.share(n, 32, False) == 3  # 23 read twice
    assert partition.share(n, 32, True, unit=4) == 0  # not one whole batch each
    assert partition.share(n, 32, False, unit=4) == 3  # one short batch each
    assert partition.share(0, 8, False) == 0
    # Fewer samples than readers: padded, each reader one sample.
    got = [partition.assign(5, world_size=2, rank=r, num_workers=4, worker_id=w)
           for r in range(2) for w in range(4)]
    assert got == [[(c, c + 1)] for c in range(8)]  # positions 5..7 are samples 0..2
    assert all(partition.assign(5, world_size=2, rank=r, num_workers=4, worker_id=w,
                                drop_last=True) == [] for r in range(2) for w in range(4))


def test_examples() -> None:
    """The rule on small numbers: 10 samples, 2 ranks x 2 workers."""
    def run(**kw: object) -> list[Intervals]:
        return [partition.assign(10, world_size=2, rank=r, num_workers=2, worker_id=w,
                                 **kw)  # type: ignore[arg-type]
                for r in range(2) for w in range(2)]

    assert run() == [[(0, 3)], [(3, 6)], [(6, 9)], [(9, 12)]]  # 10, 11: samples 0, 1 again
    assert run(drop_last=True) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]  # 8, 9 dropped
    # Batches of 2: two full ones each with drop_last (8 read); else 3 samples each.
    assert run(drop_last=True, unit=2) == run(drop_last=True)
    assert run(unit=2) == run()
    # One rank reading in its main process: one reader, the rank's whole share.
    assert partition.assign(10, world_size=2, rank=1) == [(5, 10)]
    assert partition.assign(10, world_size=3, rank=2, drop_last=True) == [(6, 9)]


def test_rank_total_follows_workers() -> None:
    """A rank reads num_workers equal shares, contiguous: its total depends on its
    worker count by less than one unit per worker."""
    n = 1001
    for workers in (1, 2, 3, 4, 7):
        for drop_last in (False, True):
            s = partition.share(n, 3 * workers, drop_last, 8)
            got = []
            for w in range(workers):
                got += positions(partition.assign(n, world_size=3, rank=1, num_workers=workers,
                                                  worker_id=w, unit=8, drop_last=drop_last))
            assert got == list(range(workers * s, 2 * workers * s))
            assert abs(workers * s - n / 3) < 8 * workers


def test_interval_helpers() -> None:
    iv = [(0, 3), (10, 12), (5, 6)]
    assert partition.length(iv) == 6
    assert partition.normalize([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert partition.slice_intervals(iv, 2, 5) == [(2, 3), (10, 12)]
    assert partition.drop_first(iv, 4) == [(11, 12), (5, 6)]
    assert partition.split(iv, 4) == [[(0, 1)], [(1, 3)], [(10, 11)], [(11, 12), (5, 6)]]
    assert partition.split(iv, 2, unit=4) == [[(0, 3), (10, 11)], [(11, 12), (5, 6)]]
    assert partition.split([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="rank 2"):
        partition.assign(10, world_size=2, rank=2)
    with pytest.raises(ValueError, match="worker 1"):
        partition.assign(10, num_workers=1, worker_id=1)


# --- resuming an interrupted epoch ---------------------------------------------------------


@st.composite
def interruptions(draw: st.DrawFn) -> tuple[int, int, int, bool, int, list[int]]:
    n = draw(st.integers(0, 300))
    world_size, workers = draw(layout_st)
    drop_last = draw(st.booleans())
    unit = draw(st.integers(1, 4))
    nr = len(readers(world_size, workers))
    done = draw(st.lists(st.integers(0, 100), min_size=nr, max_size=nr))
    return n, world_size, workers, drop_last, unit, done


def interrupted(
    n: int, world_size: int, workers: int, drop_last: bool, unit: int, done: Sequence[int]
) -> tuple[list[int], dict[int, Intervals]]:
    """The positions read and, per rank, those left when each reader stopped after
    ``done`` positions (whole units)."""
    read: list[int] = []
    left: dict[int, Intervals] = collections.defaultdict(list)
    for (rank, worker, nw), k in zip(readers(world_size, workers), done, strict=True):
        iv = partition.assign(n, world_size=world_size, rank=rank, num_workers=nw,
                              worker_id=worker, drop_last=drop_last, unit=unit)
        k = min(k * unit, partition.length(iv))
        read += positions(partition.slice_intervals(iv, 0, k))
        left[rank] += partition.drop_first(iv, k)
    return read, left


@given(case=interruptions(), new_workers=st.integers(0, 4), new_unit=st.integers(1, 4))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_resume_rank_with_other_workers(
    case: tuple[int, int, int, bool, int, list[int]], new_workers: int, new_unit: int
) -> None:
    """One rank's state, resumed by the same rank with any number of workers: exactly
    what it left, each position once, the workers' counts within one unit (whole units
    but the rank's last)."""
    n, world_size, workers, drop_last, unit, done = case
    read, left = interrupted(n, world_size, workers, drop_last, unit, done)
    total: list[int] = list(read)
    nw = max(new_workers, 1)
    for rank in range(world_size):
        again = []
        sizes = []
        for w in range(nw):
            iv = partition.reassign(left[rank], world_size=world_size, rank=rank, num_workers=nw,
                                    worker_id=w, drop_last=drop_last, unit=new_unit,
                                    whole_world=False)
            again += positions(iv)
            sizes.append(partition.length(iv))
        assert sorted(again) == positions(partition.normalize(left[rank]))
        assert max(sizes) - min(sizes) <= new_unit
        full = [sz for sz in sizes if sz]
        assert all(sz % new_unit == 0 for sz in full[:-1])
        total += again
    s = partition.share(n, len(readers(world_size, workers)), drop_last, unit)
    assert sorted(total) == list(range(s * len(readers(world_size, workers))))


@given(case=interruptions(), new_layout=layout_st, new_unit=st.integers(1, 4))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_resume_world_with_other_size(
    case: tuple[int, int, int, bool, int, list[int]], new_layout: tuple[int, int],
    new_unit: int,
) -> None:
    """Every rank's state, resumed by a world of another size: ranks get equal shares of
    what was left; with drop_last less than one unit per rank is dropped, else fewer
    than the new world size are read twice; workers within one unit."""
    n, world_size, workers, drop_last, unit, done = case
    read, left = interrupted(n, world_size, workers, drop_last, unit, done)
    remaining = partition.normalize(iv for r in left.values() for iv in r)
    new_size, new_workers = new_layout
    per_rank = collections.Counter[int]()
    sizes: dict[int, list[int]] = collections.defaultdict(list)
    again: collections.Counter[int] = collections.Counter()
    for rank, worker, nw in readers(new_size, new_workers):
        iv = partition.reassign(remaining, world_size=new_size, rank=rank, num_workers=nw,
                                worker_id=worker, drop_last=drop_last, unit=new_unit)
        mine = positions(iv)
        per_rank[rank] += len(mine)
        sizes[rank].append(len(mine))
        again.update(mine)
    assert len(set(per_rank.values())) <= 1
    assert all(max(s) - min(s) <= new_unit for s in sizes.values())
    assert not set(again) & set(read)
    left_n = partition.length(remaining)
    assert set(again) <= set(positions(remaining))
    if drop_last:
        assert max(again.values(), default=1) == 1
        assert all(c % new_unit == 0 for c in per_rank.values())
        assert 0 <= left_n - len(again) < new_size * new_unit
    else:
        assert set(again) == set(positions(remaining))
        assert sum(again.values()) - left_n < new_size
    # The same world, every rank having left as much (lockstep): nothing dropped or
    # repeated when each rank's rest is whole units.
    rests = {partition.length(left[r]) for r in range(world_size)}
    if new_size == world_size and len(rests) == 1 and rests.pop() % new_unit == 0:
        assert again == collections.Counter(positions(remaining))
