"""Per-stream sample counts of a :class:`~fastload.Mix`'s DataLoader workers, read by the
process that made the mix (``mix.stats()`` after a plain ``DataLoader``, no state dict
needed).

A small memfd of int64 rows, made with the mix (nothing in a file system: a killed
process leaves nothing behind), so forked workers inherit it and spawned ones open it as
``/proc/PID/fd/N`` of the process that made it: each worker writes its row (written,
epoch, then a count per stream) with plain stores now and then and when its epoch ends;
the maker reads the rows of the latest epoch. The memfd goes when the mix that made it
is collected.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from typing import Any

import numpy as np

__all__ = ["SharedCounts"]

ROWS = 256  # workers per loader counted (a worker past these is not)
_HEAD = 2  # written (1), epoch


def _close(fd: int, owner: int) -> None:
    if os.getpid() == owner:  # not a forked worker's copy of the object
        with contextlib.suppress(OSError):
            os.close(fd)


class SharedCounts:
    """Counts of ``streams`` streams, a row per DataLoader worker."""

    def __init__(self, streams: int) -> None:
        # A name of its own: a process opening the path checks it is this memfd (not
        # what a reused pid and descriptor number name after the maker is gone).
        self.name = f"fastload-mix-counts-{secrets.token_hex(8)}"
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, ROWS * (_HEAD + streams) * 8)
        except BaseException:
            os.close(fd)
            raise
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self.streams = streams
        self._rows: np.ndarray | None = None
        weakref.finalize(self, _close, fd, os.getpid())

    def _map(self) -> np.ndarray | None:
        if self._rows is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            except OSError:  # its mix (or the process that made it) is gone
                return None
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{self.name} (deleted)":
                    return None
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
        return {"path": self.path, "name": self.name, "streams": self.streams}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.name, self.streams = state["path"], state["name"], state["streams"]
        self._rows = None
