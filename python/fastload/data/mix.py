"""Mixing shard sets by weight: the epoch plan of a :class:`~fastload.Mix`, as pure
functions of integers (no torch, no I/O).

A mix has streams ``s = 0 .. S-1`` of ``n_s`` samples each; an epoch *takes* ``t_s``
samples of stream ``s`` (:func:`takes`: from ``proportion``, ``choose`` or ``repeat``),
``N = sum(t_s)`` in all. The epoch's positions ``0 .. N-1`` are laid out by
:class:`MixPlan`:

- **Interleaving** (:func:`interleave`): which stream each position belongs to is a
  smooth weighted round-robin over the reduced takes ``t_s / g`` (``g`` their gcd),
  repeated ``g`` times: a deterministic low-discrepancy sequence, the same for every
  seed, epoch, rank and worker. Stream ``s``'s ``j``-th position (``j``-th in the
  sequence) reads its ``j``-th sample of the epoch.
- **A stream's samples**: the ``j``-th sample of stream ``s`` in epoch ``e`` is position
  ``(o_s + j) mod n_s`` of the stream's own epoch order (:class:`~.shuffle.EpochOrder`
  from ``(seed', e)``, ``seed'`` derived from the seed and the stream's *name*, so adding
  a stream changes no other stream's order), with ``o_s = e * t_s mod n_s`` when the
  stream takes fewer samples than it has (so unshuffled epochs walk through it), else 0
  (``repeat > 1``: the order read again from its start).

**The guarantee** (checked by tests/data/test_mix_plan.py): for two streams, and for
streams of equal weights, every window of ``W`` consecutive positions holds
``round-down or round-up`` of ``w_s * W`` samples of stream ``s`` (within 1), where
``w_s = t_s / N``; for 0.7/0.2/0.1 too. For three or more streams of unequal weights no
sequence keeps every window within 1 of every weight (balanced words over three letters
exist only for a few densities: Fraenkel's conjecture, proven for up to seven letters);
the round-robin keeps them within 2, and every prefix of the epoch within 1 (tests check it
over many random weight sets).

**Per-stream batches** (``batching="per_stream"``): positions are *batches* of ``B``
samples: stream ``s`` gives ``t_s // B`` whole batches (its takes are cut down to whole
batches), and the batches are interleaved by the same round-robin over those counts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from .partition import Intervals
from .shuffle import EpochOrder

if TYPE_CHECKING:
    from ._fetch import Source

__all__ = ["MixPlan", "Stream", "interleave", "stream_name", "stream_seed", "takes"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def stream_seed(seed: int, name: str) -> int:
    """The seed of a stream's own order: ``seed`` mixed with a checksum of its name."""
    return (seed + _GOLDEN * (zlib.crc32(name.encode()) + 1)) & _MASK


def _round_robin(red: list[int], period: int) -> list[int]:
    """The smooth weighted round-robin over positive counts ``red`` adding up to
    ``period``: each step every stream gains its count, the one with the most (lowest
    index on ties) is taken and loses ``period``. Unrolled for up to three streams (about
    0.1 us a step; the general loop about 0.3)."""
    out: list[int] = []
    put = out.append
    if len(red) == 1:
        return [0] * period
    if len(red) == 2:
        r0, r1 = red
        a = b = 0
        for _ in range(period):
            a += r0
            b += r1
            if a >= b:
                a -= period
                put(0)
            else:
                b -= period
                put(1)
        return out
    if len(red) == 3:
        r0, r1, r2 = red
        a = b = c = 0
        for _ in range(period):
            a += r0
            b += r1
            c += r2
            if a >= b and a >= c:
                a -= period
                put(0)
            elif b >= c:
                b -= period
                put(1)
            else:
                c -= period
                put(2)
        return out
    cur = [0] * len(red)
    streams = range(len(red))
    for _ in range(period):
        best, top = 0, None
        for i in streams:
            v = cur[i] + red[i]
            cur[i] = v
            if top is None or v > top:
                best, top = i, v
        cur[best] -= period
        put(best)
    return out


