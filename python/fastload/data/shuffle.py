"""The order of an epoch: shard order and sample order, from ``(seed, epoch)`` only.

An epoch's order is a sequence of every sample id (positions ``0 .. n-1``), built in two
steps:

1. the shards are permuted, and their samples laid end to end in that order (each
   shard's samples in their stored order);
2. that sequence is cut into blocks of ``block`` positions and the samples of each block
   are permuted.

A reader of a contiguous range of positions therefore reads from the few shards under
that range, in random order within a window of ``block`` samples: a larger block mixes
more shards into each batch, a smaller one keeps reads closer together. ``block=1``
keeps each shard's stored order (only the shard order is shuffled); ``block >= n`` is a
full shuffle.

Every permutation here is fastload's one permutation, ``_core.permutation`` of the words
``(seed, epoch, tag[, block])`` (the same function orders pack's samples). **The
guarantee:** it is defined bit for bit in ``cpp/common/permutation.hpp`` by 64-bit
integer arithmetic alone (SplitMix64's finaliser over a Weyl sequence, sorted), so the
same ``(seed, epoch)`` gives the same order on every machine, in every process, rank and
start method, under any numpy, compiler or platform; it changes only with fastload's
resume-state version (``ShardIterableDataset`` refuses a state of another). Each block
has its own words, so any range of positions is computed without computing the rest of
the epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .. import _core
from .._util import check_block, check_seed
from .partition import Intervals

__all__ = ["DEFAULT_BLOCK", "EpochOrder", "epoch_order", "permutation"]

#: Default ``shuffle_block``: each block mixes 65,536 samples (64 shards of 1,000).
DEFAULT_BLOCK = 1 << 16

_SHARDS = 0x5348  # stream tags: shard permutation, block permutations
_BLOCKS = 0x424B


def permutation(n: int, *words: int) -> np.ndarray:
    """A permutation of ``range(n)`` (int64) determined by ``words`` (integers in
    ``[0, 2**64)``): ``_core.permutation`` (see the module's guarantee)."""
    return _core.permutation(n, [check_seed(w, "a permutation's word") for w in words])


class EpochOrder:
    """The sample order of one epoch over shards of ``counts`` samples (in index order:
    shard ``i`` holds ids ``sum(counts[:i]) .. sum(counts[:i+1])-1``).

    ``ids(lo, hi)`` gives the sample ids at positions ``lo .. hi-1``; ``take(intervals)``
    those at a list of position ranges, where a position ``p >= n`` means ``p % n`` (the
    padding of an epoch that repeats samples). ``shuffle=False`` is the stored order.
    """

    def __init__(
        self,
        counts: Sequence[int] | np.ndarray,
        *,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        block: int = DEFAULT_BLOCK,
    ) -> None:
        check_seed(seed)
        check_seed(epoch, "epoch")
        check_block(block, "shuffle block")
        c = np.asarray(counts, dtype=np.int64).reshape(-1)
        if c.size and int(c.min()) < 0:
            raise ValueError("shard sample counts must not be negative")
        self.seed, self.epoch, self.shuffle, self.block = int(seed), int(epoch), shuffle, int(block)
        self.n = int(c.sum())
        first = np.zeros(c.size, dtype=np.int64)
        np.cumsum(c[:-1], out=first[1:])
        perm = permutation(c.size, seed, epoch, _SHARDS) if shuffle else np.arange(c.size)
        #: shard order of this epoch (indices into ``counts``)
        self.shards = perm
        self._starts = first[perm]
        self._ends = np.cumsum(c[perm])  # position just past each shard, in epoch order
        self._cache: tuple[int, np.ndarray] | None = None

    def sequence(self, lo: int, hi: int) -> np.ndarray:
        """Ids at positions ``lo .. hi-1`` before the block shuffle: the permuted shards'
        samples end to end."""
        pos = np.arange(lo, hi, dtype=np.int64)
        j = np.searchsorted(self._ends, pos, side="right")
        before = np.where(j > 0, self._ends[np.maximum(j - 1, 0)], 0)
        out: np.ndarray = self._starts[j] + (pos - before)
        return out

    def block_ids(self, k: int) -> np.ndarray:
        """Ids at the positions of block ``k``, shuffled (the last block may be short)."""
        if self._cache is not None and self._cache[0] == k:
            return self._cache[1]
        lo, hi = k * self.block, min(self.n, (k + 1) * self.block)
        seq = self.sequence(lo, hi)
        if self.shuffle and hi - lo > 1:
            seq = seq[permutation(hi - lo, self.seed, self.epoch, _BLOCKS, k)]
        self._cache = (k, seq)
        return seq

    def ids(self, lo: int, hi: int) -> np.ndarray:
        """Ids at positions ``lo .. hi-1`` (``0 <= lo <= hi <= n``)."""
        if not 0 <= lo <= hi <= self.n:
            raise ValueError(f"positions {lo}..{hi} outside an epoch of {self.n}")
        if not self.shuffle or self.block == 1:
            return self.sequence(lo, hi)
        parts = []
        p = lo
        while p < hi:
            k = p // self.block
            stop = min(hi, (k + 1) * self.block)
            parts.append(self.block_ids(k)[p - k * self.block : stop - k * self.block])
            p = stop
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def take(self, intervals: Intervals, chunk: int = 1 << 12) -> Iterator[np.ndarray]:
        """Ids at the positions of ``intervals`` (in their order), at most ``chunk`` at a
        time; a position ``p >= n`` stands for ``p % n``."""
        if self.n == 0:
            if any(b > a for a, b in intervals):
                raise ValueError("positions asked of an empty epoch")
            return
        for a, b in intervals:
            p = a
            while p < b:
                base = (p // self.n) * self.n
                stop = min(b, base + self.n, p + chunk)
                # Stay inside one block per piece, so each block is shuffled once.
                if self.shuffle and self.block > 1:
                    q = p - base
                    stop = min(stop, base + (q // self.block + 1) * self.block)
                yield self.ids(p - base, stop - base)
                p = stop


def epoch_order(
    counts: Sequence[int] | np.ndarray,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    block: int = DEFAULT_BLOCK,
) -> np.ndarray:
    """Every sample id of the epoch in its order (see :class:`EpochOrder`)."""
    order = EpochOrder(counts, seed=seed, epoch=epoch, shuffle=shuffle, block=block)
    return order.ids(0, order.n)
