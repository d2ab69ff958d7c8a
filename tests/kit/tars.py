"""Tar archives: making them with GNU tar and Python's tarfile (plain, gzip, zstd, hand-made
members, patched header bytes), GNU tar's own extraction as the reference and comparing an
extracted tree with it, the include/exclude glob rules, and checking that a hostile archive
wrote nothing outside its destination.
"""

from __future__ import annotations

import fnmatch
import gzip
import importlib.util
import io
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit import trees
from kit.tools import missing

# --------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------


GNU_FORMATS = ("gnu", "posix", "ustar")  # tar --format=...
PY_FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}


def _gnu_tar() -> str | None:
    exe = shutil.which("tar")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    return exe if "GNU tar" in out.stdout else None

GNU_TAR = _gnu_tar()
ZSTD_CLI = shutil.which("zstd")
HAVE_ZSTANDARD = importlib.util.find_spec("zstandard") is not None
HAVE_ZSTD = bool(ZSTD_CLI) or HAVE_ZSTANDARD
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"


def need_gnu_tar() -> str:
    if GNU_TAR is None:
        missing("GNU tar is not installed (apt-get install tar)")
    return GNU_TAR


def need_zstd() -> None:
    if not HAVE_ZSTD:
        missing("neither the zstd CLI nor the zstandard package is available "
                "(apt-get install zstd)")


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    p = subprocess.run(cmd, capture_output=True, check=False, **kw)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}): {p.stderr.decode(errors='replace')}"
    return p


# --------------------------------------------------------------------------------------
# Making archives
# --------------------------------------------------------------------------------------


def gnu_create(src: Path, archive: Path, fmt: str, *, dot: bool = True,
               extra: Iterable[str] = ()) -> Path:
    """``tar --format=FMT -C src -cf archive .`` (or the top-level names, ``dot=False``)."""
    tar = need_gnu_tar()
    archive.parent.mkdir(parents=True, exist_ok=True)
    names = ["."] if dot else sorted(os.listdir(src))
    run([tar, f"--format={fmt}", "--sort=name", "-C", str(src), "-cf", str(archive),
         *extra, *names])
    return archive


def py_create(src: Path, archive: Path, fmt: str, *, pax_global: bool = False) -> Path:
    """Python tarfile in USTAR/GNU/PAX format, the top-level names as members (no "./").
    ``pax_global`` adds a pax global header (PAX only)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    kw: dict[str, Any] = {}
    if pax_global:
        kw["pax_headers"] = {"comment": "fastload test archive"}
    with tarfile.open(archive, "w", format=PY_FORMATS[fmt], **kw) as tf:
        for name in sorted(os.listdir(src)):
            tf.add(src / name, arcname=name)
    return archive


def members_archive(archive: Path, members: Iterable[tuple[tarfile.TarInfo, bytes | None]],
                    fmt: int = tarfile.GNU_FORMAT, **kw: Any) -> Path:
    """An archive of hand-made members (TarInfo, data or None)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w", format=fmt, **kw) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
    return archive


def tinfo(name: str, kind: bytes = tarfile.REGTYPE, *, linkname: str = "",
          mode: int | None = None, mtime: int = 1_650_000_000,
          pax: dict[str, str] | None = None) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    ti.mode = mode if mode is not None else 0o755 if kind == tarfile.DIRTYPE else 0o644
    ti.mtime = mtime
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    if pax:
        ti.pax_headers = dict(pax)
    return ti