def interleave(counts: Sequence[int]) -> np.ndarray:
    """The stream (int16) of each of ``sum(counts)`` positions: a smooth weighted
    round-robin over ``counts`` (each step every stream gains its count, the one with
    the most, lowest index on ties, is taken and loses the total), computed over the
    counts divided by their gcd and repeated."""
    c = [int(x) for x in counts]
    if any(x < 0 for x in c) or len(c) > 32767:
        raise ValueError(f"stream counts must be non-negative, not {c}")
    total = sum(c)
    if total == 0:
        return np.empty(0, dtype=np.int16)
    g = 0
    for x in c:
        g = math.gcd(g, x)
    red = [x // g for x in c]
    period = total // g
    live = [i for i, x in enumerate(red) if x]
    out = np.array(_round_robin([red[i] for i in live], period), dtype=np.int16)
    if len(live) < len(c):  # streams taking nothing: the live ones' own numbers
        out = np.asarray(live, dtype=np.int16)[out]
    return np.tile(out, g) if g > 1 else out


def takes(
    sizes: Sequence[int],
    *,
    proportion: Sequence[float | None],
    choose: Sequence[int | None],
    repeat: Sequence[float | None],
    samples_per_epoch: int | None,
) -> list[int]:
    """Samples each stream gives an epoch. Streams with ``proportion`` (then all have
    one) share ``samples_per_epoch`` (default: the streams' samples together) by their
    weights, rounded by largest remainder (ties to the first stream), so the takes add
    up exactly; ``choose`` is a count; ``repeat`` (default 1) takes ``floor(repeat *
    n)`` samples of ``n``."""
    n = len(sizes)
    props = [p for p in proportion if p is not None]
    if props and len(props) != n:
        raise ValueError(
            "proportion is given for some streams only: give every stream a proportion, "
            "or use choose/repeat for all of them"
        )
    if props:
        if any(p <= 0 or not math.isfinite(p) for p in props):
            raise ValueError(f"proportions must be positive, not {props}")
        total = sum(sizes) if samples_per_epoch is None else samples_per_epoch
        weights = [Fraction(str(p)) for p in props]
        whole = sum(weights)
        exact = [w * total / whole for w in weights]
        out = [math.floor(x) for x in exact]
        rest = total - sum(out)
        order = sorted(range(n), key=lambda i: (-(exact[i] - out[i]), i))
        for i in order[:rest]:
            out[i] += 1
        return out
    if samples_per_epoch is not None:
        raise ValueError(
            "samples_per_epoch goes with proportion: with choose and repeat the streams "
            "set the epoch's size themselves"
        )
    out = []
    for size, c, r in zip(sizes, choose, repeat, strict=True):
        if c is not None:
            out.append(int(c))
        else:
            out.append(math.floor(Fraction(str(1.0 if r is None else r)) * size))
    return out


@functools.lru_cache(maxsize=4)
def _layout(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The interleaving of ``counts`` and, per position, how many earlier positions
    belong to its stream; kept for the next epochs (and inherited by forked workers):
    the round-robin costs about 0.1 s per million positions of its period for up to three
    streams, 0.3 s for more."""
    seq = interleave(counts)
    rank = np.zeros(len(seq), dtype=np.int64)
    for s in range(len(counts)):
        where = np.flatnonzero(seq == s)
        rank[where] = np.arange(len(where))
    seq.flags.writeable = False
    rank.flags.writeable = False
    return seq, rank


@dataclasses.dataclass
class _StreamOrder:
    size: int
    take: int
    order: EpochOrder | None
    offset: int


class MixPlan:
    """One epoch of a mix: where each of its ``n`` positions reads.

    ``sizes``: samples per stream; ``per_epoch``: samples each stream gives (positions
    are samples), or with ``unit=B`` batches each stream gives (positions are batches of
    ``B`` of one stream). ``counts_by_shard``: per stream, its shards' sample counts (for
    the stream's own order)."""

    def __init__(
        self,
        counts_by_shard: Sequence[np.ndarray],
        names: Sequence[str],
        per_epoch: Sequence[int],
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        block: int,
        unit: int = 1,
    ) -> None:
        self.unit = unit
        self.per_epoch = [int(x) for x in per_epoch]
        self.sizes = [int(np.sum(c)) for c in counts_by_shard]
        self.offsets = np.zeros(len(self.sizes) + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self.offsets[1:])
        self.seq, self.rank = _layout(tuple(self.per_epoch))
        self.n = len(self.seq)
        self._streams: list[_StreamOrder] = []
        for s, counts in enumerate(counts_by_shard):
            size, take = self.sizes[s], self.per_epoch[s] * unit
            order = None
            if take:
                if size == 0:
                    raise ValueError(f"stream {names[s]!r} has no samples but takes {take}")
                order = EpochOrder(counts, seed=stream_seed(seed, names[s]), epoch=epoch,
                                   shuffle=shuffle, block=block)  # fmt: skip
            offset = (epoch * take) % size if size and take < size else 0
            self._streams.append(_StreamOrder(size, take, order, offset))

    def streams_of(self, lo: int, hi: int) -> np.ndarray:
        """The stream of each position ``lo .. hi-1`` (``p >= n`` stands for ``p % n``)."""
        return self.seq[np.arange(lo, hi, dtype=np.int64) % self.n]

    def ids(self, lo: int, hi: int) -> np.ndarray:
        """Mix-wide sample ids (stream ``s``'s sample ``i`` is ``offsets[s] + i``) at
        positions ``lo .. hi-1`` of one pass (``0 <= lo <= hi <= n``), in samples: ``B``
        per position with ``unit=B``."""
        seq, rank = self.seq[lo:hi], self.rank[lo:hi]
        u = self.unit
        out = np.empty((hi - lo) * u, dtype=np.int64)
        # The streams present (not np.unique: its first call imports numpy.ma, 0.1 s in
        # every freshly forked DataLoader worker of every epoch).
        for s in np.flatnonzero(np.bincount(seq, minlength=len(self._streams))).tolist():
            st = self._streams[s]
            assert st.order is not None
            where = np.flatnonzero(seq == s)
            a = int(rank[where[0]]) * u + st.offset
            b = (int(rank[where[-1]]) + 1) * u + st.offset
            local = np.concatenate(list(st.order.take([(a, b)]))) if b > a else np.empty(0)
            if u == 1:
                out[where] = local + self.offsets[s]
            else:
                slots = (where[:, None] * u + np.arange(u)).reshape(-1)
                out[slots] = local + self.offsets[s]
        return out

    def take(self, intervals: Intervals, chunk: int) -> Iterator[np.ndarray]:
        """Mix-wide ids at the positions of ``intervals`` (a position ``p >= n`` stands
        for ``p % n``), at most ``chunk`` positions at a time."""
        for a, b in intervals:
            p = a
            while p < b:
                base = (p // self.n) * self.n
                stop = min(b, base + self.n, p + chunk)
                yield self.ids(p - base, stop - base)
                p = stop

    def counts(self, intervals: Intervals) -> np.ndarray:
        """Samples per stream at the positions of ``intervals``."""
        out = np.zeros(len(self.sizes), dtype=np.int64)
        for a, b in intervals:
            if b <= a:
                continue
            laps, r0 = divmod(a, self.n)
            full = np.bincount(self.seq, minlength=len(self.sizes)) if self.n else out
            q1, r1 = divmod(b, self.n)
            out += (q1 - laps) * full
            out -= np.bincount(self.seq[:r0], minlength=len(self.sizes))
            out += np.bincount(self.seq[:r1], minlength=len(self.sizes))
        return out * self.unit


@dataclasses.dataclass(frozen=True)
class Stream:
    """One shard set of a :class:`Mix` and how much of it an epoch reads: ``proportion``
    (a relative weight: every stream of the mix then has one), ``choose`` (samples per
    epoch) or ``repeat`` (times its samples per epoch, fractions allowed; the default,
    1). ``source``: as for :class:`~fastload.ShardIterableDataset` (local or in a
    bucket). ``name``: the stream's name in ``__stream__``, states and ``stats()``
    (default: the source when it is a path or URL, else ``stream{i}``)."""

    source: Source
    proportion: float | None = None
    choose: int | None = None
    repeat: float | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("proportion", "choose", "repeat") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"a Stream takes one of proportion, choose, repeat, not {given}")
        c = self.choose
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"choose must be a non-negative integer, not {c!r}")
        r = self.repeat
        if r is not None and (isinstance(r, bool) or not r >= 0):
            raise ValueError(f"repeat must be a non-negative number, not {r!r}")


def stream_name(stream: Stream, i: int) -> str:
    """A stream's name: given, else its source's path or URL, else ``stream{i}``."""
    if stream.name is not None:
        return stream.name
    if isinstance(stream.source, (str, os.PathLike)):
        return os.fspath(stream.source)
    return f"stream{i}"
