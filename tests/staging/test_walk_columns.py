"""The columnar walk (issue 38): ``_core.walk_columns`` hands the listing over as columns
(a paths blob, offsets and typed arrays, link targets by index), no Python object per
entry; :meth:`Listing.from_walk` wraps them. Checked against the walk's tuples and
against the file system itself, on trees with odd names."""

from __future__ import annotations

import os
import stat
import tracemalloc
from pathlib import Path

import pytest

import fastload
from fastload import _core
from fastload.staging.columns import DIR, FILE, LINK, Listing
from kit import trees

pytestmark = pytest.mark.native

# Names that are not UTF-8 (read back through surrogateescape), with spaces, newlines,
# a tab, and bytes above 0x7f that sort after every ASCII name.
ODD = [b"bad\xff\xfe.bin", b"sp ace.txt", b"new\nline", b"tab\there", b"\xc3\xa9t\xc3\xa9",
       b"z\x80", b"-dash", b".hidden"]  # fmt: skip


def _odd_tree(root: Path) -> Path:
    """build_rich_tree plus odd names, empty folders, a flat folder of more names than
    one stat batch of the walk (64), links (relative, absolute inside the tree, with an
    odd target)."""
    trees.build_rich_tree(root)
    rb = os.fsencode(root)
    odd = rb + b"/odd"
    os.mkdir(odd)
    for i, name in enumerate(ODD):
        with open(odd + b"/" + name, "wb") as f:
            f.write(b"x" * i)
    os.mkdir(odd + b"/dir \xff\n")
    os.mkdir(odd + b"/dir \xff\n/empty")
    os.makedirs(rb + b"/empty/nested/deeper")
    flat = rb + b"/flat"
    os.mkdir(flat)
    for i in range(300):
        with open(flat + b"/%s%03d" % (b"\xfe" if i % 7 == 0 else b"f", (i * 37) % 1000), "wb"):
            pass
    os.symlink(b"bad\xff\xfe.bin", odd + b"/link \xff")
    os.symlink(rb + b"/top.txt", odd + b"/absolute")  # inside: rewritten relative
    return root


def _truth(root: Path) -> dict[bytes, os.stat_result]:
    """Every entry under ``root`` by its encoded relative path (os.walk, not fastload)."""
    out = {}
    rb = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(rb):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, rb)] = os.lstat(full)
    return out


def _columns(listing: Listing) -> list[object]:
    cols = (listing.offsets, listing.kind, listing.size, listing.blocks, listing.mode,
            listing.mtime_ns)  # fmt: skip
    return [bytes(listing.paths), *map(list, cols), listing.targets]


def _walk(root: Path, *args: object) -> tuple[Listing, Listing]:
    """The listing of ``root`` from the columns, and from the walk's tuples."""
    cols = _core.walk_columns(root, *args)  # type: ignore[arg-type]
    tuples = _core.walk(root, *args)  # type: ignore[arg-type]
    return Listing.from_walk(cols), Listing.of(tuples.entries())


def test_columns_equal_the_tuples_and_the_file_system(tmp_path: Path) -> None:
    root = _odd_tree(tmp_path / "src")
    listing, old = _walk(root, [], [], False, 4)
    assert _columns(listing) == _columns(old)
    assert [tuple(e) for e in listing] == [tuple(e) for e in old]
    truth = _truth(root)
    paths = list(listing.path_bytes())
    assert paths == sorted(truth)  # every entry, once, in byte order
    assert listing.is_sorted()
    assert b"odd/bad\xff\xfe.bin" in paths and b"odd/dir \xff\n/empty" in paths
    assert listing.path(paths.index(b"odd/new\nline")) == "odd/new\nline"
    assert listing.path(paths.index(b"odd/bad\xff\xfe.bin")) == "odd/bad\udcff\udcfe.bin"
    for i, p in enumerate(paths):
        st = truth[p]
        kind = DIR if stat.S_ISDIR(st.st_mode) else LINK if stat.S_ISLNK(st.st_mode) else FILE
        assert listing.kind[i] == kind, p
        assert listing.mode[i] == st.st_mode & 0o7777, p
        assert listing.mtime_ns[i] == st.st_mtime_ns, p
        if kind == FILE:
            assert (listing.size[i], listing.blocks[i]) == (st.st_size, st.st_blocks), p
    links = {paths[i]: t for i, t in listing.targets.items()}
    assert set(links) == {p for p, st in truth.items() if stat.S_ISLNK(st.st_mode)}
    assert links[b"odd/link \xff"] == "bad\udcff\udcfe.bin"
    assert links[b"odd/absolute"] == "../top.txt"
    assert links[b"link_to_file"] == "data/file.bin"
    assert sum(listing.size[i] for i in range(len(listing)) if listing.kind[i] == FILE) == sum(
        truth[p].st_size for p in paths if stat.S_ISREG(truth[p].st_mode)
    )


