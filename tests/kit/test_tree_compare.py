"""The comparison helpers every staging test relies on must see each kind of difference
(a checker that cannot fail would make the whole suite unable to fail)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from kit import fs, trees
from kit.trees import MiB


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    a = tmp_path / "a"
    trees.build_rich_tree(a)
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)  # copy2: modes and ns mtimes
    os.chmod(b, os.stat(a).st_mode)
    return a, b


def test_identical_copies_compare_equal(pair: tuple[Path, Path]) -> None:
    trees.assert_same_tree(*pair)
    assert trees.assert_no_partial_files(*pair) > 10


def _flip(p: Path) -> None:
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.seek(st.st_size - 1)
        last = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([last[0] ^ 1]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def _touch_ns(p: Path) -> None:
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1))


def _relink(p: Path) -> None:
    p.unlink()
    os.symlink("data/empty2", p)


def _zero_fill_hole(p: Path) -> None:
    """Writing zeros into a hole keeps the content: must still compare equal."""
    with open(p, "r+b") as f:
        f.seek(12 * MiB)
        f.write(bytes(MiB))


def _write_at(p: Path, off: int) -> None:
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.seek(off)
        f.write(b"\x01")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


MUTATIONS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "byte": ("data/medium.bin", _flip),
    "mtime-1ns": ("top.txt", _touch_ns),
    "mode": ("modes/rw.bin", lambda p: os.chmod(p, 0o644)),
    "dir-mode": ("modes/ro_dir", lambda p: os.chmod(p, 0o755)),
    "link-target": ("link_to_file", _relink),
    "missing-empty-dir": ("empty_dir", lambda p: p.rmdir()),
    "extra-file": ("extra.txt", lambda p: p.write_bytes(b"")),
    "truncated": ("sparse.bin", lambda p: os.truncate(p, 16 * MiB - 1)),
    "data-in-hole": ("sparse.bin", lambda p: _write_at(p, 12 * MiB)),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_difference_is_caught(pair: tuple[Path, Path], name: str) -> None:
    a, b = pair
    rel, mutate = MUTATIONS[name]
    mutate(b / rel)
    with pytest.raises(AssertionError):
        trees.assert_same_tree(a, b)


def test_zeros_written_into_a_hole_are_the_same_content(pair: tuple[Path, Path]) -> None:
    a, b = pair
    _zero_fill_hole(b / "sparse.bin")
    assert fs.allocated_bytes(b / "sparse.bin") > fs.allocated_bytes(a / "sparse.bin")
    trees.assert_same_tree(a, b, mtimes=False)


def test_partial_file_at_final_path_is_caught(pair: tuple[Path, Path]) -> None:
    a, b = pair
    os.truncate(b / "data" / "medium.bin", MiB)
    with pytest.raises(AssertionError, match="partial"):
        trees.assert_no_partial_files(a, b)


def test_temporary_names_are_allowed_after_a_kill(pair: tuple[Path, Path]) -> None:
    a, b = pair
    (b / "data" / ".medium.bin.fl-tmp123").write_bytes(b"half")
    assert trees.assert_no_partial_files(a, b) > 0
    assert trees.tmp_leftovers(b) == ["data/.medium.bin.fl-tmp123"]


def test_mentions_size() -> None:
    assert fs.mentions_size("need 12.0 MiB, 7.9 MiB free", 12 * MiB)
    assert fs.mentions_size("need 12582912 bytes", 12582912)
    assert not fs.mentions_size("not enough space", 12 * MiB)
    assert fs.mentions_size("need 12,582,912 bytes; 8 MB free", 12582912)
    assert fs.mentions_size("need 12,582,912 bytes; 8 MB free", 8 * 1000**2)
    # Not a size: part of a path, of a longer number, of a word, or without a unit.
    assert not fs.mentions_size("no space in '/tmp/pytest-12.0 MiB/x'", 12 * MiB)
    assert not fs.mentions_size("no space in /tmp/12.0/x", 12 * MiB)
    assert not fs.mentions_size("need 112.0 MiB", 12 * MiB)
    assert not fs.mentions_size("need 12.05 MiB", 12 * MiB)
    assert not fs.mentions_size("need 12.0 MiB", 12 * 1000**2)
    assert not fs.mentions_size("disk12582912 is full", 12582912)
    assert not fs.mentions_size("12.0 of them", 12 * MiB)
