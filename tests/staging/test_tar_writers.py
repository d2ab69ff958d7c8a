"""Archives from other writers (issue 21): bsdtar (libarchive) in its tar formats, GNU tar
in each of its formats, and hand-built headers for the dialects no tool here writes
(Solaris ``A`` and ``X``, contiguous ``7``, global pax ``g``, V7 directories by a trailing
slash, checksums summed over signed bytes). Each archive is extracted by fastload and by
GNU tar and the trees are compared file by file (tars.assert_same_extraction: contents,
sizes, holes, modes, mtimes, link targets, hard-link groups).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from kit import tars, trees
from kit.tools import require_tool

pytestmark = pytest.mark.native

Stage = Callable[..., Any]
BLOCK = tars.BLOCK
FAR_FUTURE = 2**33 + 5  # past what 11 octal digits hold (year 2242)
BEFORE_1970 = -400 * 86400


def need_bsdtar() -> str:
    return require_tool("bsdtar", "libarchive-tools")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"full": every shape (names over 100 and 255 bytes, long link targets, unicode, hard
    links, times past 2242 and before 1970); "short": what ustar holds; "v7": what V7
    holds (names under 100 bytes, no prefix field)."""
    base = tmp_path_factory.mktemp("writers")
    full = trees.build_archive_tree(base / "full")
    (full / "time").mkdir()
    for name, t in (("future.bin", FAR_FUTURE), ("past.bin", BEFORE_1970)):
        (full / "time" / name).write_bytes(name.encode())
        os.utime(full / "time" / name, (t, t))
    os.utime(full / "time", (1_600_000_000, 1_600_000_000))
    short = trees.build_archive_tree(base / "short", long=False)
    v7 = trees.build_archive_tree(base / "v7", long=False)
    shutil.rmtree(v7 / trees.USTAR_PREFIX_PATH.split("/")[0])
    return {"full": full, "short": short, "v7": v7}


# (writer, format, tree)
WRITERS = [
    ("bsdtar", "ustar", "short"), ("bsdtar", "pax", "full"), ("bsdtar", "paxr", "full"),
    ("bsdtar", "gnutar", "full"), ("bsdtar", "v7", "v7"),
    ("gnu", "oldgnu", "full"), ("gnu", "gnu", "full"), ("gnu", "posix", "full"),
    ("gnu", "ustar", "short"), ("gnu", "v7", "v7"),
]


@pytest.mark.parametrize(("writer", "fmt", "tree"), WRITERS,
                         ids=[f"{w}-{f}" for w, f, _ in WRITERS])
def test_writer_format_extracts_as_gnu_tar_does(
    stage: Stage, sources: dict[str, Path], tmp_path: Path, writer: str, fmt: str, tree: str
) -> None:
    src = sources[tree]
    archive = tmp_path / f"{writer}-{fmt}.tar"
    if writer == "bsdtar":
        tars.run([need_bsdtar(), "--format", fmt, "-cf", str(archive), "-C", str(src), "."])
    else:
        tars.gnu_create(src, archive, fmt)
    tars.gnu_extract(archive, tmp_path / "ref")
    stage(archive, tmp_path / "ours")
    late = tars.assert_extracts_like_gnu_tar(archive, tmp_path / "ref", tmp_path / "ours")
    assert not late or writer == "bsdtar", late
    # The times the archive holds are the source's (bsdtar's gnutar format clamps the far
    # future to the largest octal time instead of writing base-256).
    if tree == "full" and (writer, fmt) != ("bsdtar", "gnutar"):
        assert os.stat(tmp_path / "ours" / "time" / "future.bin").st_mtime == FAR_FUTURE
        assert os.stat(tmp_path / "ours" / "time" / "past.bin").st_mtime == BEFORE_1970


# --------------------------------------------------------------------------------------
# Hand-built headers
# --------------------------------------------------------------------------------------


R = tars.raw_member


def solaris_acl() -> bytes:
    """Solaris tar: an ``A`` header (the ACL as text) before the file it belongs to."""
    acl = b"user::rw-,group::r--,mask:r--,other:r--\0"
    return (R("f.txt", acl, typeflag=b"A") + R("f.txt", b"the file\n") + R("g.txt", b"g")
            + tars.END)


