"""The round-robin of fastload.data.mix (unrolled for two and three streams) against the
rule written out step by step here: each step every stream gains its count, the one with
the most (lowest index on ties) is taken and loses the total."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastload.data.mix import interleave


def by_the_rule(counts: list[int]) -> list[int]:
    total = sum(counts)
    cur = [0] * len(counts)
    out = []
    for _ in range(total):
        for i, c in enumerate(counts):
            cur[i] += c
        best = max(range(len(counts)), key=lambda i: (cur[i] if counts[i] else -(1 << 62), -i))
        cur[best] -= total
        out.append(best)
    return out


@pytest.mark.parametrize("streams", [1, 2, 3, 4, 6])
def test_the_rule_for_any_counts(streams: int) -> None:
    rng = random.Random(streams)
    for _ in range(60):
        counts = [rng.choice([0, rng.randrange(1, 40), rng.randrange(1, 400)])
                  for _ in range(streams)]  # fmt: skip
        if not sum(counts):
            counts[-1] = 3
        got = interleave(counts)
        assert got.dtype == np.int16
        assert got.tolist() == by_the_rule(counts), counts


def test_ties_and_shared_factors() -> None:
    assert interleave([2, 2]).tolist() == [0, 1, 0, 1]
    assert interleave([1, 1, 1]).tolist() == [0, 1, 2]
    assert interleave([0, 3, 0]).tolist() == [1, 1, 1]
    assert interleave([0, 0]).tolist() == []
    # 6999/2000/1001 share no factor: the period is the whole epoch.
    counts = [6999, 2000, 1001]
    assert interleave(counts).tolist() == by_the_rule(counts)
    with pytest.raises(ValueError, match="non-negative"):
        interleave([3, -1])