def gzip_file(src: Path, dst: Path, *, members: int = 1) -> Path:
    """Python gzip; ``members`` > 1 splits the data into that many concatenated gzip
    members (what bgzip and ``cat a.gz b.gz`` make)."""
    data = src.read_bytes()
    step = -(-len(data) // members)
    with open(dst, "wb") as f:
        for i in range(members):
            f.write(gzip.compress(data[i * step:(i + 1) * step], mtime=0))
    return dst


def zstd_file(src: Path, dst: Path, *, frames: int = 1) -> Path:
    """zstd CLI (or the zstandard package); ``frames`` > 1 concatenates that many frames."""
    need_zstd()
    data = src.read_bytes()
    step = -(-len(data) // frames)
    parts = []
    for i in range(frames):
        piece = data[i * step:(i + 1) * step]
        if ZSTD_CLI:
            parts.append(run([ZSTD_CLI, "-q", "-c", "-3"], input=piece).stdout)
        else:
            import zstandard

            parts.append(zstandard.ZstdCompressor(level=3).compress(piece))
    dst.write_bytes(b"".join(parts))
    return dst


def tar_bytes(archive: Path) -> bytes:
    """The uncompressed tar stream of a (small) archive, whatever its compression."""
    data = archive.read_bytes()
    if data.startswith(GZIP_MAGIC):
        return gzip.decompress(data)
    if data.startswith(ZSTD_MAGIC):
        if ZSTD_CLI:
            return run([ZSTD_CLI, "-q", "-d", "-c"], input=data).stdout
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(data), read_across_frames=True).read()
    return data


def open_tar(archive: Path) -> tarfile.TarFile:
    return tarfile.open(fileobj=io.BytesIO(tar_bytes(archive)), mode="r:")


# --------------------------------------------------------------------------------------
# Reference extraction (GNU tar)
# --------------------------------------------------------------------------------------


def gnu_extract(archive: Path, ref: Path) -> Path:
    """GNU tar's own extraction, as root with ``--no-same-owner`` (modes kept)."""
    tar = need_gnu_tar()
    ref.mkdir(parents=True, exist_ok=True)
    run([tar, "-xf", str(archive), "-C", str(ref), "--no-same-owner"])
    return ref


def gnu_extract_nested(archive: Path, ref: Path) -> tuple[Path, set[str]]:
    """The way users unpack a tar of tars: extract the outer archive, then each inner
    ``X.tar`` into ``X/`` and delete it. Returns (ref, the directories made for inner
    tars, relative)."""
    gnu_extract(archive, ref)
    made: set[str] = set()
    for rel, p in sorted(trees.walk_entries(ref).items()):
        if rel.endswith(".tar") and p.is_file() and not p.is_symlink():
            d = p.with_name(p.name[: -len(".tar")])
            # The loop changes the parent's mtime; keep the one GNU tar set from the
            # archive, which is what a one-pass extraction reproduces.
            parent = os.stat(p.parent)
            gnu_extract(p, d)
            p.unlink()
            os.utime(p.parent, ns=(parent.st_atime_ns, parent.st_mtime_ns))
            made.add(rel[: -len(".tar")])
    return ref, made


def _norm(name: str) -> str:
    parts = [x for x in name.split("/") if x not in ("", ".")]
    return "/".join(parts)


def explicit_dirs(archive: Path, *, nested: bool = False) -> set[str]:
    """Directories that are members of the archive (and, ``nested``, of its inner tars,
    under the inner tar's directory): their mtimes are GNU tar's to reproduce."""
    out: set[str] = set()
    with open_tar(archive) as tf:
        for m in tf:
            name = _norm(m.name)
            if m.isdir():
                out.add(name)
            elif nested and m.isfile() and name.endswith(".tar"):
                f = tf.extractfile(m)
                assert f is not None
                inner = io.BytesIO(f.read())
                base = name[: -len(".tar")]
                with tarfile.open(fileobj=inner, mode="r:") as itf:
                    for im in itf:
                        if im.isdir():
                            out.add(_norm(f"{base}/{im.name}"))
    out.discard("")
    return out


def member_totals(archive: Path) -> tuple[int, int]:
    """(regular-file members, their total size): hard links not counted."""
    n = size = 0
    with open_tar(archive) as tf:
        for m in tf:
            if m.isreg():
                n += 1
                size += m.size
    return n, size


def has_hardlinks(archive: Path) -> bool:
    with open_tar(archive) as tf:
        return any(m.islnk() for m in tf)


# --------------------------------------------------------------------------------------
# Comparing an extraction with the reference
# --------------------------------------------------------------------------------------


def data_extents(path: Path) -> list[tuple[int, int]]:
    """The data runs of a file, as SEEK_DATA/SEEK_HOLE see them (the holes between)."""
    out = []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break  # only a hole is left
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, end))
            pos = end
    finally:
        os.close(fd)
    return out


