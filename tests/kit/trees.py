"""Trees on disk: building the source trees the tests stage, archive and pack (every
shape staging must keep), and comparing two trees entry by entry (bytes, modes, ns
mtimes, symlink targets, hard links), including after an interruption.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import stat
from pathlib import Path
from typing import Any

RWS_FILES = 1200  # the read-while-staging tests' tree (tests/staging/conftest.py)

MiB = 1 << 20
GiB = 1 << 30

# Temporary names staging may leave after an interruption: ".<name>.fl-tmp*".
TMP_MARK = ".fl-tmp"


def is_tmp_name(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name



def leave_interrupted_run(dst: Path, names: list[str], stale: bytes) -> None:
    """What a killed run leaves in ``dst`` for the files ``names`` (relative paths, their
    folders made): ``stale`` under the temporary name of every other one, and an older
    copy at the final name of every third one from the second, each of mode 0600."""
    for rel in names[::2]:
        p = dst / rel
        tmp = p.with_name(f".{p.name}{TMP_MARK}")
        tmp.write_bytes(stale)
        tmp.chmod(0o600)
    for rel in names[1::3]:
        (dst / rel).write_bytes(b"old copy")
        (dst / rel).chmod(0o600)

def files_at_final_names(root: Path) -> int:
    """How many regular files under ``root`` have a final (not a temporary) name: what a
    writer that names a file only once it is whole has finished. Cheap enough to poll."""
    n = 0
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))
            elif e.is_file(follow_symlinks=False) and not is_tmp_name(e.name):
                n += 1
    return n

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

# 151 bytes, splittable at '/' into ustar prefix (60) and name (90).
USTAR_PREFIX_PATH = "p" * 60 + "/" + "q" * 86 + ".bin"
DEEP_LONG_DIR = "long/" + "/".join(["d" * 50] * 6)  # a path over 255 bytes
LONG_LINK_TARGET = "../" + DEEP_LONG_DIR + "/leaf.txt"  # > 100 bytes, stays inside


def build_archive_tree(root: Path, *, long: bool = True, seed: int = 11) -> Path:
    """The shapes extraction must reproduce: sizes around block boundaries, unicode,
    spaces, a path needing the ustar prefix field, relative symlinks (to a file, a
    directory, "." and ".."), hard links, empty directories, odd modes and a 0o555
    directory, mtimes with a nanosecond part. ``long`` adds what only GNU and pax can
    hold: a 255-byte name, a path over 255 bytes, a symlink target over 100 bytes and
    hard links with long names and long targets."""
    import random

    rng = random.Random(seed)
    root.mkdir(parents=True)
    k = iter(range(1000))

    def w(rel: str, data: bytes, mode: int = 0o644) -> None:
        write_file(root / rel, data, mode=mode)

    w("top.txt", b"top level\n")
    w("empty.bin", b"")
    for n in (1, 511, 512, 513, 100 * 1024 + 7, MiB + 123):
        w(f"sizes/b{n}", rng.randbytes(n))
    w(f"{UNICODE_DIR}/{UNICODE_FILE}", "\u3053\u3093\u306b\u3061\u306f\n".encode())
    w(EMOJI_FILE, rng.randbytes(777))
    w("sp ace 'quote'.txt", b"spaces\n")
    w(USTAR_PREFIX_PATH, rng.randbytes(3000))
    os.makedirs(root / "links")
    os.symlink("../top.txt", root / "links" / "to_file")
    os.symlink("../sizes", root / "links" / "to_dir")
    os.symlink(".", root / "links" / "dot")
    os.symlink("..", root / "links" / "up")
    os.symlink("missing/target", root / "links" / "dangling")
    w("hard/a.bin", rng.randbytes(4000))
    os.link(root / "hard" / "a.bin", root / "hard" / "b.bin")
    os.makedirs(root / "other")
    os.link(root / "hard" / "a.bin", root / "other" / "c.bin")
    (root / "empty_dir").mkdir()
    (root / "nested" / "empty" / "inner").mkdir(parents=True)
    w("modes/rw.bin", b"owner only\n", 0o600)
    w("modes/exec.sh", b"#!/bin/sh\necho hi\n", 0o755)
    w("modes/ro.txt", b"read only\n", 0o444)
    w("modes/ro_dir/inside.txt", b"in a 0555 dir\n")
    (root / "modes" / "private_dir").mkdir()
    if long:
        w(f"long/{LONG_ASCII}", rng.randbytes(5000))
        w(f"{DEEP_LONG_DIR}/leaf.txt", b"deep and long\n")
        os.symlink(LONG_LINK_TARGET, root / "links" / ("t" * 120))
        os.link(root / "hard" / "a.bin", root / "long" / ("h" * 200 + ".hl"))
        # Sorted after long/, so its member is a hard link with a target over 100 bytes.
        w(f"{DEEP_LONG_DIR}/target.bin", rng.randbytes(600))
        os.makedirs(root / "zz")
        os.link(root / DEEP_LONG_DIR / "target.bin", root / "zz" / "to_long")
    # Times last (creating entries changes directory mtimes), deepest first.
    entries = sorted(walk_entries(root).items(), key=lambda kv: -kv[0].count("/"))
    for _rel, p in entries:
        if not p.is_symlink():
            set_mtime(p, next(k))
    os.chmod(root / "modes" / "ro_dir", 0o555)
    os.chmod(root / "modes" / "private_dir", 0o700)
    return root


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


def differences(a: dict[str, Any], b: dict[str, Any], *, names: tuple[str, str] = ("src", "dst")
                ) -> list[str]:
    """What differs between two descriptions of trees (relative path -> entry), entry by
    entry: missing in the second, extra in the second, and (the first ten) different."""
    missing = sorted(set(a) - set(b))
    extra = sorted(set(b) - set(a))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    problems = []
    if missing:
        problems.append(f"missing in dst ({len(missing)}): {missing[:10]}")
    if extra:
        problems.append(f"extra in dst ({len(extra)}): {extra[:10]}")
    for k in differ[:10]:
        problems.append(f"differs: {k!r}: {names[0]}={a[k]} {names[1]}={b[k]}")
    if len(differ) > 10:
        problems.append(f"... and {len(differ) - 10} more differing entries")
    return problems


def assert_same_tree(src: Path, dst: Path, *, mtimes: bool = True) -> None:
    """dst holds exactly src's entries (nothing missing, nothing extra), byte for byte,
    with the same file and directory modes, file mtimes (ns) and symlink targets."""
    problems = differences(snapshot(src, mtimes=mtimes), snapshot(dst, mtimes=mtimes))
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


def assert_no_tmp(dst: Path) -> None:
    assert tmp_leftovers(dst) == []


def regular_files(root: Path) -> dict[str, int]:
    """rel path -> size of every regular file (symlinks not followed)."""
    return {rel: os.lstat(p).st_size for rel, p in walk_entries(root).items()
            if stat.S_ISREG(os.lstat(p).st_mode)}


def hardlink_groups(root: Path) -> set[frozenset[str]]:
    """Sets of paths (relative) sharing one inode, for inodes with more than one path."""
    by_inode: dict[tuple[int, int], set[str]] = {}
    for rel, p in walk_entries(root).items():
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            by_inode.setdefault((st.st_dev, st.st_ino), set()).add(rel)
    return {frozenset(v) for v in by_inode.values() if len(v) > 1}
