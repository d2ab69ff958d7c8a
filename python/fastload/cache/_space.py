"""The room of a cache: its own files (counted against the limit beside the shards),
what shows that its readers make progress, and the error of a reader that finds none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from .._util import human
from ..errors import stage_error
from . import _holders

__all__ = ["LOG_MAX", "SLACK", "no_room", "overhead", "progress", "slack"]

#: The event log (``state/events.log``) is moved aside to ``events.log.1`` past this
#: size (replacing the one before).
LOG_MAX = 64 << 10
#: Room kept free beside each reservation for the small files that change outside the
#: cache lock between two scans (a line of the log, a pin record, a listing rewritten):
#: this much, or a 64th of a smaller limit (:func:`slack`).
SLACK = 4 << 10


def slack(limit: int | None) -> int:
    return 0 if limit is None else min(SLACK, limit // 64)


def _regular_bytes(folder: str, seen: set[int]) -> int:
    """Bytes of the regular files under ``folder`` (symbolic links are not followed:
    the view's links to entries hold no data), each inode once."""
    total = 0
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(folder) as it:
        for d in it:
            if d.is_symlink():
                continue
            if d.is_dir(follow_symlinks=False):
                total += _regular_bytes(d.path, seen)
                continue
            with contextlib.suppress(FileNotFoundError):
                st = d.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
    return total


def overhead(root: Path) -> int:
    """Bytes of the cache's own files under ``root``: the views (indexes, and an index
    being written, reserved at its size), the listings, the event log and the pin
    records (the lock files of ``state/`` are empty)."""
    seen: set[int] = set()
    total = 0
    for folder in ("views", "listings", "state/held"):
        total += _regular_bytes(os.fspath(root / folder), seen)
    for name in ("events.log", "events.log.1"):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(root / "state" / name).st_size
    return total


def progress(shards: Path) -> object:
    """What changes while readers make progress: the entries with their sizes and
    times (a pin sets the time, a download or an eviction changes the list); None while
    a download is in progress (it ends, or fails, by itself). With the cache lock held,
    after a scan (which removed the downloads of dead processes)."""
    out = []
    with os.scandir(shards) as it:
        for d in it:
            if d.name.endswith(".part"):
                return None
            with contextlib.suppress(FileNotFoundError):
                st = d.stat()
                out.append((d.name, st.st_size, st.st_mtime_ns))
    return sorted(out)


def no_room(root: Path, limit: int | None, url: str, size: int, waited: float) -> OSError:
    """The error of a reader that found no room for ``url`` while nothing changed in the
    cache for ``waited`` seconds: which process holds which entry, for which dataset."""
    sizes = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(root / "shards") as it:
        for d in it:
            with contextlib.suppress(FileNotFoundError):
                sizes[d.name] = d.stat().st_size
    held = [f"pid {pid} ({label or 'a reader'}) holds "
            f"'{name.split('-', 2)[-1]}' ({human(sizes.get(name, 0))})"
            for pid, name, label in _holders.holders(root)]
    return stage_error(
        errno.ENOSPC,
        f"cache '{root}' (limit {human(limit or 0)}) had no room for '{url}' "
        f"({human(size)}) and nothing changed in it for {waited:g} s (FASTLOAD_CACHE_WAIT): "
        "its readers need more room at once than the limit; "
        f"{'; '.join(held) or 'no live reader records a pin'}: raise cache_limit, or read "
        "fewer datasets or workers through this cache at once",
        url,
    )
