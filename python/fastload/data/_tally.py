"""Per-stream sample counts of a :class:`~fastload.Mix`'s DataLoader workers, read by the
process that made the mix (``mix.stats()`` after a plain ``DataLoader``, no state dict
needed).

A small file of int64 rows (``/dev/shm`` where there is one), made with the mix, so
forked workers inherit its mapping and spawned ones map it by name: each worker writes
its row (written, epoch, then a count per stream) with plain stores now and then and
when its epoch ends; the maker reads the rows of the latest epoch. The file goes when
the mix that made it is collected (or at exit).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import weakref
from typing import Any

import numpy as np

__all__ = ["SharedCounts"]

ROWS = 256  # workers per loader counted (a worker past these is not)
_HEAD = 2  # written (1), epoch


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked worker's copy of the object
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class SharedCounts:
    """Counts of ``streams`` streams, a row per DataLoader worker."""

    def __init__(self, streams: int) -> None:
        where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        fd, self.path = tempfile.mkstemp(prefix="fastload-mix-", dir=where)
        try:
            os.ftruncate(fd, ROWS * (_HEAD + streams) * 8)
        finally:
            os.close(fd)
        self.streams = streams
        self._rows: np.ndarray | None = None
        weakref.finalize(self, _remove, self.path, os.getpid())

    def _map(self) -> np.ndarray | None:
        if self._rows is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # its mix is gone
                return None
            try:
                mm = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
            self._rows = np.frombuffer(mm, dtype=np.int64).reshape(ROWS, _HEAD + self.streams)
        return self._rows

    def publish(self, worker: int, epoch: int, counts: np.ndarray) -> None:
        """Worker ``worker``'s counts of ``epoch`` so far."""
        rows = self._map()
        if rows is None or not 0 <= worker < ROWS:
            return
        row = rows[worker]
        row[1] = epoch
        row[_HEAD:] = counts
        row[0] = 1

    def latest(self) -> tuple[int, np.ndarray] | None:
        """The latest epoch the workers counted, and its counts summed over them; None
        where no worker wrote."""
        rows = self._map()
        if rows is None:
            return None
        rows = rows.copy()
        written = rows[rows[:, 0] == 1]
        if not len(written):
            return None
        epoch = int(written[:, 1].max())
        return epoch, written[written[:, 1] == epoch, _HEAD:].sum(axis=0)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "streams": self.streams}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.streams = state["path"], state["streams"]
        self._rows = None