def test_selection_and_special_files_as_the_tuples(tmp_path: Path) -> None:
    root = _odd_tree(tmp_path / "src")
    os.mkfifo(root / "odd" / "fifo")
    for args in (
        (["*.txt"], [], True, 2),
        ([], ["flat", "odd/dir*"], True, 3),
        (["odd/*"], ["*.bin"], True, 1),
    ):
        listing, old = _walk(root, *args)
        assert _columns(listing) == _columns(old), args
        assert len(listing) > 0
    cols = _core.walk_columns(root, [], [], True, 2)
    assert cols["skipped"] == ["odd/fifo"] == _core.walk(root, [], [], True, 2).skipped
    assert b"odd/fifo" not in Listing.from_walk(cols).path_bytes()
    with pytest.raises(OSError, match="FIFO") as tuples_error:
        _core.walk(root, [], [], False, 2)
    with pytest.raises(OSError, match="FIFO") as columns_error:
        _core.walk_columns(root, [], [], False, 2)
    assert str(columns_error.value) == str(tuples_error.value)


def test_empty_and_missing_trees(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    cols = _core.walk_columns(tmp_path / "empty", [], [], False, 2)
    assert (cols["files"], cols["total_bytes"], cols["skipped"]) == (0, 0, [])
    listing = Listing.from_walk(cols)
    assert set(cols) == {"files", "total_bytes", "skipped"}  # the columns taken out
    assert len(listing) == 0 and list(listing.offsets) == [0] and bytes(listing.paths) == b""
    with pytest.raises(FileNotFoundError, match="missing"):
        _core.walk_columns(tmp_path / "missing", [], [], False, 2)


def test_an_odd_tree_stages_and_restages(tmp_path: Path) -> None:
    src, dst = _odd_tree(tmp_path / "src"), tmp_path / "dst"
    first = fastload.stage(src, dst)
    files = sum(1 for st in _truth(src).values() if stat.S_ISREG(st.st_mode))
    assert first.files == first.copied_files == files
    # The absolute link inside the tree points into the copy, the rest is the same.
    assert os.readlink(dst / "odd" / "absolute") == "../top.txt"
    assert (dst / "odd" / "absolute").read_bytes() == (src / "top.txt").read_bytes()
    os.unlink(dst / "odd" / "absolute")
    os.unlink(src / "odd" / "absolute")
    trees.assert_same_tree(src, dst)
    assert os.path.exists(os.fsencode(dst) + b"/odd/bad\xff\xfe.bin")
    assert os.readlink(os.fsencode(dst) + b"/odd/link \xff") == b"bad\xff\xfe.bin"
    assert fastload.stage(src, dst).copied_files == 0
    (src / "odd" / "new\nline").write_bytes(b"changed")
    assert fastload.stage(src, dst).copied_files == 1
    trees.assert_same_tree(src, dst)
    assert fastload.verify(dst).ok


def test_the_columnar_walk_holds_no_object_per_entry(tmp_path: Path) -> None:
    """The Python memory of listing 20,000 files through the columns: under 100 bytes per
    entry at its peak (the walk's tuples: over 250)."""
    n = 20_000
    root = tmp_path / "many"
    for d in range(n // 1000):
        folder = os.fsencode(root) + b"/d%04d" % d
        os.makedirs(folder)
        for i in range(1000):
            os.close(os.open(folder + b"/f%07d.bin" % (d * 1000 + i), os.O_CREAT | os.O_WRONLY))
    tracemalloc.start()
    try:
        listing = Listing.from_walk(_core.walk_columns(root, [], [], False, 4))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(listing) == n + n // 1000
    assert listing.path(len(listing) - 1) == f"d{n // 1000 - 1:04d}/f{n - 1:07d}.bin"
    assert peak / len(listing) < 100, f"{peak / len(listing):.0f} bytes per entry"
