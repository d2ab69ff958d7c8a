"""Fan-out of an archive: its bytes cut in pieces dealt round-robin, so that each round
delivers the next pieces in order to every node, whose extractor (the archive pipeline)
reads them from the exchange."""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...errors import SourceChangedError, stage_error
from ..destination import Destination, run_locked
from ..readers import LocalArchive
from ..result import StageResult
from .common import PIECE, SUBREAD, U64, Sender, digest
from .exchange import Exchange, fanout_error


class _PieceReader(Sender):
    """Reads this node's pieces of the archive (``k``, ``k + N``, ...), two ahead, each
    in parallel reads of ``subread`` bytes: positional reads of a file, or ranged GETs
    of an object (``RemoteArchive.read_into``)."""

    def __init__(self, base: Any, node: int, nodes: int) -> None:
        self._fd = -1  # before the pools: close() works whatever fails next
        if isinstance(base, LocalArchive):
            self._fd = os.open(base.path, os.O_RDONLY | os.O_CLOEXEC)
            self._read_at: Callable[[memoryview, int], int] = self._pread
            self._subread = SUBREAD
        else:
            self._read_at = base.read_into
            self._subread = 4 * SUBREAD
        super().__init__()
        self._name, self._size, self._node, self._nodes = base.name, base.size, node, nodes
        self._next = node
        self._fill()

    def _pread(self, view: memoryview, off: int) -> int:
        got = 0
        while got < view.nbytes:
            k = os.preadv(self._fd, [view[got:]], off + got)
            if k == 0:
                break
            got += k
        return got

    def _fill(self) -> None:
        while len(self._ahead) < 2 and self._next * PIECE < self._size:
            self._ahead.append(self._pool.submit(self._read, self._next))
            self._next += self._nodes

    def _read(self, piece: int) -> bytearray:
        off = piece * PIECE
        n = min(PIECE, self._size - off)
        buf = bytearray(8 + n)
        view = memoryview(buf)[8:]
        parts = [(s, min(s + self._subread, n)) for s in range(0, n, self._subread)]
        futures = [self._sub.submit(self._read_at, view[s:e], off + s) for s, e in parts]
        got = sum(f.result() for f in futures)
        if got != n:
            raise SourceChangedError(
                errno.EIO,
                f"source file changed: '{self._name}' is shorter than when staging began; "
                "stage again to pick up the new content",
            )
        U64.pack_into(buf, 0, digest(view))
        self.store_bytes += n
        return buf

    def close(self) -> None:
        super().close()
        if self._fd >= 0:
            os.close(self._fd)


def _pieces_of_round(
    x: Exchange, views: list[memoryview], r: int, size: int, what: str
) -> Iterator[tuple[int, memoryview]]:
    """The round's pieces in archive order, their digests checked."""
    for k in range(x.nodes):
        piece = r * x.nodes + k
        if piece * PIECE >= size:
            return
        v = views[k]
        data = v[8:]
        if (
            data.nbytes != min(PIECE, size - piece * PIECE)
            or digest(data) != U64.unpack_from(v, 0)[0]
        ):
            raise stage_error(
                errno.EIO,
                f"fan-out: piece {piece} of '{what}' from node {k} ({x.hosts[k]}) arrived damaged",
                what,
            )
        yield piece * PIECE, data


