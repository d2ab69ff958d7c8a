"""Archives of libarchive's test corpus that GNU tar extracts (issue 32, item 8), rebuilt
here member by member from what libarchive's tests read in them (the corpus files are
not vendored):

- ``test_compat_solaris_tar_acl.tar`` (Solaris 10 tar): each member follows an ``A``
  header of the same name holding its ACL. GNU tar does not know the type: it writes
  each as a regular file, "dir-with-posix-acls/" as the file "dir-with-posix-acls",
  which the directory member after it then replaces (the directory gets its mode and
  mtime).
- ``test_read_format_gtar_sparse_skip_entry.tar`` (pax, GNU sparse 1.0): "a", 10 GiB +
  4 bytes with 4096 bytes at 0 and 4 at 10 GiB, then "b". Its size field counts the
  4-byte extent as the whole block it fills; GNU tar reads each extent as whole blocks,
  so nothing is left to skip after them, read or skipped. The same in the old GNU
  format ('S' with an extension header of sparse entries).

fastload's extraction must be GNU tar's: files, contents (holes included), modes,
mtimes, the set of directories.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import tars

pytestmark = pytest.mark.native

Stage = Callable[..., Any]
BLOCK = tars.BLOCK
R = tars.raw_member
T0 = 1_300_000_000  # the archives' mtimes (2011)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


# --------------------------------------------------------------------------------------
# test_compat_solaris_tar_acl.tar
# --------------------------------------------------------------------------------------

# (name, mode, ACL text as Solaris writes it: type and count in octal, NUL, entries, NUL)
SOLARIS_ACLS = [
    ("file-with-posix-acls", 0o644,
     b"1000007\0user::rw-,user:lp:--x:71,user:666:r--:666,user:1000:rwx:1000,group::r--,"
     b"mask:r--,other:r--\0"),
    ("dir-with-posix-acls/", 0o750,
     b"1000014\0user::rwx,user:bin:rwx:2,group::r-x,group:sys:r-x:3,mask:r-x,other:---,"
     b"defaultuser::rwx,defaultuser:bin:rwx:2,defaultgroup::r-x,defaultgroup:sys:r-x:3,"
     b"defaultmask:rwx,defaultother:---\0"),
    ("file-with-nfsv4-acls", 0o640,
     b"3000006\0group:daemon:rwxp--aARWcCos:-------:deny:12,group:bin:rwxp---------s:"
     b"-------:allow:2,user:adm:r-----a-R-c--s:-------:allow:4,owner@:rw-p--aARWcCos:"
     b"-------:allow,group@:r-----a-R-c--s:-------:allow,everyone@:------a-R-c--s:"
     b"-------:allow\0"),
    ("dir-with-nfsv4-acls/", 0o750,
     b"3000005\0user:1100:rwxp--aARWcCos:fdi----:allow:1100,group:adm:r-----a-R-c--s:"
     b"fd-----:allow:4,owner@:rwxp-DaARWcCos:-------:allow,group@:r-x---a-R-c--s:-------:"
     b"allow,everyone@:------a-R-c--s:-------:allow\0"),
]


def solaris_tar_acl() -> bytes:
    """Eight members: an ``A`` header (mode and mtime of its member, the ACL as data)
    before each of two empty files and two directories."""
    out = b""
    for i, (name, mode, acl) in enumerate(SOLARIS_ACLS):
        kind = b"5" if name.endswith("/") else b"0"
        out += R(name, acl, typeflag=b"A", mode=mode, mtime=T0 + i)
        out += R(name, typeflag=kind, mode=mode, mtime=T0 + i)
    return out + tars.END


def acl_dir_with_contents() -> bytes:
    """The same shape with a large ``A`` member (still being written when the directory
    member comes) and members inside the directory after it."""
    return (R("d/", bytes(range(256)) * 2048, typeflag=b"A", mode=0o700, mtime=T0)
            + R("d/", typeflag=b"5", mode=0o751, mtime=T0 + 5)
            + R("d/inner.txt", b"inside\n", mode=0o600, mtime=T0 + 6)
            + R("d/sub/", typeflag=b"5", mode=0o755, mtime=T0 + 7)
            + R("after.txt", b"after\n", mtime=T0 + 8) + tars.END)


SOLARIS = {"solaris-tar-acl": solaris_tar_acl, "acl-dir-with-contents": acl_dir_with_contents}


@pytest.mark.parametrize("case", sorted(SOLARIS))
def test_directory_member_replaces_the_file_of_its_acl_header(
    stage: Stage, tmp_path: Path, case: str
) -> None:
    archive = tmp_path / f"{case}.tar"
    archive.write_bytes(SOLARIS[case]())
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    tars.gnu_extract(archive, ref)
    res = stage(archive, ours)
    dirs = tars.explicit_dirs(archive)
    tars.assert_same_extraction(ref, ours, explicit=dirs)
    # The files the directories replaced are not in the manifest: it verifies.
    assert res.files == sum(1 for p in ours.rglob("*") if p.is_file())
    assert fastload.verify(ours).ok
    # Again over the tree, without the record of the first run, as GNU tar's second
    # extraction over its own: an empty directory where an ACL header's file goes is
    # replaced (then made again); one holding anything fails the extraction.
    shutil.rmtree(tmp_path / f".{ours.name}.fastload")
    again = subprocess.run([tars.need_gnu_tar(), "-xf", str(archive), "-C", str(ref),
                            "--no-same-owner"], capture_output=True, check=False)
    if again.returncode == 0:
        stage(archive, ours)
        tars.assert_same_extraction(ref, ours, explicit=dirs)
    else:
        assert b"Cannot open: File exists" in again.stderr, again.stderr
        with pytest.raises(OSError, match="Is a directory"):
            stage(archive, ours)
    assert case != "solaris-tar-acl" or again.returncode == 0


# --------------------------------------------------------------------------------------
# test_read_format_gtar_sparse_skip_entry.tar
# --------------------------------------------------------------------------------------

REAL = 10 * 2**30 + 4
A_DATA = bytes((7 * i + 3) % 251 for i in range(4096))
EXTENTS = [(0, A_DATA), (10 * 2**30, b"abcd")]


def sparse_data() -> bytes:
    return b"".join(pad(d) for _, d in EXTENTS)


def member_b() -> bytes:
    recs = (tars.pax_record("mtime", f"{T0 + 1}.25") + tars.pax_record("atime", f"{T0 + 1}")
            + tars.pax_record("ctime", f"{T0 + 1}"))
    return R("./PaxHeaders/b", recs, typeflag=b"x") + R("b", b"bbbb", mtime=T0 + 1)


def gtar_sparse_skip_entry() -> bytes:
    """pax with GNU sparse 1.0: the map in the first data block; the size field counts
    the map block and each extent's whole blocks (5120, not GNU tar's 4612)."""
    recs = (tars.pax_record("GNU.sparse.major", "1") + tars.pax_record("GNU.sparse.minor", "0")
            + tars.pax_record("GNU.sparse.name", "a")
            + tars.pax_record("GNU.sparse.realsize", str(REAL)))
    sparse_map = f"{len(EXTENTS)}\n".encode() + b"".join(
        f"{off}\n{len(d)}\n".encode() for off, d in EXTENTS)
    body = pad(sparse_map) + sparse_data()
    return (R("./PaxHeaders/a", recs, typeflag=b"x")
            + tars.raw_header("./GNUSparseFile.0/a", size=len(body), mtime=T0) + body
            + member_b() + tars.END)


def num12(v: int) -> bytes:
    """A 12-byte numeric field: octal, or GNU base-256 past 11 octal digits."""
    if v < 8**11:
        return b"%011o\0" % v
    return bytes([0x80]) + v.to_bytes(11, "big")


def old_gnu_sparse(name: str, real: int, extents: list[tuple[int, int]], size: int) -> bytes:
    """An old GNU 'S' header: 4 sparse entries in the header, 21 in each extension block
    after it (the "is extended" flags chain them), the real size at byte 483."""
    h = bytearray(tars.raw_header(name, typeflag=b"S", size=size, mtime=T0, magic="gnu"))
    blocks: list[bytearray] = []
    for i, (off, n) in enumerate(extents):
        if i < 4:
            blk, at = h, 386 + 24 * i
        else:
            k = (i - 4) % 21
            if k == 0:
                (blocks[-1] if blocks else h)[504 if blocks else 482] = 1
                blocks.append(bytearray(BLOCK))
            blk, at = blocks[-1], 24 * k
        blk[at:at + 24] = num12(off) + num12(n)
    h[483:495] = num12(real)
    tars.fix_checksum(h, 0)
    return bytes(h) + b"".join(bytes(b) for b in blocks)


def old_gnu_sparse_skip_entry() -> bytes:
    """The same file as an old GNU sparse member whose map goes on in an extension
    header (two extension blocks): 30 extents, the size counting their blocks."""
    runs = [(k * 65536, bytes([65 + k]) * (100 + k)) for k in range(29)] + [(REAL - 4, b"abcd")]
    body = b"".join(pad(d) for _, d in runs)
    return (old_gnu_sparse("a", REAL, [(o, len(d)) for o, d in runs], len(body)) + body
            + member_b() + tars.END)


SPARSE = {"pax-1.0": gtar_sparse_skip_entry, "old-gnu-extended": old_gnu_sparse_skip_entry}


@pytest.mark.parametrize("case", sorted(SPARSE))
def test_sparse_member_whose_size_counts_its_blocks(
    stage: Stage, tmp_path: Path, case: str
) -> None:
    archive = tmp_path / f"{case}.tar"
    archive.write_bytes(SPARSE[case]())
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    tars.gnu_extract(archive, ref)
    stage(archive, ours)
    tars.assert_same_extraction(ref, ours, holes=True)
    assert (ours / "a").stat().st_size == REAL
    assert (ours / "b").read_bytes() == b"bbbb"


@pytest.mark.parametrize("case", sorted(SPARSE))
def test_skipped_sparse_member(stage: Stage, tmp_path: Path, case: str) -> None:
    """The sparse member not selected: skipped as a whole, the member after it read."""
    archive = tmp_path / f"{case}.tar"
    archive.write_bytes(SPARSE[case]())
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    ref.mkdir()
    tars.run([tars.need_gnu_tar(), "-xf", str(archive), "-C", str(ref), "--no-same-owner", "b"])
    stage(archive, ours, include=["b"])
    tars.assert_same_extraction(ref, ours)
    assert sorted(p.name for p in ours.iterdir()) == ["b"]
