"""Issue 21: archives GNU tar extracts are extracted by fastload to the same tree, and
where GNU tar warns and goes on, fastload logs a warning and goes on.

Each archive is made by GNU tar, Python's tarfile or by hand (header bytes), extracted by
fastload and by GNU tar, and the two trees are compared file by file (tars.
assert_same_extraction): contents, sizes, holes (SEEK_HOLE/SEEK_DATA), modes, mtimes and
link targets.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from kit import procs, tars

pytestmark = pytest.mark.native

Stage = Callable[..., Any]
BLOCK = tars.BLOCK


def make_sparse(path: Path, size: int, runs: list[tuple[int, bytes]]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in runs:
            f.seek(off)
            f.write(data)


def extract_both(stage: Stage, archive: Path, tmp: Path, **kw: Any) -> tuple[Path, Path]:
    ours, ref = tmp / "ours", tmp / "ref"
    tars.gnu_extract(archive, ref)
    stage(archive, ours, **kw)
    return ours, ref


# --------------------------------------------------------------------------------------
# Sparse members
# --------------------------------------------------------------------------------------


SPARSE_FORMATS = [
    ("gnu", None), ("oldgnu", None),
    ("posix", "0.0"), ("posix", "0.1"), ("posix", "1.0"),
]


@pytest.mark.parametrize(("fmt", "version"), SPARSE_FORMATS,
                         ids=[f"{f}-{v}" if v else f for f, v in SPARSE_FORMATS])
def test_sparse_members_extract_as_gnu_tar_does(
    stage: Stage, tmp_path: Path, fmt: str, version: str | None
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    blk = 1 << 16
    make_sparse(src / "holes.bin", 40 * blk,
                [(3 * blk, os.urandom(blk)), (20 * blk, os.urandom(5000))])
    make_sparse(src / "tail-hole.bin", 9 * blk, [(0, b"head" * 1000)])
    make_sparse(src / "all-hole.bin", 5 * blk, [])
    make_sparse(src / "many.bin", 64 * blk, [(k * 2 * blk, os.urandom(100 + k)) for k in range(30)])
    (src / "plain.txt").write_bytes(b"plain\n")
    archive = tars.gnu_create(
        src, tmp_path / "sparse.tar", fmt,
        extra=["--sparse", *([f"--sparse-version={version}"] if version else [])])
    ours, ref = extract_both(stage, archive, tmp_path)
    tars.assert_same_extraction(ref, ours, explicit=tars.explicit_dirs(archive), holes=True)
    # The holes really are holes: far less allocated than the size.
    st = (ours / "many.bin").stat()
    if tars.data_extents(src / "many.bin") != [(0, st.st_size)]:  # the file system keeps holes
        assert st.st_blocks * 512 < st.st_size // 4


# --------------------------------------------------------------------------------------
# Warnings: where GNU tar warns and goes on, so does fastload (logging, logger "fastload")
# --------------------------------------------------------------------------------------


def _a() -> bytes:
    return tars.raw_member("a.txt", b"A" * 10, magic="gnu")


def _b() -> bytes:
    return tars.raw_member("b.txt", b"B" * 700, magic="gnu")


# name -> (archive bytes, what the warning says, the offset or member it names, whether
# GNU tar warns too: for the partial block after a zero block, "A lone zero block").
WARNING_CASES: dict[str, tuple[bytes, str, str, bool]] = {
    "lone-zero-block": (_a() + bytes(BLOCK) + _b() + tars.END, "lone zero block",
                        "offset 1024", True),
    "unknown-type": (_a() + tars.raw_member("q.bin", b"qq", typeflag=b"Q") + tars.END,
                     "unknown type 'Q'", "'q.bin'", True),
    "contiguous": (tars.raw_member("c.bin", b"cc", typeflag=b"7") + _a() + tars.END,
                   "contiguous", "'c.bin'", True),
    "partial-block": (_a() + bytes(BLOCK) + b"garbage" * 10, "70 bytes after the last",
                      "offset 1536", True),
}


@pytest.mark.parametrize("case", sorted(WARNING_CASES))
def test_warns_where_gnu_tar_warns_and_extracts_the_same(
    stage: Stage, tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    data, what, where, gnu_warns = WARNING_CASES[case]
    archive = tmp_path / f"{case}.tar"
    archive.write_bytes(data)
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    ref.mkdir()
    gnu = subprocess.run([tars.need_gnu_tar(), "-xf", str(archive), "-C", str(ref),
                          "--no-same-owner"], capture_output=True, text=True, check=True)
    assert bool(gnu.stderr.strip()) == gnu_warns, gnu.stderr
    with caplog.at_level(logging.WARNING, logger="fastload"):
        stage(archive, ours)
    tars.assert_same_extraction(ref, ours)
    lines = [r.getMessage() for r in caplog.records
             if r.name.startswith("fastload") and r.levelno == logging.WARNING]
    assert len(lines) == 1, lines
    assert what in lines[0] and where in lines[0] and str(archive) in lines[0], lines[0]


def test_a_clean_archive_logs_no_warning(stage: Stage, tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    archive = tmp_path / "clean.tar"
    archive.write_bytes(_a() + _b() + tars.END)
    with caplog.at_level(logging.DEBUG, logger="fastload"):
        stage(archive, tmp_path / "out")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_warnings_of_a_member_tar_name_it(stage: Stage, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    inner = _a() + tars.raw_member("q.bin", b"qq", typeflag=b"Q") + tars.END
    archive = tmp_path / "outer.tar"
    archive.write_bytes(tars.raw_member("cls.tar", inner) + tars.END)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        stage(archive, tmp_path / "out", unpack="nested")
    assert (tmp_path / "out" / "cls" / "q.bin").read_bytes() == b"qq"
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("fastload")]
    assert f"{archive}:cls.tar" in line and "'q.bin'" in line, line


def test_cli_prints_the_warning_and_succeeds(tmp_path: Path) -> None:
    archive = tmp_path / "lone.tar"
    archive.write_bytes(WARNING_CASES["lone-zero-block"][0])
    p = subprocess.run([sys.executable, "-m", "fastload", "stage", str(archive),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env=procs.child_env(), check=False)
    assert p.returncode == 0, p.stderr
    assert "lone zero block" in p.stderr and str(archive) in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["a.txt"]


# --------------------------------------------------------------------------------------
# Hard links count as the regular files they are
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])
def test_hard_links_count_as_copied_files(stage: Stage, tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(5000))
    os.link(src / "a.bin", src / "d" / "b.bin")
    os.link(src / "a.bin", src / "z.bin")
    (src / "plain.txt").write_bytes(b"plain\n")
    archive = tars.gnu_create(src, tmp_path / "h.tar", fmt)
    assert tars.has_hardlinks(archive)
    out = tmp_path / "out"
    ours, ref = extract_both(stage, archive, tmp_path)
    tars.assert_same_extraction(ref, ours, explicit=tars.explicit_dirs(archive))
    first = stage(archive, out)
    assert (first.files, first.bytes) == (4, 3 * 5000 + 6)
    assert (first.copied_files, first.copied_bytes) == (first.files, first.bytes)
    # A missing link is made again (repair: what verify finds missing): one file copied.
    (out / "z.bin").unlink()
    again = stage(archive, out, repair=True)
    assert (again.copied_files, again.copied_bytes) == (1, 5000), again
    # The target rewritten: its links are new files too.
    (out / "a.bin").write_bytes(b"changed")
    third = stage(archive, out, repair=True)
    assert (third.copied_files, third.copied_bytes) == (3, 3 * 5000), third
    tars.assert_same_extraction(ref, out, explicit=tars.explicit_dirs(archive))
