"""File systems under the tests: allocated blocks, permissions, tmpfs size limits changed
in place (fast enough to race a copy), the page cache, O_DIRECT, and how a message about
space states a size.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from kit.tools import missing
from kit.trees import MiB

# --------------------------------------------------------------------------------------
# Blocks and permissions
# --------------------------------------------------------------------------------------


def allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def make_world_readable(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                st = os.stat(p)
                os.chmod(p, stat.S_IMODE(st.st_mode) | 0o044 | (0o011 if p.is_dir() else 0))
    os.chmod(root, stat.S_IMODE(os.stat(root).st_mode) | 0o055)


# --------------------------------------------------------------------------------------
# tmpfs size changes without a fork (fast enough to race a copy)
# --------------------------------------------------------------------------------------


_MS_REMOUNT = 32


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def remount_tmpfs_size(path: Path, size: int) -> int:
    """Changes a tmpfs's size limit in place. Returns 0 or an errno (EINVAL when the new
    limit is below what the tmpfs already holds)."""
    rc = _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_REMOUNT,
                    f"size={size}".encode())
    return 0 if rc == 0 else ctypes.get_errno()


def shrink_tmpfs_to_used(mount: Path) -> None:
    """Lowers a tmpfs's size limit to a little above what it holds now. A remount below
    the current use fails (EINVAL) and a copy may be filling the tmpfs fast, so the
    headroom starts at 4 MiB and doubles until a remount succeeds."""
    slack = MiB
    for _ in range(20):
        st = os.statvfs(mount)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        if remount_tmpfs_size(mount, used + slack) == 0:
            return
        slack *= 2
    raise AssertionError(f"could not shrink the tmpfs at {mount}")


# --------------------------------------------------------------------------------------
# The page cache and O_DIRECT
# --------------------------------------------------------------------------------------


def cached(path: Path, offset: int = 0, length: int | None = None) -> int:
    """Bytes of the range of ``path`` in the page cache (reads nothing)."""
    from fastload import _core

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        return _core.cached_bytes(fd, offset, size - offset if length is None else length)
    finally:
        os.close(fd)


@contextlib.contextmanager
def resident(path: Path) -> Iterator[None]:
    """``path``'s pages read into the page cache and held there meanwhile (mapped and
    locked with mlock): a test that needs an archive cached is not undone by memory
    pressure from what runs beside it (the sanitized pass beside the benchmarks)."""
    libc = _libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mlock.argtypes = libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path}: {os.strerror(err)}")
        try:
            if libc.mlock(addr, size) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mlock of {path}: {os.strerror(err)}")
            yield
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop(path: Path) -> None:
    """Evicts ``path`` from the page cache; skips where the file system keeps it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached(path):
        missing(f"clean pages of {path} stay cached here (tmpfs?)")


def direct_capable(directory: Path) -> bool:
    """Whether a file in ``directory`` takes an O_DIRECT write of one aligned page."""
    path = directory / ".direct-probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


# --------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
# A number standing alone (not part of a word, a path or a longer number), with the unit
# that follows it, if any.
_QUANTITY = re.compile(
    r"(?<![\w./-])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:\s*(bytes|byte|B|KiB|MiB|GiB|TiB|"
    r"kB|KB|MB|GB|TB|K|M|G|T)\b)?(?![\w/]|\.\d)"
)
_UNITS = {
    "KiB": (1024,), "MiB": (1024**2,), "GiB": (1024**3,), "TiB": (1024**4,),
    "kB": (1000,), "KB": (1000, 1024), "MB": (1000**2, 1024**2), "GB": (1000**3, 1024**3),
    "TB": (1000**4, 1024**4), "K": (1000, 1024), "M": (1000**2, 1024**2),
    "G": (1000**3, 1024**3), "T": (1000**4, 1024**4),
}


def mentions_size(message: str, n: int) -> bool:
    """Whether a message states the byte count ``n`` as a quantity of its own: the raw
    count (with or without thousands separators, "bytes" or "B"), or scaled to a unit
    (K/M/G/T, binary or decimal) and rounded to the decimals shown. Quoted text (paths)
    and numbers inside words, paths or longer numbers do not count."""
    text = _QUOTED.sub(" ", message)
    for m in _QUANTITY.finditer(text):
        whole, decimals, unit = m.group(1).replace(",", ""), m.group(2), m.group(3)
        if unit is None or unit in ("bytes", "byte", "B"):
            if decimals is None and int(whole) == n:
                return True
            continue
        shown = whole + ("." + decimals if decimals else "")
        digits = len(decimals or "")
        if any(f"{n / scale:.{digits}f}" == shown for scale in _UNITS[unit]):
            return True
    return False


def objects_until_full(mnt: Path, mode: int) -> tuple[list[tuple[str, bytes, int]], list[int]]:
    """Six bodies of 300 KB written by one ``_core.write_objects`` call into ``mnt``, a
    1 MiB file system: ``(items, failed)``, the indices that failed. Checks that some
    did, each with ENOSPC naming its final path and nothing at that path, and that the
    others are whole."""
    import errno
    import random

    from fastload import _core

    rng = random.Random(9)
    items = [(f"f{k}.bin", rng.randbytes(300_000), 0) for k in range(6)]
    got = _core.write_objects(mnt, items, mode, 1 << 20)
    failed = [k for k, r in enumerate(got) if isinstance(r, OSError)]
    assert failed, "6 x 300 KB fit in a 1 MiB file system"
    for k, r in enumerate(got):
        path = mnt / items[k][0]
        if k in failed:
            assert isinstance(r, OSError) and r.errno == errno.ENOSPC, r
            assert str(path) in str(r)
            assert not path.exists()
        else:
            assert path.read_bytes() == items[k][1]
    return items, failed
