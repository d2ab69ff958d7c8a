"""What the parts of fan-out share: its sizes, parallel reads, digests,
and the read-ahead every leader's sender is built on."""

from __future__ import annotations

import os
import re
import struct
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from ... import _core

# Bytes a leader sends per round (every leader receives N times that); node 0's
# FASTLOAD_FANOUT_ROUND overrides it (tests use small rounds to have many).
ROUND = 32 << 20
PIECE = 16 << 20  # bytes of an archive per piece
SUBREAD = 1 << 20  # a chunk is read in parallel positional reads of this size
READERS = 32  # reads in flight on a leader
WRITERS = 8  # writes in flight on a leader

U64 = struct.Struct("<Q")
_NONZERO = re.compile(rb"[^\x00]")


def read_range(fd: int, view: memoryview, off: int, pool: ThreadPoolExecutor) -> int:
    """Fills ``view`` from ``fd`` at ``off`` with parallel reads of ``SUBREAD`` bytes
    (a network file system serves one request at a time per read). Returns the bytes
    read (short at the end of the file)."""

    def one(start: int, end: int) -> int:
        got = start
        while got < end:
            k = os.preadv(fd, [view[got:end]], off + got)
            if k == 0:
                break
            got += k
        return got - start

    n = view.nbytes
    if n <= SUBREAD:
        return one(0, n)
    parts = [(s, min(s + SUBREAD, n)) for s in range(0, n, SUBREAD)]
    futures = [pool.submit(one, s, e) for s, e in parts[1:]]
    total = one(*parts[0])
    for fut in futures:
        total += fut.result()
    return total


def digest(view: memoryview) -> int:
    return _core.fl64(view)


class Sender:
    """What a leader sends, built two rounds ahead of the exchange (on ``_pool``; reads
    in parallel on ``_sub``): ``_fill`` queues the next buffers, ``next`` takes one."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="fastload-fanout-read")
        self._sub = ThreadPoolExecutor(READERS, thread_name_prefix="fastload-fanout-sub")
        self._ahead: deque[Future[bytearray]] = deque()
        self.store_bytes = 0

    def _fill(self) -> None:
        raise NotImplementedError

    def next(self) -> bytearray:
        if not self._ahead:
            return bytearray()
        buf = self._ahead.popleft().result()
        self._fill()
        return buf

    def close(self) -> None:
        for fut in self._ahead:
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sub.shutdown(wait=True, cancel_futures=True)


class Bits:
    """A set of indices below ``n`` as a bitmap (bit ``i % 8`` of byte ``i // 8``): what
    a node says it needs or holds, sent and kept as it is (no int object per index)."""

    def __init__(self, data: bytes | bytearray, n: int) -> None:
        self.data, self.n = bytes(data), n

    @classmethod
    def of(cls, indices: Iterable[int], n: int) -> Bits:
        out = bytearray((n + 7) // 8)
        for i in indices:
            out[i >> 3] |= 1 << (i & 7)
        return cls(out, n)

    @classmethod
    def union(cls, sets: Iterable[Bits], n: int) -> Bits:
        acc = 0
        for b in sets:
            acc |= int.from_bytes(b.data, "little")
        return cls(acc.to_bytes((n + 7) // 8, "little"), n)

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and 0 <= i < self.n and bool(self.data[i >> 3] >> (i & 7) & 1)

    def __iter__(self) -> Iterator[int]:
        """The indices, in order (the zero bytes skipped at C speed)."""
        data = self.data
        for m in _NONZERO.finditer(data):
            at = m.start()
            byte = data[at]
            for bit in range(8):
                if byte >> bit & 1:
                    yield at * 8 + bit

    def __len__(self) -> int:
        return int.from_bytes(self.data, "little").bit_count()

    def __bool__(self) -> bool:
        return any(self.data)
