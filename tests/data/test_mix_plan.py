"""The epoch plan of a mix as pure functions (fastload.data.mix): the round-robin's
proportions in every window and prefix, the takes of proportion/choose/repeat, and a
plan's ids (each stream's own order, positions past the epoch, per-stream batches)."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from fastload.data.mix import MixPlan, interleave, takes
from fastload.data.shuffle import EpochOrder


def worst(seq: np.ndarray, counts: list[int], *, windows: bool) -> float:
    """The largest |count - weight x length| of any stream over every prefix, or
    (``windows``) every window of the cyclic sequence."""
    n, k = len(seq), len(counts)
    w = np.asarray(counts) / n
    twice = np.concatenate([seq, seq])
    cum = np.zeros((2 * n + 1, k))
    for s in range(k):
        cum[1:, s] = np.cumsum(twice == s)
    if not windows:
        return float(np.abs(cum[: n + 1] - np.arange(n + 1)[:, None] * w).max())
    return max(float(np.abs(cum[m : n + m] - cum[:n] - m * w).max()) for m in range(1, n + 1))


@pytest.mark.parametrize("counts", [[7, 2, 1], [70, 20, 10], [1, 1, 1], [50, 50, 50],
                                    [3, 1], [13, 8], [5, 3, 2]])  # fmt: skip
def test_every_window_within_one(counts: list[int]) -> None:
    seq = interleave(counts)
    assert collections.Counter(seq.tolist()) == {s: c for s, c in enumerate(counts)}
    assert worst(seq, counts, windows=True) <= 1 + 1e-9


def test_two_streams_and_equal_weights_any_counts() -> None:
    rng = random.Random(5)
    for _ in range(40):
        counts = [rng.randrange(1, 90), rng.randrange(1, 90)]
        assert worst(interleave(counts), counts, windows=True) < 1, counts
        k = rng.randrange(2, 6)
        equal = [rng.randrange(1, 9)] * k
        assert worst(interleave(equal), equal, windows=True) < 1, equal


def test_any_weights_prefix_within_one_window_within_two() -> None:
    rng = random.Random(7)
    for _ in range(60):
        counts = [rng.randrange(1, 60) for _ in range(rng.randrange(3, 6))]
        seq = interleave(counts)
        assert worst(seq, counts, windows=False) < 1, counts
        assert worst(seq, counts, windows=True) < 2, counts


def test_interleave_is_a_pure_function() -> None:
    assert interleave([7, 2, 1]).tolist() == [0, 0, 1, 0, 0, 2, 0, 0, 1, 0]
    assert interleave([700, 200, 100]).tolist() == interleave([7, 2, 1]).tolist() * 100
    assert interleave([0, 3]).tolist() == [1, 1, 1]
    assert len(interleave([])) == 0
    with pytest.raises(ValueError, match="non-negative"):
        interleave([-1, 2])


def test_takes() -> None:
    none = [None, None, None]
    sizes = [1000, 300, 50]
    # proportions share the epoch by largest remainder: exact totals
    assert takes(sizes, proportion=[0.7, 0.2, 0.1], choose=none, repeat=none,
                 samples_per_epoch=None) == [945, 270, 135]  # fmt: skip
    got = takes(sizes, proportion=[1, 1, 1], choose=none, repeat=none, samples_per_epoch=100)
    assert got == [34, 33, 33]
    # choose and repeat, fractions allowed; default repeat 1
    assert takes(sizes, proportion=none, choose=[10, None, None], repeat=[None, 2.5, None],
                 samples_per_epoch=None) == [10, 750, 50]  # fmt: skip
    with pytest.raises(ValueError, match="proportion is given for some streams only"):
        takes(sizes, proportion=[0.5, None, None], choose=none, repeat=none,
              samples_per_epoch=None)  # fmt: skip
    with pytest.raises(ValueError, match="samples_per_epoch goes with proportion"):
        takes(sizes, proportion=none, choose=none, repeat=none, samples_per_epoch=5)
    with pytest.raises(ValueError, match="positive"):
        takes(sizes, proportion=[1, 0, 1], choose=none, repeat=none, samples_per_epoch=None)


def plan(per_epoch: list[int], unit: int = 1, epoch: int = 0) -> MixPlan:
    counts = [np.array([5, 7]), np.array([4]), np.array([3, 3, 3])]
    return MixPlan(counts, ["a", "b", "c"], per_epoch, seed=1, epoch=epoch, shuffle=True,
                   block=4, unit=unit)  # fmt: skip


def test_plan_ids_follow_each_streams_order() -> None:
    p = plan([24, 8, 4])  # a: 2 laps of its 12 samples; b: 2 laps; c: 4 of its 9
    ids = p.ids(0, p.n)
    streams = p.streams_of(0, p.n)
    assert streams.tolist() == interleave([24, 8, 4]).tolist()
    assert ((ids >= p.offsets[streams]) & (ids < p.offsets[streams + 1])).all()
    a = EpochOrder([5, 7], seed=p_seed("a"), epoch=0, block=4)
    assert (ids[streams == 0]).tolist() == a.ids(0, 12).tolist() * 2
    # c takes 4 of 9: epoch 0 reads positions 0..3 of its order, epoch 1 positions 4..7
    c1 = plan([24, 8, 4], epoch=1)
    order1 = EpochOrder([3, 3, 3], seed=p_seed("c"), epoch=1, block=4)
    got = c1.ids(0, c1.n)[c1.streams_of(0, c1.n) == 2] - c1.offsets[2]
    assert got.tolist() == order1.ids(4, 8).tolist()
    # positions past the epoch stand for p % n; pieces in any chunking agree
    pieces = np.concatenate(list(p.take([(5, p.n + 7)], 4)))
    assert pieces.tolist() == ids[5:].tolist() + ids[:7].tolist()
    assert p.counts([(0, p.n)]).tolist() == [24, 8, 4]
    assert p.counts([(3, p.n + 3)]).tolist() == [24, 8, 4]


def p_seed(name: str) -> int:
    from fastload.data.mix import stream_seed

    return stream_seed(1, name)


def test_per_stream_batches() -> None:
    p = plan([4, 2, 1], unit=3)  # positions are batches of 3 samples of one stream
    ids = p.ids(0, p.n).reshape(-1, 3)
    for row, s in zip(ids, p.streams_of(0, p.n), strict=True):
        assert ((row >= p.offsets[s]) & (row < p.offsets[s + 1])).all()
    assert p.counts([(0, p.n)]).tolist() == [12, 6, 3]
