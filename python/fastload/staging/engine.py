"""Choosing the I/O backend for a source."""

from __future__ import annotations

import os
from pathlib import Path

from .. import _core

# statfs(2) magic numbers of network and FUSE file systems (the native table,
# cpp/io/fs.cpp). There io_uring punts every open and uncached read to its kernel
# workers anyway, and a pool of blocking threads keeps more requests in flight for less
# CPU (measured through netsim: see RESULTS.md).
_NETWORK_FS = frozenset(
    magic for magic, (_, network) in _core.file_systems().items() if network
)


def network_fs(path: Path | str) -> bool | None:
    """Whether ``path`` is on a network or FUSE file system (None: cannot tell)."""
    try:
        return _core.fs_type(os.fspath(path)) in _NETWORK_FS
    except OSError:
        return None


def resolve_engine(engine: str, src: Path | None) -> str:
    """``"auto"`` becomes ``"pread"`` for a path on a network file system (the source of a
    tree copy, whose reads go through the engine)."""
    if engine != "auto" or os.environ.get("FASTLOAD_ENGINE") or src is None:
        return engine
    return "pread" if network_fs(src) else engine
