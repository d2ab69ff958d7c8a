"""fastload.verify(): re-reads a staged destination and compares it with the manifest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import trees
from kit.trees import MiB

pytestmark = pytest.mark.native

Stage = Callable[..., Any]


def flip_byte(path: Path, offset: int) -> None:
    """Changes one byte, keeping size and mtime (a size/mtime check cannot see it)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def staged(stage: Stage, rich_src: Path, tmp_path: Path) -> tuple[Path, Any]:
    dst = tmp_path / "dst"
    return dst, stage(rich_src, dst)


def test_clean_tree_verifies(staged: tuple[Path, Any]) -> None:
    dst, res = staged
    v = fastload.verify(dst)
    assert v.ok is True
    assert v.files == res.files
    assert list(v.mismatched) == [] and list(v.missing) == []


def test_verify_takes_str(staged: tuple[Path, Any]) -> None:
    dst, _ = staged
    assert fastload.verify(str(dst)).ok


@pytest.mark.parametrize(("rel", "offset"), [
    ("top.txt", 0),
    ("data/medium.bin", 3 * MiB + 122),          # the last byte
    ("data/medium.bin", 2 * MiB + 17),           # in a middle chunk
    ("sparse.bin", 12 * MiB),                    # inside a hole
    (f"{trees.UNICODE_DIR}/{trees.UNICODE_FILE}", 3),
    (f"long/{trees.LONG_UNICODE}", 299),
], ids=["first-byte", "last-byte", "middle-chunk", "in-a-hole", "unicode-name", "long-name"])
def test_one_corrupt_byte_is_found(staged: tuple[Path, Any], rel: str, offset: int) -> None:
    dst, res = staged
    flip_byte(dst / rel, offset)
    v = fastload.verify(dst)
    assert v.ok is False
    assert list(v.mismatched) == [rel]
    assert list(v.missing) == []
    assert v.files == res.files


def test_deleted_file_is_missing(staged: tuple[Path, Any]) -> None:
    dst, _ = staged
    (dst / "data" / "file.bin").unlink()
    v = fastload.verify(dst)
    assert v.ok is False
    assert list(v.missing) == ["data/file.bin"]
    assert list(v.mismatched) == []


def test_truncated_file_is_mismatched(staged: tuple[Path, Any]) -> None:
    dst, _ = staged
    os.truncate(dst / "data" / "medium.bin", MiB)
    v = fastload.verify(dst)
    assert not v.ok
    assert "data/medium.bin" in list(v.mismatched) + list(v.missing)


def test_several_problems_all_listed(staged: tuple[Path, Any]) -> None:
    dst, _ = staged
    flip_byte(dst / "top.txt", 1)
    flip_byte(dst / "modes" / "exec.sh", 0)
    (dst / "empty.txt").unlink()
    (dst / "modes" / "ro.txt").unlink()
    v = fastload.verify(dst)
    assert not v.ok
    assert sorted(v.mismatched) == ["modes/exec.sh", "top.txt"]
    assert sorted(v.missing) == ["empty.txt", "modes/ro.txt"]


def test_verify_single_file(stage: Stage, tmp_path: Path) -> None:
    src = tmp_path / "one.bin"
    trees.write_file(src, os.urandom(2 * MiB), mtime_index=1)
    dst = tmp_path / "copy.bin"
    stage(src, dst)
    v = fastload.verify(dst)
    assert v.ok and v.files == 1
    flip_byte(dst, MiB)
    assert not fastload.verify(dst).ok


@pytest.mark.parametrize("shape", ["absent", "plain_dir"])
def test_never_staged(tmp_path: Path, shape: str) -> None:
    dst = tmp_path / "dst"
    if shape == "plain_dir":
        trees.write_file(dst / "x.txt", b"x")
    with pytest.raises((FileNotFoundError, fastload.FastloadError)) as info:
        fastload.verify(dst)
    assert "dst" in f"{info.value} {getattr(info.value, 'filename', '')}"
