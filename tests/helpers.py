"""Helpers shared by the staging tests: tree builders, tree comparison, child processes.

Imported by the test modules as ``helpers`` (pytest puts ``tests/`` on ``sys.path``
because ``tests/conftest.py`` sits in a directory without ``__init__.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

CHILD_SCRIPT = Path(__file__).with_name("stage_child.py")

# Temporary names staging may leave after an interruption: ".<name>.fl-tmp*".
TMP_MARK = ".fl-tmp"


def is_tmp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


# --------------------------------------------------------------------------------------
# Building trees
# --------------------------------------------------------------------------------------

# A base mtime with a non-zero nanosecond part, so a copy that keeps only microseconds
# (or seconds) is caught.
BASE_MTIME_NS = 1_600_000_000_123_456_789


def set_mtime(path: Path, i: int) -> int:
    mtime = BASE_MTIME_NS + i * 1_000_000_007
    os.utime(path, ns=(mtime, mtime), follow_symlinks=False)
    return mtime


def write_patterned(path: Path, size: int, seed: int) -> None:
    """Writes ``size`` pseudo-random bytes quickly: one random 1 MiB block, each copy
    stamped with its index, so no two stripes are equal and none is all zero."""
    block = memoryview(random.Random(seed).randbytes(MiB))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        done = 0
        i = 0
        while done < size:
            n = min(MiB, size - done)
            parts = [i.to_bytes(8, "little")[:n], block[8:n]] if n > 8 else [block[:n]]
            while parts:
                w = os.writev(fd, parts)
                done += w
                # rare short write: drop what went out and go on with the rest
                while parts and w >= len(parts[0]):
                    w -= len(parts[0])
                    parts.pop(0)
                if parts and w:
                    parts[0] = memoryview(parts[0])[w:]
            i += 1
    finally:
        os.close(fd)


def write_file(
    path: Path, data: bytes, *, mode: int | None = None, mtime_index: int | None = None
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mode is not None:
        os.chmod(path, mode)
    if mtime_index is not None:
        set_mtime(path, mtime_index)


def build_small_files(root: Path, n: int = 3000, *, per_dir: int = 100, seed: int = 0) -> None:
    """``n`` files of 0..16 KiB (about one in twenty empty) spread over sub-directories."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        d = root / f"dir{i // per_dir:03d}"
        if i % per_dir == 0:
            d.mkdir(exist_ok=True)
        size = 0 if rng.random() < 0.05 else rng.randrange(1, 16 * 1024)
        p = d / f"f{i:05d}.dat"
        p.write_bytes(rng.randbytes(size))
        set_mtime(p, i)


# 255-byte names: the longest a Linux file system takes.
LONG_ASCII = "L" * 251 + ".bin"
LONG_UNICODE = "\u00e9" * 127 + "x"  # 127 * 2 + 1 = 255 bytes in UTF-8
UNICODE_DIR = "\u00fcn\u00efc\u00f8d\u00e9"
UNICODE_FILE = "\u65e5\u672c\u8a9e\u30d5\u30a1\u30a4\u30eb.txt"
EMOJI_FILE = "emoji_\U0001f642.bin"
DEEP_LEVELS = 50


def deep_dir(root: Path) -> Path:
    p = root / "deep"
    for i in range(1, DEEP_LEVELS + 1):
        p = p / f"d{i:02d}"
    return p


def build_rich_tree(root: Path) -> None:
    """Every shape staging must keep: empty files, unicode and 255-byte names, 50 levels
    of nesting, a sparse file, relative symlinks to a file and a directory, empty
    directories, odd file modes and a read-only (0o555) directory, ns mtimes."""
    rng = random.Random(42)
    root.mkdir(parents=True)
    k = iter(range(10_000))
    write_file(root / "top.txt", b"top level\n", mtime_index=next(k))
    write_file(root / "data" / "file.bin", rng.randbytes(100 * 1024), mtime_index=next(k))
    # Not a multiple of any page or stripe size.
    write_file(root / "data" / "medium.bin", rng.randbytes(3 * MiB + 123), mtime_index=next(k))
    write_file(root / "empty.txt", b"", mtime_index=next(k))
    write_file(root / "data" / "empty2", b"", mtime_index=next(k))
    write_file(root / UNICODE_DIR / UNICODE_FILE, "\u3053\u3093\u306b\u3061\u306f\n".encode(),
               mtime_index=next(k))
    write_file(root / EMOJI_FILE, rng.randbytes(777), mtime_index=next(k))
    write_file(root / "sp ace 'quote'.txt", b"spaces\n", mtime_index=next(k))
    write_file(root / "long" / LONG_ASCII, rng.randbytes(5000), mtime_index=next(k))
    write_file(root / "long" / LONG_UNICODE, rng.randbytes(300), mtime_index=next(k))
    deep = deep_dir(root)
    write_file(deep / "leaf.txt", b"deep leaf\n", mtime_index=next(k))
    write_file(deep / LONG_ASCII, b"deep and long\n", mtime_index=next(k))

    # Sparse: 16 MiB with three small islands of data.
    sparse = root / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(16 * MiB)
        f.seek(0)
        f.write(rng.randbytes(4096))
        f.seek(8 * MiB + 5)
        f.write(rng.randbytes(4096))
        f.seek(16 * MiB - 100)
        f.write(rng.randbytes(100))
    set_mtime(sparse, next(k))

    # Symlinks whose targets stay inside the tree, all relative.
    os.symlink("data/file.bin", root / "link_to_file")
    os.symlink("data", root / "link_to_dir")
    os.symlink("../top.txt", root / "data" / "up_link")
    os.symlink("../" * DEEP_LEVELS + "top.txt", deep / "link_to_top")

    # Empty directories, one nested in another.
    (root / "empty_dir").mkdir()
    (root / "nested" / "empty" / "inner").mkdir(parents=True)

    # Odd modes.
    write_file(root / "modes" / "rw.bin", b"owner only\n", mode=0o600, mtime_index=next(k))
    write_file(root / "modes" / "exec.sh", b"#!/bin/sh\necho hi\n", mode=0o755,
               mtime_index=next(k))
    write_file(root / "modes" / "ro.txt", b"read only\n", mode=0o444, mtime_index=next(k))
    write_file(root / "modes" / "ro_dir" / "inside.txt", b"in a 0555 dir\n", mode=0o644,
               mtime_index=next(k))
    os.chmod(root / "modes" / "ro_dir", 0o555)
    odd = root / "modes" / "private_dir"
    odd.mkdir()
    os.chmod(odd, 0o700)


# --------------------------------------------------------------------------------------
# Comparing trees
# --------------------------------------------------------------------------------------

CHUNK = 1 * MiB
_ZERO_CHUNK = bytes(CHUNK)


def content_digest(path: Path) -> str:
    """A digest of a regular file's content that does not depend on how it is stored:
    whole-zero 1 MiB chunks (holes or written zeros) are left out, every other chunk is
    hashed with its index. Reads only the allocated parts of sparse files, so a 4 GiB
    file of holes costs nothing."""
    h = hashlib.sha1(usedforsecurity=False)  # identity check, not security
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        h.update(size.to_bytes(8, "little"))
        pos = 0
        last = -1
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break  # only a hole is left
                raise
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            first = max(data // CHUNK, last + 1)
            for idx in range(first, (hole - 1) // CHUNK + 1):
                chunk = os.pread(fd, CHUNK, idx * CHUNK)
                last = idx
                if chunk != (_ZERO_CHUNK if len(chunk) == CHUNK else bytes(len(chunk))):
                    h.update(idx.to_bytes(8, "little"))
                    h.update(chunk)
            pos = max(hole, (last + 1) * CHUNK)
    finally:
        os.close(fd)
    return h.hexdigest()


def describe(path: Path, *, mtimes: bool = True) -> tuple[Any, ...]:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return ("symlink", os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return ("dir", oct(stat.S_IMODE(st.st_mode)))
    if stat.S_ISREG(st.st_mode):
        return (
            "file",
            oct(stat.S_IMODE(st.st_mode)),
            st.st_size,
            st.st_mtime_ns if mtimes else None,
            content_digest(path),
        )
    return ("special", stat.S_IFMT(st.st_mode))


def walk_entries(root: Path) -> dict[str, Path]:
    """Every entry under ``root`` (not ``root`` itself), by POSIX relative path, without
    following symlinks."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        for name in dirnames + filenames:
            p = base / name
            out[p.relative_to(root).as_posix()] = p
    return out


def snapshot(root: Path, *, mtimes: bool = True) -> dict[str, tuple[Any, ...]]:
    return {rel: describe(p, mtimes=mtimes) for rel, p in walk_entries(root).items()}


def assert_same_tree(src: Path, dst: Path, *, mtimes: bool = True) -> None:
    """dst holds exactly src's entries (nothing missing, nothing extra), byte for byte,
    with the same file and directory modes, file mtimes (ns) and symlink targets."""
    a = snapshot(src, mtimes=mtimes)
    b = snapshot(dst, mtimes=mtimes)
    missing = sorted(set(a) - set(b))
    extra = sorted(set(b) - set(a))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    problems = []
    if missing:
        problems.append(f"missing in dst ({len(missing)}): {missing[:10]}")
    if extra:
        problems.append(f"extra in dst ({len(extra)}): {extra[:10]}")
    for k in differ[:10]:
        problems.append(f"differs: {k!r}: src={a[k]} dst={b[k]}")
    if len(differ) > 10:
        problems.append(f"... and {len(differ) - 10} more differing entries")
    assert not problems, "trees differ:\n  " + "\n  ".join(problems)
    assert stat.S_IMODE(os.stat(src).st_mode) == stat.S_IMODE(os.stat(dst).st_mode), (
        "root directory mode differs"
    )


def assert_same_file(src: Path, dst: Path) -> None:
    assert describe(dst) == describe(src)


def assert_no_partial_files(
    src: Path, dst: Path, *, also_ok: dict[str, set[str]] | None = None
) -> int:
    """After an interruption: every entry at a final path in dst is a real entry of src
    and every regular file there is complete (same size and bytes). Temporary names are
    allowed. ``also_ok`` maps a relative path to other content digests accepted for it
    (e.g. the version of a file before the test changed it). Returns how many complete
    files are at final paths."""
    if not dst.exists():
        return 0
    complete = 0
    for rel, p in walk_entries(dst).items():
        if is_tmp_name(p.name):
            assert p.is_file(), f"temporary entry {rel!r} is not a regular file"
            continue
        if also_ok and rel in also_ok:
            assert content_digest(p) in also_ok[rel] | {content_digest(src / rel)}, (
                f"{rel!r} at its final path is neither the old nor the new content"
            )
            continue
        s = src / rel
        assert os.path.lexists(s), f"{rel!r} is in dst but not in src"
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            assert s.is_file() and not s.is_symlink(), f"{rel!r} is a file in dst only"
            assert st.st_size == os.lstat(s).st_size, f"{rel!r} at its final path is partial"
            assert content_digest(p) == content_digest(s), f"{rel!r} at its final path differs"
            complete += 1
        elif stat.S_ISLNK(st.st_mode):
            assert os.readlink(p) == os.readlink(s), f"symlink {rel!r} has a wrong target"
        elif stat.S_ISDIR(st.st_mode):
            assert s.is_dir() and not s.is_symlink(), f"{rel!r} is a directory in dst only"
        else:
            raise AssertionError(f"{rel!r} in dst is a special file")
    return complete


def tmp_leftovers(root: Path) -> list[str]:
    return sorted(rel for rel, p in walk_entries(root).items() if TMP_MARK in p.name)


def regular_files(root: Path) -> dict[str, int]:
    """rel path -> size of every regular file (symlinks not followed)."""
    return {rel: os.lstat(p).st_size for rel, p in walk_entries(root).items()
            if stat.S_ISREG(os.lstat(p).st_mode)}


def allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


# --------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------


def mentions_size(message: str, n: int) -> bool:
    """Whether a message states the byte count ``n`` in some usual form: raw, with
    thousands separators, or scaled to K/M/G (binary or decimal) with 0-2 decimals."""
    if str(n) in message or f"{n:,}" in message:
        return True
    for unit in (1000, 1024, 1000**2, 1024**2, 1000**3, 1024**3):
        for digits in (0, 1, 2):
            scaled = f"{n / unit:.{digits}f}"
            if scaled != "0" and scaled.strip("0.") and scaled in message:
                return True
    return False


# --------------------------------------------------------------------------------------
# Child processes running one stage() call (tests/stage_child.py)
# --------------------------------------------------------------------------------------


@dataclass
class Child:
    """A ``python tests/stage_child.py`` process; its stdout is parsed as it arrives."""

    spec: dict[str, Any]
    env: dict[str, str] | None = None
    as_user: int | None = None
    wrapper: list[str] = field(default_factory=list)  # e.g. setpriv ... --
    stdin: bool = False
    lines: list[str] = field(default_factory=list)
    stderr: str = ""

    def __post_init__(self) -> None:
        kwargs: dict[str, Any] = {}
        if self.as_user is not None:
            kwargs.update(user=self.as_user, group=self.as_user, extra_groups=[])
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, str(CHILD_SCRIPT), json.dumps(self.spec)],
            stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd="/",
            text=True,
            encoding="utf-8",
            errors="replace",
            **kwargs,
        )
        self._cond = threading.Condition()
        self._eof = False
        self._err_parts: list[str] = []
        self._t_out = threading.Thread(target=self._read_out, daemon=True)
        self._t_err = threading.Thread(target=self._read_err, daemon=True)
        self._t_out.start()
        self._t_err.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for chunk in iter(lambda: self.proc.stderr.read(4096), ""):  # type: ignore[union-attr]
            self._err_parts.append(chunk)

    def wait_line(self, prefix: str, timeout: float = 120.0) -> str | None:
        """Waits for a stdout line starting with ``prefix``; None if the child's stdout
        closed (it exited) first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if line.startswith(prefix):
                        return line
                seen = len(self.lines)
                if self._eof:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"child printed no {prefix!r} line in {timeout} s")
                self._cond.wait(left)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 180.0) -> Child:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # a child still waiting for "go" goes on
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._join()
            raise AssertionError(
                f"child did not finish within {timeout} s (killed); stderr:\n{self.stderr}"
            ) from None
        self._join()
        return self

    def _join(self) -> None:
        self._t_out.join()
        self._t_err.join()
        for pipe in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if pipe is not None and not pipe.closed:
                pipe.close()
        self.stderr = "".join(self._err_parts)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def _tagged(self, tag: str) -> dict[str, Any] | None:
        for line in self.lines:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        return None

    @property
    def result(self) -> dict[str, Any] | None:
        return self._tagged("RESULT")

    @property
    def error(self) -> dict[str, Any] | None:
        return self._tagged("ERROR")

    @property
    def progress(self) -> list[tuple[int, int, int, int]]:
        out = []
        for line in self.lines:
            if line.startswith("PROGRESS "):
                a, b, c, d = (int(x) for x in line.split()[1:])
                out.append((a, b, c, d))
        return out

    def expect_result(self) -> dict[str, Any]:
        res = self.result
        assert self.returncode == 0 and res is not None, (
            f"child failed (rc={self.returncode}): error={self.error}\nstderr:\n{self.stderr}"
        )
        return res

    def expect_error(self) -> dict[str, Any]:
        err = self.error
        assert err is not None, (
            f"child did not raise (rc={self.returncode}, result={self.result})\n"
            f"stderr:\n{self.stderr}"
        )
        return err


def stage_spec(src: Path, dst: Path, **kwargs: Any) -> dict[str, Any]:
    return {"op": "stage", "src": str(src), "dst": str(dst), "kwargs": kwargs}


def run_child(spec: dict[str, Any], *, timeout: float = 180.0, **kw: Any) -> Child:
    return Child(spec, **kw).finish(timeout)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FASTLOAD_FAULTS"}
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --------------------------------------------------------------------------------------
# tmpfs size changes without a fork (fast enough to race a copy)
# --------------------------------------------------------------------------------------

_MS_REMOUNT = 32


def remount_tmpfs_size(path: Path, size: int) -> int:
    """Changes a tmpfs's size limit in place. Returns 0 or an errno (EINVAL when the new
    limit is below what the tmpfs already holds)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    rc = libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_REMOUNT,
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


def make_world_readable(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                st = os.stat(p)
                os.chmod(p, stat.S_IMODE(st.st_mode) | 0o044 | (0o011 if p.is_dir() else 0))
    os.chmod(root, stat.S_IMODE(os.stat(root).st_mode) | 0o055)


def _wait_until_settled(mount: Path) -> None:
    """Waits until the use of ``mount`` stops changing (I/O already in the kernel when
    the writer was stopped completes)."""
    last = -1
    for _ in range(200):
        st = os.statvfs(mount)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        if used == last:
            return
        last = used
        time.sleep(0.02)


def _enter_realtime() -> Any:
    """Makes the calling thread SCHED_FIFO (needs root); returns what to restore, or None."""
    try:
        old = (os.sched_getscheduler(0), os.sched_getparam(0))
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(10))
    except (OSError, AttributeError):
        return None
    return old


def run_child_with_trigger(
    spec: dict[str, Any], mount: Path, action: Any, *, threshold: int = 512 * 1024,
    timeout: float = 180.0,
) -> tuple[Child, bool]:
    """Runs a stage child and, from this process, calls ``action`` once as soon as the
    file system at ``mount`` holds ``threshold`` more bytes than before: i.e. once the
    child passed its space check and is writing data. Returns the finished child and
    whether the action ran while the child was still running.

    The watching thread runs real-time (SCHED_FIFO, polling every ~100 us) so the
    child's copy threads cannot starve it on a small, busy machine; without the right
    to do so it busy-polls and the child runs at a lower priority."""
    st = os.statvfs(mount)
    base = (st.f_blocks - st.f_bfree) * st.f_frsize
    probe = _enter_realtime()
    if probe is not None:
        os.sched_setscheduler(0, *probe)
    wrapper = [] if probe is not None else ["nice", "-n", "10"]
    child = Child(spec, env=child_env(), wrapper=wrapper)
    fired = False
    deadline = time.monotonic() + timeout
    restore = _enter_realtime()
    try:
        while child.proc.poll() is None and time.monotonic() < deadline:
            st = os.statvfs(mount)
            if (st.f_blocks - st.f_bfree) * st.f_frsize - base >= threshold:
                # Freeze the child while acting, so the action is not a race with a
                # copy that moves at GB/s. (A stop and continue may make some blocking
                # system calls return EINTR: the engine must cope with that anyway.)
                os.kill(child.proc.pid, signal.SIGSTOP)
                try:
                    _wait_until_settled(mount)
                    action()
                finally:
                    os.kill(child.proc.pid, signal.SIGCONT)
                fired = True
                break
            if restore is not None:
                time.sleep(0.0001)
    finally:
        if restore is not None:
            os.sched_setscheduler(0, *restore)
    return child.finish(timeout), fired