def solaris_x() -> bytes:
    """Solaris tar's ``X`` extended header (pax records): a long unicode path and an
    mtime with a fraction for the member after it."""
    long = "x" * 120 + "/\u00fcn\u00efc\u00f8d\u00e9.txt"
    recs = tars.pax_record("path", long) + tars.pax_record("mtime", "1700000000.25")
    return (R("././@PaxHeader", recs, typeflag=b"X") + R("short", b"x data")
            + R("after.txt", b"a") + tars.END)


def contiguous() -> bytes:
    return R("c.bin", os.urandom(3000), typeflag=b"7", mode=0o640) + R("d.bin", b"d") + tars.END


def pax_global() -> bytes:
    """A global header applies to every member after it: its mtime overrides theirs."""
    g = tars.pax_record("mtime", "1234567890") + tars.pax_record("comment", "made by hand")
    return (R("a.txt", b"before") + R("pax_global_header", g, typeflag=b"g")
            + R("b.txt", b"after") + R("c.txt", b"after too") + tars.END)


def v7_dirs() -> bytes:
    """V7: no magic, a directory is a regular-file header whose name ends in '/'; the
    old NUL typeflag for files; a symlink."""
    v7: dict[str, Any] = {"magic": "v7"}
    return (R("dir/", typeflag=b"0", mode=0o750, mtime=1_500_000_000, **v7)
            + R("dir/file", b"in dir\n", typeflag=b"\0", **v7)
            + R("dir/sub/", typeflag=b"\0", mode=0o700, **v7)
            + R("dir/sub/deep", b"deep\n", **v7)
            + R("dir/link", typeflag=b"2", linkname="file", **v7) + tars.END)


def signed_checksum() -> bytes:
    """Pre-POSIX tars on machines with a signed char summed the header as signed bytes:
    only names with bytes over 127 make the two sums differ."""
    name = "caf\u00e9-\u00fcber.txt".encode()
    return (R(name, b"signed\n", magic="v7", signed_checksum=True)
            + R(b"d\xc3\xa9j\xc3\xa0/", typeflag=b"5", signed_checksum=True)
            + R(b"d\xc3\xa9j\xc3\xa0/vu", b"vu\n", signed_checksum=True) + tars.END)


def old_gnu_magic() -> bytes:
    return R("o.txt", b"old gnu\n", magic="gnu") + R("p/", typeflag=b"5", magic="gnu") + tars.END


# Each archive, and the directories it has members for: their times are the archive's,
# compared; a directory made only to hold a member (solaris-X's long path) has the time
# of its extraction, different for each tool whenever a second passes in between.
HAND_BUILT: dict[str, tuple[Callable[[], bytes], set[str]]] = {
    "solaris-acl-A": (solaris_acl, set()),
    "solaris-X": (solaris_x, set()),
    "contiguous-7": (contiguous, set()),
    "pax-global-g": (pax_global, set()),
    "v7-trailing-slash-dirs": (v7_dirs, {"dir", "dir/sub"}),
    "signed-checksum": (signed_checksum, {"d\u00e9j\u00e0"}),
    "old-gnu-magic": (old_gnu_magic, {"p"}),
}


@pytest.mark.parametrize("case", sorted(HAND_BUILT))
def test_hand_built_dialect_extracts_as_gnu_tar_does(
    stage: Stage, tmp_path: Path, case: str
) -> None:
    build, member_dirs = HAND_BUILT[case]
    archive = tmp_path / f"{case}.tar"
    archive.write_bytes(build())
    ref = tars.gnu_extract(archive, tmp_path / "ref")
    assert trees.walk_entries(ref), "GNU tar extracted nothing"
    assert member_dirs <= {rel for rel, p in trees.walk_entries(ref).items() if p.is_dir()}
    stage(archive, tmp_path / "ours")
    tars.assert_same_extraction(ref, tmp_path / "ours", explicit=member_dirs)


def test_signed_checksum_is_what_makes_the_header_valid() -> None:
    """The case above would test nothing if the signed and unsigned sums were equal."""
    head = tars.raw_header("caf\u00e9.txt", signed_checksum=True)
    unsigned = tars.raw_header("caf\u00e9.txt")
    assert head[148:156] != unsigned[148:156]