def _entry(p: Path, rel: str, explicit: set[str], skip_meta: set[str],
           holes: bool = False) -> tuple[Any, ...]:
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        return ("symlink", os.readlink(p))
    if stat.S_ISDIR(st.st_mode):
        if rel in skip_meta:
            return ("dir",)
        mtime = st.st_mtime_ns // 1_000_000_000 if rel in explicit else None
        return ("dir", oct(stat.S_IMODE(st.st_mode)), mtime)
    if stat.S_ISREG(st.st_mode):
        return ("file", oct(stat.S_IMODE(st.st_mode)), st.st_size,
                st.st_mtime_ns // 1_000_000_000, trees.content_digest(p),
                *([data_extents(p)] if holes else []))
    return ("special", stat.S_IFMT(st.st_mode))


def extraction_state(root: Path, *, explicit: Iterable[str] = (),
                     skip_meta: Iterable[str] = (), holes: bool = False
                     ) -> dict[str, tuple[Any, ...]]:
    ex, sk = set(explicit), set(skip_meta)
    return {rel: _entry(p, rel, ex, sk, holes)
            for rel, p in trees.walk_entries(root).items()}


def assert_same_extraction(ref: Path, dst: Path, *, explicit: Iterable[str] = (),
                           skip_meta: Iterable[str] = (), holes: bool = False) -> None:
    """dst holds exactly ref's entries: bytes, file and directory modes, file mtimes and
    those of directories that were archive members (1 s resolution), symlink targets,
    and the same hard-link groups. ``skip_meta``: directories whose mode and mtime are
    not compared (the ones made for inner tars). ``holes``: files also have the same
    holes (SEEK_HOLE), for archives of sparse members extracted on one file system."""
    a = extraction_state(ref, explicit=explicit, skip_meta=skip_meta, holes=holes)
    b = extraction_state(dst, explicit=explicit, skip_meta=skip_meta, holes=holes)
    problems = trees.differences(a, b, names=("gnu tar", "fastload"))
    ga, gb = trees.hardlink_groups(ref), trees.hardlink_groups(dst)
    if ga != gb:
        problems.append(f"hard links differ: gnu tar={sorted(map(sorted, ga))} "
                        f"fastload={sorted(map(sorted, gb))}")
    assert not problems, "extraction differs from GNU tar's:\n  " + "\n  ".join(problems)


def dir_times(archive: Path) -> dict[str, int]:
    """Directory members and the mtimes the archive gives them."""
    with open_tar(archive) as tf:
        return {_norm(m.name): int(m.mtime) for m in tf if m.isdir()}


def assert_extracts_like_gnu_tar(archive: Path, ref: Path, dst: Path) -> set[str]:
    """``dst`` (fastload's extraction of ``archive``) is ``ref`` (GNU tar's), directory
    times included. Returns the directories GNU tar leaves with the time of their last
    change instead of the archive's: it sets a directory's time once a member outside it
    comes, and an archive listing a directory's members after its siblings' (bsdtar's
    order) changes it again afterwards. fastload sets every directory's time at the end,
    the archive's: checked for those."""
    times = dir_times(archive)
    times.pop("", None)
    late = {d for d, t in times.items() if int(os.stat(ref / d).st_mtime) != t}
    assert_same_extraction(ref, dst, explicit=set(times) - late)
    for d in late:
        assert int(os.stat(dst / d).st_mtime) == times[d], d
    return late


# --------------------------------------------------------------------------------------
# Globs (the spec: `*` matches `/`; a pattern without `/` also matches the base name)
# --------------------------------------------------------------------------------------


def glob_match(pattern: str, path: str) -> bool:
    if fnmatch.fnmatchcase(path, pattern):
        return True
    return "/" not in pattern and fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)


def selected(paths: Iterable[str], include: list[str] | None,
             exclude: list[str] | None) -> set[str]:
    return {
        p for p in paths
        if (not include or any(glob_match(g, p) for g in include))
        and not any(glob_match(g, p) for g in exclude or [])
    }


# --------------------------------------------------------------------------------------
# Crafting header bytes
# --------------------------------------------------------------------------------------


BLOCK = 512
F_SIZE = (124, 136)
F_MTIME = (136, 148)
F_CHKSUM = (148, 156)


