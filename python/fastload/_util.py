"""Small helpers every part may use: the version, sizes (parsed and printed), seeds and
shuffle blocks (checked), checksums, the include/exclude pattern rule, the node lock
beside a path, and atomic JSON writes.

Imports nothing of fastload but errors: it sits below every part but that one (see
``_LAYERS`` in ``fastload/__init__.py``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import numbers
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

from .errors import NotEnoughSpaceError, stage_error

Size = Union[int, float, str]


def version() -> str:
    """The installed distribution's version (one source of truth: pyproject.toml)."""
    # Imported here: importlib.metadata (email, zipfile, ...) costs an import of fastload
    # about 25 ms, and only --version, a User-Agent and fastload.__version__ ask.
    import importlib.metadata

    try:
        return importlib.metadata.version("fastload")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0+unknown"


# --- sizes -----------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Size) -> int:
    """Bytes from ``1000``, ``3e9``, ``"500MB"`` (decimal units: KB, MB, GB, TB) or
    ``"1GiB"`` (binary: KiB, MiB, GiB, TiB)."""
    if isinstance(value, bool):
        raise TypeError("a size must be a number or a string like '1GB'")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = _SIZE.match(str(value))
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m is None or unit is None:
            raise ValueError(f"not a size: {value!r} (use e.g. 1000000, '500MB' or '1GiB')")
        n = int(float(m.group(1)) * unit)
    if n <= 0:
        raise ValueError(f"a size must be positive, not {value!r}")
    return n


def human(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


# --- seeds and shuffle blocks ----------------------------------------------------------
#
# Every order fastload shuffles (pack's, the datasets' epochs) is _core.permutation of
# its seed and other words; these are the one check of what a caller passes for them.

SEED_LIMIT = 1 << 64


def _as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (Python's or numpy's, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def check_seed(value: object, what: str = "seed") -> int:
    """``value`` as an int if it is a seed (or epoch): an integer in ``[0, 2**64)``, bools
    refused; else ValueError naming ``what``."""
    n = _as_int(value)
    if n is None or not 0 <= n < SEED_LIMIT:
        raise ValueError(f"{what} must be a non-negative integer below 2**64, not {value!r}")
    return n


def check_block(value: object, what: str = "shuffle_block") -> int:
    """``value`` as an int if it is a shuffle block (a positive integer); else ValueError
    naming ``what``."""
    n = _as_int(value)
    if n is None or n < 1:
        raise ValueError(f"{what} must be a positive integer, not {value!r}")
    return n


# --- checksums -------------------------------------------------------------------------


def parse_checksum(checksum: str | None) -> tuple[str, str] | None:
    """``"sha256:<hex>"`` -> ``("sha256", "<hex>")``; None stays None."""
    if checksum is None:
        return None
    algo, sep, hexdigest = checksum.partition(":")
    algo = algo.lower()
    if not sep or algo not in ("md5", "sha1", "sha256", "sha512") or not hexdigest:
        raise ValueError(f"checksum must look like 'sha256:<hex>' or 'md5:<hex>', not {checksum!r}")
    return algo, hexdigest.lower()


# --- include and exclude patterns ----------------------------------------------------


def selected(path: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """The staging pattern rule on a relative path or key: ``*`` also matches ``/``; a
    pattern without ``/`` also matches the base name."""

    def hit(pat: str) -> bool:
        if fnmatch.fnmatchcase(path, pat):
            return True
        return "/" not in pat and fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pat)

    if include and not any(hit(p) for p in include):
        return False
    return not any(hit(p) for p in exclude)


# --- locks and atomic files ------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: it cannot be signalled,
    but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.fastload.lock"



def check_space(where: Path, needed: int, doing: str, path: Path) -> None:
    """Raises NotEnoughSpaceError unless ``where``'s file system has ``needed`` bytes free
    (``doing``: "to stage into '...'", what the message says)."""
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise NotEnoughSpaceError(
            f"not enough space {doing}: need {human(needed)}, {human(free)} free on its "
            "file system",
            path=str(path),
            needed=needed,
            free=free,
        )

@contextlib.contextmanager
def node_lock(dst: Path, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Holds an exclusive fcntl lock beside ``dst`` for the duration of the block.

    The lock lives in the destination's parent, which is node-local, so it serialises
    the processes of one node; the kernel drops it when its holder dies, so a waiter
    takes over from a killed stager. Waiting is interruptible (Ctrl-C). The holder
    writes its host and pid into the lock file; a process that has to wait calls
    ``on_wait`` with a line naming them.
    """
    path = lock_path(dst)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise stage_error(
                e.errno or errno.EIO,
                f"cannot use '{dst}': {e.strerror} in '{dst.parent}' (fastload keeps its "
                "lock and manifest beside the destination)",
                str(dst),
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
                on_wait(f"waiting for {holder or 'another process'}, which is staging '{dst}'")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        # The holder before may have removed the file (drop_lock) while this process
        # waited on it: only the file at the path now is the lock.
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        here = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
            break
        os.close(fd)
    try:
        with contextlib.suppress(OSError):
            me = f"process {os.getpid()} on {os.uname().nodename}".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def drop_lock(dst: Path) -> None:
    """Removes the lock file beside ``dst``; called holding it (:func:`node_lock`), by
    a run that leaves nothing there (a waiter then locks the path's new file)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_path(dst))


def pwrite_all(fd: int, data: Any, offset: int, path: str | os.PathLike[str]) -> None:
    """Writes all of ``data`` (a buffer) at ``offset`` of ``fd``, natively, the GIL
    released: the one positional writer of the Python side (cache downloads, object
    staging, fan-out). A failure is a StageError naming ``path``."""
    from . import _core

    _core.pwrite_all(fd, data, offset, os.fspath(path))


def write_json_atomic(path: Path, data: Any) -> None:
    """Writes to a temporary, fsyncs it, renames it over ``path`` and fsyncs the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        # dumps, not dump: only the one-shot encoder is the C one (2x faster on the
        # manifest of 40,000 files, written on the way out of stage()).
        f.write(json.dumps(data, separators=(",", ":")))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# --- columns: strings held as one blob and offsets (the listings of staging and sources)


def pieces(blob: Any, offsets: Sequence[int]) -> Iterator[bytes]:
    """Each piece of ``blob`` between consecutive ``offsets``, as bytes, in order."""
    mv = memoryview(blob)
    start = 0
    for k, end in enumerate(offsets):
        if k:
            yield mv[start:end].tobytes()
        start = end


def strictly_sorted(keys: Iterable[bytes]) -> bool:
    """Whether ``keys`` are in byte order, each once."""
    prev = None
    for key in keys:
        if prev is not None and not prev < key:
            return False
        prev = key
    return True


def folders_of(key: bytes) -> Iterator[bytes]:
    """The folders ``a/b/c`` lies in: ``a``, ``a/b``."""
    at = key.find(b"/")
    while at >= 0:
        yield key[:at]
        at = key.find(b"/", at + 1)


def position(i: Any, n: int) -> int | range:
    """``i`` as a sequence of ``n`` items takes it in ``__getitem__``: the range of a
    slice, else a position in ``0 .. n-1`` (negative ones from the end); IndexError
    outside."""
    if isinstance(i, slice):
        return range(*i.indices(n))
    k = int(i)
    if k < 0:
        k += n
    if not 0 <= k < n:
        raise IndexError(i)
    return k


def usable_cores() -> int:
    """The cores this process may run on (its affinity: ``taskset``, a cgroup's cpuset),
    not the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