class _ExchangeReader:
    """An archive reader (as the extraction iterates it) whose blocks come from the
    exchange: each round, this node's next piece goes out and ``N`` pieces come in, in
    order; they are copied into the extraction job's blocks."""

    def __init__(
        self, x: Exchange, pieces: _PieceReader, size: int, what: str, job: Any, hasher: Any
    ):
        self._x, self._pieces, self._size, self._what = x, pieces, size, what
        self._job, self._hasher = job, hasher
        self._rounds = -(-size // (PIECE * x.nodes))
        self._round = 0
        self._skip_to = 0
        self._synced = False

    def _start(self) -> None:
        # The extraction's set-up (reading back an earlier copy, say) takes as long as
        # it takes on each node: the rounds start once every node is ready.
        if not self._synced:
            self._synced = True
            self._x.sync("extracting")

    def seek(self, offset: int) -> None:
        self._skip_to = offset  # the bytes before it still travel; they are not fed

    def __iter__(self) -> Iterator[tuple[int, int, int, memoryview]]:
        block = self._job.block_size
        self._start()
        while self._round < self._rounds:
            r = self._round
            views = self._x.round_trip(self._pieces.next())
            self._round += 1
            for off, data in _pieces_of_round(self._x, views, r, self._size, self._what):
                if self._hasher is not None:
                    self._hasher.update(data)
                for start in range(0, data.nbytes, block):
                    at = off + start
                    part = data[start : start + block]
                    if at + part.nbytes <= self._skip_to:
                        continue
                    if at < self._skip_to:
                        part = part[self._skip_to - at :]
                        at = self._skip_to
                    lent = self._job.lend(True)
                    if lent is None:
                        return  # the job stopped: its error comes from job.finish()
                    b, buf = lent
                    view = memoryview(buf)
                    try:
                        view[: part.nbytes] = part
                        yield at, part.nbytes, b, view[: part.nbytes]
                    finally:
                        self._job.release(b)

    def pump(self) -> None:
        """Takes part in the remaining rounds without extracting (this node's copy is
        complete, or its extraction ended early)."""
        self._start()
        while self._round < self._rounds:
            self._x.round_trip(self._pieces.next())
            self._round += 1

    def close(self) -> None:
        pass


class _ExchangeArchive:
    """The archive as the extraction sees it: the local one's name, size and identity
    (so the manifest is the one a plain stage writes), its bytes from the exchange."""

    def __init__(self, base: Any, x: Exchange, pieces: _PieceReader) -> None:
        self._base, self._x, self._pieces = base, x, pieces
        self.name, self.size, self.identity = base.name, base.size, base.identity
        self.cached = 0.0
        self.stream = False
        self.reader_made: _ExchangeReader | None = None

    def reader(
        self, job: Any, hasher: Any, can_seek: bool, raw: bool = True
    ) -> _ExchangeReader:
        self.reader_made = _ExchangeReader(self._x, self._pieces, self.size, self.name, job, hasher)
        return self.reader_made

    def direct_write_min(self, dst: Path) -> int:
        return int(self._base.direct_write_min(dst))

    def changed(self) -> bool:
        return bool(self._base.changed())


def fan_archive(x: Exchange, archive: Any, dest: Destination) -> StageResult:
    """``archive`` (an :class:`archive.Archive`) extracted on every node, its bytes read
    once in total (under ``dest``'s lock)."""
    base = archive.data
    complete = archive.is_complete(dest.req, dest)
    x.sync("checked")
    sizes = x.all_gather_object((complete, base.size, base.identity))
    if len({(s, i) for _, s, i in sizes}) != 1:
        raise fanout_error(
            f"the nodes see different versions of '{archive.name}' (size and time): "
            + ", ".join(f"node {k}: {s} bytes" for k, (_, s, _) in enumerate(sizes)),
            archive.name,
        )
    if all(c for c, _, _ in sizes):
        return run_locked(dest, archive)
    pieces = _PieceReader(base, x.node, x.nodes)
    try:
        if complete:
            _ExchangeReader(x, pieces, base.size, base.name, None, None).pump()
            result = run_locked(dest, archive)
        else:
            source = _ExchangeArchive(base, x, pieces)
            result = run_locked(dest, archive.with_data(source))
            # Rounds left after the end of the tar stream (or all of them, where the
            # extraction found nothing to do).
            reader = source.reader_made or _ExchangeReader(
                x, pieces, base.size, base.name, None, None
            )
            reader.pump()
    finally:
        pieces.close()
    return dataclasses.replace(
        result,
        seconds=time.monotonic() - dest.req.t0,
        nodes=x.nodes,
        read_bytes=pieces.store_bytes,
    )
