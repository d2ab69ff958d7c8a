"""The I/O backend a job runs, and the file systems under a path.

The rule that turns ``engine="auto"`` into a backend is the native one
(``io::resolve_kind``, cpp/io/engine.hpp): ``FASTLOAD_ENGINE``, the file system under
the path the job names (a network or FUSE one means the pool of pread threads), whether
io_uring can be set up here. Native jobs apply it themselves; ``resolve_engine`` asks it
for a report (``fastload probe``) before any job runs.
"""

from __future__ import annotations

import os
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
