"""Choosing the I/O backend for a source."""

from __future__ import annotations

import os
from pathlib import Path

from .. import _core

# statfs(2) magic numbers of network and FUSE file systems. There io_uring punts every
# open and uncached read to its kernel workers anyway, and a pool of blocking threads
# keeps more requests in flight for less CPU (measured through netsim: see RESULTS.md).
_NETWORK_FS = {
    0x6969,  # NFS
    0x65735546,  # FUSE (sshfs, gcsfuse, s3fs, netsim, ...)
    0x0BD00BD0,  # Lustre
    0x47504653,  # GPFS / Spectrum Scale
    0xFF534D42,  # CIFS
    0xFE534D42,  # SMB2
    0x00C36400,  # CephFS
    0x19830326,  # BeeGFS
    0x01021997,  # 9p
    0x5346414F,  # AFS
    0x013111A8,  # IBRIX
    0xAAD7AAEA,  # PanFS
}


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
