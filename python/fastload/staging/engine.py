"""The I/O backend a job runs, and the file systems under a path.

The rule that turns ``engine="auto"`` into a backend is the native one
(``io::resolve_kind``, cpp/io/engine.hpp): ``FASTLOAD_ENGINE``, the file system under
the path the job names (a network or FUSE one means the pool of pread threads), whether
io_uring can be set up here. Native jobs apply it themselves; ``resolve_engine`` asks it
for a report (``fastload probe``) before any job runs.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from .. import _core

# statfs(2) magic numbers of network and FUSE file systems (the native table,
# cpp/io/fs.cpp).
_NETWORK_FS = frozenset(
    magic for magic, (_, network) in _core.file_systems().items() if network
)


FUSE_MAGIC = 0x65735546  # statfs(2)'s FUSE_SUPER_MAGIC


def fs_kind(path: Path | str) -> int | None:
    """The file system of ``path``: 0 local, 1 network, 2 FUSE (None: cannot tell)."""
    try:
        magic = _core.fs_type(os.fspath(path))
    except OSError:
        return None
    return 2 if magic == FUSE_MAGIC else int(magic in _NETWORK_FS)


def network_fs(path: Path | str) -> bool | None:
    """Whether ``path`` is on a network or FUSE file system (None: cannot tell)."""
    kind = fs_kind(path)
    return None if kind is None else kind > 0


def resolve_engine(engine: str, where: Path | str | None = None) -> str:
    """The backend (``"uring"`` or ``"pread"``) a job asking for ``engine`` runs when
    its rule looks at ``where`` (a tree copy's source, an extraction's destination).
    A malformed ``FASTLOAD_ENGINE`` raises ValueError naming it."""
    return _core.resolve_engine(engine, None if where is None else os.fspath(where))


LATENCY_SAMPLES = 4  # files opened to time the storage: a round trip or two each
_LATENCY_DIRS = 8  # folders looked into, at most, to find them


def _sample_files(root: Path) -> list[str]:
    """Up to LATENCY_SAMPLES regular files under ``root``, breadth first, by name only
    (no stat), looking into at most _LATENCY_DIRS folders."""
    out: list[str] = []
    todo, seen = [os.fspath(root)], 0
    while todo and len(out) < LATENCY_SAMPLES and seen < _LATENCY_DIRS:
        d = todo.pop(0)
        seen += 1
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.is_file(follow_symlinks=False):
                        out.append(e.path)
                        if len(out) >= LATENCY_SAMPLES:
                            break
                    elif e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
        except OSError:
            continue
    return out


def request_latency(root: Path | str) -> float | None:
    """Seconds the storage under ``root`` takes to answer one request: the least time of
    the opens of a few of its files (on a network or FUSE file system each is a round
    trip to the server, even where a walk has just looked the file up: FUSE's open, NFS's
    close-to-open check), what ``fastload probe`` reports as its open latency. None where
    ``root`` is not a folder holding a file that can be opened (one file needs nothing
    in flight). Costs a folder listing or two and LATENCY_SAMPLES opens, one after
    another: a stage runs it beside its walk (:class:`LatencyProbe`)."""
    root = Path(root)
    files = _sample_files(root) if root.is_dir() else []
    took: list[float] = []
    for f in files:
        try:
            t0 = time.perf_counter()
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            t1 = time.perf_counter()
        except OSError:
            continue
        os.close(fd)
        took.append(t1 - t0)
    return min(took) if took else None


class LatencyProbe:
    """:func:`request_latency` of ``root`` on a thread of its own, started at once (a
    stage's walk runs meanwhile: the measurement adds no round trips to its wall time);
    :meth:`result` waits for it."""

    def __init__(self, root: Path | str) -> None:
        self._got: list[float | None] = []
        self._thread = threading.Thread(target=lambda: self._got.append(request_latency(root)),
                                        name="fastload-latency", daemon=True)  # fmt: skip
        self._thread.start()

    def result(self) -> float | None:
        self._thread.join()
        return self._got[0] if self._got else None
