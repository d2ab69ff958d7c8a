"""Issue 21: archives GNU tar extracts are extracted by fastload to the same tree.

Self-contained (no shared test helpers). Each archive is made by GNU tar (or Python's
tarfile), extracted by fastload and by GNU tar, and the two trees are compared file by
file: contents, sizes, holes (SEEK_HOLE/SEEK_DATA), modes, mtimes and link targets.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import fastload

pytestmark = pytest.mark.native

TAR = shutil.which("tar")


def gnu_tar() -> str:
    version = subprocess.run([TAR, "--version"], capture_output=True).stdout if TAR else b""
    if TAR is None or b"GNU tar" not in version:
        pytest.skip("GNU tar is not installed")
    return TAR


def data_extents(path: Path) -> list[tuple[int, int]]:
    """The data runs of a file, as SEEK_DATA/SEEK_HOLE see them."""
    out = []
    with open(path, "rb") as f:
        fd, size, pos = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, end))
            pos = end
    return out


def tree(root: Path) -> dict[str, tuple[object, ...]]:
    """What a tree holds, comparable across extractions (holes included)."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".fastload"]
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = p.lstat()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode & 0o7777, st.st_mtime_ns // 10**9)
            else:
                out[rel] = ("file", st.st_size, st.st_mode & 0o7777, st.st_mtime_ns // 10**9,
                            p.read_bytes(), data_extents(p))
    return out


def make_sparse(path: Path, size: int, runs: list[tuple[int, bytes]]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in runs:
            f.seek(off)
            f.write(data)


def extract_both(archive: Path, tmp: Path) -> tuple[Path, Path]:
    ours, ref = tmp / "ours", tmp / "ref"
    ref.mkdir()
    subprocess.run([gnu_tar(), "-xf", str(archive), "-C", str(ref)], check=True)
    fastload.stage(archive, ours)
    return ours, ref


SPARSE_FORMATS = [
    ("gnu", None), ("oldgnu", None),
    ("posix", "0.0"), ("posix", "0.1"), ("posix", "1.0"),
]


@pytest.mark.parametrize(("fmt", "version"), SPARSE_FORMATS,
                         ids=[f"{f}-{v}" if v else f for f, v in SPARSE_FORMATS])
def test_sparse_members_extract_as_gnu_tar_does(
    tmp_path: Path, fmt: str, version: str | None
) -> None:
    tar = gnu_tar()
    src = tmp_path / "src"
    src.mkdir()
    blk = 1 << 16
    make_sparse(src / "holes.bin", 40 * blk,
                [(3 * blk, os.urandom(blk)), (20 * blk, os.urandom(5000))])
    make_sparse(src / "tail-hole.bin", 9 * blk, [(0, b"head" * 1000)])
    make_sparse(src / "all-hole.bin", 5 * blk, [])
    make_sparse(src / "many.bin", 64 * blk, [(k * 2 * blk, os.urandom(100 + k)) for k in range(30)])
    (src / "plain.txt").write_bytes(b"plain\n")
    archive = tmp_path / "sparse.tar"
    args = [tar, "--sparse", f"--format={fmt}", "--sort=name", "-C", str(src), "-cf", str(archive)]
    if version:
        args.insert(2, f"--sparse-version={version}")
    subprocess.run([*args, "."], check=True)
    ours, ref = extract_both(archive, tmp_path)
    a, b = tree(ours), tree(ref)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k
    # The holes really are holes: far less allocated than the size.
    st = (ours / "many.bin").stat()
    if data_extents(src / "many.bin") != [(0, st.st_size)]:  # the file system keeps holes
        assert st.st_blocks * 512 < st.st_size // 4