def header_offsets(data: bytes) -> list[tuple[int, str]]:
    """(offset of the header block, member name) of each member, as tarfile reads them
    (extension headers come before the offset given)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        return [(m.offset_data - BLOCK, m.name) for m in tf]


def fix_checksum(buf: bytearray, off: int) -> None:
    hdr = buf[off:off + BLOCK]
    hdr[F_CHKSUM[0]:F_CHKSUM[1]] = b" " * 8
    buf[off + F_CHKSUM[0]:off + F_CHKSUM[1]] = b"%06o\0 " % sum(hdr)


def set_base256(buf: bytearray, off: int, fld: tuple[int, int], value: int) -> None:
    """Writes ``value`` into a numeric field in GNU base-256 form and fixes the checksum."""
    n = fld[1] - fld[0]
    raw = bytearray(value.to_bytes(n, "big"))
    raw[0] |= 0x80
    buf[off + fld[0]:off + fld[1]] = raw
    fix_checksum(buf, off)


def raw_header(name: str | bytes, *, typeflag: bytes = b"0", size: int = 0,
               mode: int = 0o644, mtime: int = 1_650_000_000, linkname: str | bytes = b"",
               magic: str = "ustar", signed_checksum: bool = False,
               prefix: bytes = b"") -> bytes:
    """One header block as old and vendor writers make it, which no tool here writes:
    ``magic`` "ustar" (POSIX), "gnu" (old GNU "ustar  \\0") or "v7" (none); the checksum
    summed over signed bytes when ``signed_checksum`` (pre-POSIX tars on machines with a
    signed char); numbers in octal with a NUL."""
    def enc(v: str | bytes) -> bytes:
        return v.encode() if isinstance(v, str) else v

    def octal(value: int, width: int) -> bytes:
        return b"%0*o\0" % (width - 1, value)

    h = bytearray(BLOCK)
    h[0:100] = enc(name)[:100].ljust(100, b"\0")
    h[100:108] = octal(mode, 8)
    h[108:116] = octal(0, 8)
    h[116:124] = octal(0, 8)
    h[124:136] = octal(size, 12)
    h[136:148] = octal(mtime, 12)
    h[156:157] = typeflag
    h[157:257] = enc(linkname)[:100].ljust(100, b"\0")
    if magic == "ustar":
        h[257:265] = b"ustar\x0000"
    elif magic == "gnu":
        h[257:265] = b"ustar  \0"
    if magic != "v7":
        h[265:269] = b"root"
        h[297:301] = b"root"
        h[345:500] = prefix[:155].ljust(155, b"\0")
    h[148:156] = b" " * 8
    total = sum((b - 256 if b > 127 else b) for b in h) if signed_checksum else sum(h)
    h[148:156] = b"%06o\0 " % (total & 0o777777)
    return bytes(h)


def raw_member(name: str | bytes, data: bytes = b"", **kw: Any) -> bytes:
    """A header (:func:`raw_header`) and its data, padded to whole blocks."""
    pad = -len(data) % BLOCK
    return raw_header(name, size=len(data), **kw) + data + bytes(pad)


def pax_record(key: str, value: str | bytes) -> bytes:
    """One ``"%d key=value\\n"`` record of a pax extended header."""
    body = key.encode() + b"=" + (value.encode() if isinstance(value, str) else value) + b"\n"
    n = len(body) + 2
    while len(str(n).encode()) + 1 + len(body) != n:
        n += 1
    return str(n).encode() + b" " + body


END = bytes(2 * BLOCK)


# --------------------------------------------------------------------------------------
# Nothing outside the destination
# --------------------------------------------------------------------------------------


def state_names(dst: Path) -> set[str]:
    """What staging keeps beside dst (its lock and its state directory)."""
    return {f".{dst.name}.fastload.lock", f".{dst.name}.fastload"}


@dataclass


class Outside:
    """Everything outside ``dst`` a hostile archive could reach: the test's whole
    tmp_path (recursively, except dst and its state beside it), the sentinel directory
    beside dst, and the names in tmp_path's parent. ``check()`` compares with the
    snapshot taken when made."""

    tmp_path: Path
    dst: Path
    sentinel: Path
    secret: Path = field(init=False)
    before: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sentinel.mkdir(parents=True, exist_ok=True)
        self.secret = self.sentinel / "secret.txt"
        if not self.secret.exists():
            self.secret.write_bytes(b"secret: must stay as it is\n")
            os.chmod(self.secret, 0o600)
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        skip = {self.dst} | {self.dst.parent / n for n in state_names(self.dst)}
        tree: dict[str, Any] = {}
        for dirpath, dirnames, filenames in os.walk(self.tmp_path):
            base = Path(dirpath)
            dirnames[:] = [d for d in dirnames if base / d not in skip]
            for name in dirnames + filenames:
                p = base / name
                if p in skip:
                    continue
                tree[p.relative_to(self.tmp_path).as_posix()] = trees.describe(p)
        st = os.lstat(self.secret)
        return {
            "tree": tree,
            "parent": sorted(os.listdir(self.tmp_path.parent)),
            "secret": (st.st_nlink, st.st_size, self.secret.read_bytes()),
        }

    def check(self) -> None:
        after = self.snapshot()
        t0, t1 = self.before["tree"], after["tree"]
        new = sorted(set(t1) - set(t0))
        gone = sorted(set(t0) - set(t1))
        changed = sorted(k for k in set(t0) & set(t1) if t0[k] != t1[k])
        assert not (new or gone or changed), (
            f"written outside dst: new={new[:10]} gone={gone[:10]} changed={changed[:10]}")
        assert after["parent"] == self.before["parent"], (
            "entries appeared in tmp_path's parent: "
            f"{sorted(set(after['parent']) - set(self.before['parent']))}")
        assert after["secret"] == self.before["secret"], (
            f"the file outside dst was linked to or changed: {after['secret'][:2]}")


def assert_only_expected(dst: Path, files: dict[str, bytes],
                         symlinks: dict[str, str] | None = None) -> None:
    """After a refused archive: every regular file at a final path in dst is one of the
    benign members with all its bytes (no partial file, nothing hostile); every symlink
    is a benign one; no device, FIFO or socket. Directories inside dst are harmless.
    Temporary names (``.NAME.fl-tmp*``) are tolerated."""
    if not dst.exists():
        return
    for rel, p in trees.walk_entries(dst).items():
        st = os.lstat(p)
        if stat.S_ISDIR(st.st_mode):
            continue
        if stat.S_ISREG(st.st_mode):
            if trees.is_tmp_name(p.name):
                continue
            assert rel in files, f"{rel!r} was written though it is not a benign member"
            assert p.read_bytes() == files[rel], f"{rel!r} at its final path is partial"
        elif stat.S_ISLNK(st.st_mode):
            assert symlinks is not None and rel in symlinks, (
                f"symlink {rel!r} -> {os.readlink(p)!r} was created")
            assert os.readlink(p) == symlinks[rel]
        else:
            raise AssertionError(f"{rel!r} in dst is a special file ({stat.S_IFMT(st.st_mode):o})")


@dataclass
class Made:
    """A GNU tar made for tests of the archive readers, and GNU tar's extraction of it."""

    archive: Path
    ref: Path
    size: int


def block_spanning_archive(base: Path, small_files: int, seed: int) -> Made:
    """A GNU tar (posix format) whose read blocks start and end inside members and
    headers: the shapes of build_archive_tree, members of 17 MiB + 1,234 B and 13 MiB
    (more than a read block, ending mid-block), ``small_files`` files of odd sizes; and
    GNU tar's own extraction of it."""
    import random

    src = trees.build_archive_tree(base / "src")
    rng = random.Random(seed)
    (src / "big").mkdir()
    trees.write_patterned(src / "big" / "a.bin", 17 * trees.MiB + 1234, 1)
    trees.write_patterned(src / "big" / "b.bin", 13 * trees.MiB, 2)
    for i in range(small_files):
        body = rng.randbytes(rng.randrange(1, 90_000))
        trees.write_file(src / f"small/{i // 50}/s{i:03d}.bin", body)
    archive = gnu_create(src, base / "a.tar", "posix")
    return Made(archive, gnu_extract(archive, base / "ref"), archive.stat().st_size)
