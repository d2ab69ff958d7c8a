"""The I/O backend a job runs, and the file systems under a path.

The rule that turns ``engine="auto"`` into a backend is the native one
(``io::resolve_kind``, cpp/io/engine.hpp): ``FASTLOAD_ENGINE``, the file system under
the path the job names (a network or FUSE one means the pool of pread threads), whether
io_uring can be set up here. Native jobs apply it themselves; ``resolve_engine`` asks it
for a report (``fastload probe``) before any job runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .. import _core

# statfs(2) magic numbers of network and FUSE file systems (the native table,
# cpp/io/fs.cpp).
_NETWORK_FS = frozenset(
    magic for magic, (_, network) in _core.file_systems().items() if network
)


def network_fs(path: Path | str) -> bool | None:
    """Whether ``path`` is on a network or FUSE file system (None: cannot tell)."""
    try:
        return _core.fs_type(os.fspath(path)) in _NETWORK_FS
    except OSError:
        return None


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
    the lstat and of the open of each of a few of its files, not touched before (on a
    network or FUSE file system each is a round trip to the server: a lookup, an open),
    what ``fastload probe`` reports as its stat and open latency. None where ``root`` is
    not a folder holding a file that can be opened (one file needs nothing in flight).
    Costs a folder listing or two and 2 x LATENCY_SAMPLES requests, one after another."""
    root = Path(root)
    files = _sample_files(root) if root.is_dir() else []
    took: list[float] = []
    for f in files:
        try:
            t0 = time.perf_counter()
            os.lstat(f)
            t1 = time.perf_counter()
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            t2 = time.perf_counter()
        except OSError:
            continue
        os.close(fd)
        took += [t1 - t0, t2 - t1]
    return min(took) if took else None
