"""Tars of tars (``unpack="nested"``, ImageNet's train tar): every inner tar extracted
into the folder of its name, compared with GNU tar run in a shell loop over the inner
tars; inner tars kept as files when nesting is off; include/exclude through both levels."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import tars, trees

pytestmark = pytest.mark.native

Stage = Callable[..., Any]



def _inner_files(root: Path, cls: str, n: int, seed: int) -> None:

    rng = random.Random(seed)
    for j in range(n):
        trees.write_file(root / f"{cls}_{j:04d}.JPEG",
                           b"\xff\xd8\xff\xe0" + rng.randbytes(rng.randrange(100, 40_000)),
                           mtime_index=seed * 100 + j)


def build_nested(base: Path, outer: str) -> Path:
    """An ImageNet-like tar of tars: class tars in several formats (one with a
    subdirectory, one made by GNU tar with "./" names, one inside a directory), a plain
    README and a labels directory beside them."""
    work = base / "work"
    osrc = base / "outer-src"
    osrc.mkdir(parents=True)
    # n0001: tarfile GNU, with a subdirectory and a symlink inside.
    _inner_files(work / "n0001", "n0001", 6, 1)
    _inner_files(work / "n0001" / "sub", "n0001_sub", 2, 2)
    os.symlink("n0001_0000.JPEG", work / "n0001" / "alias.JPEG")
    tars.py_create(work / "n0001", osrc / "n0001.tar", "gnu")
    # n0002: GNU tar posix, "./" member names.
    _inner_files(work / "n0002", "n0002", 5, 3)
    tars.gnu_create(work / "n0002", osrc / "n0002.tar", "posix")
    # n0003: tarfile ustar.
    _inner_files(work / "n0003", "n0003", 5, 4)
    tars.py_create(work / "n0003", osrc / "n0003.tar", "ustar")
    # train/n0004: tarfile pax, one level down.
    _inner_files(work / "n0004", "n0004", 4, 5)
    (osrc / "train").mkdir()
    tars.py_create(work / "n0004", osrc / "train" / "n0004.tar", "pax")
    trees.write_file(osrc / "README.txt", b"an imagenet-like archive\n", mtime_index=900)
    trees.write_file(osrc / "labels" / "map.txt", b"n0001 tench\nn0002 goldfish\n",
                       mtime_index=901)
    for p in osrc.rglob("*.tar"):
        trees.set_mtime(p, 950)
    if outer == "tarfile-gnu":
        return tars.py_create(osrc, base / "train.tar", "gnu")
    if outer == "gnutar-posix":
        return tars.gnu_create(osrc, base / "train.tar", "posix", dot=False)
    if outer == "gnutar-gnu-gz":
        return tars.gnu_create(osrc, base / "train.tar.gz", "gnu", dot=False, extra=["-z"])
    raise ValueError(outer)


class Nested:
    def __init__(self, archive: Path, ref: Path, made_dirs: set[str], explicit: set[str],
                 flat_ref: Path) -> None:
        self.archive = archive
        self.ref = ref
        self.made_dirs = made_dirs
        self.explicit = explicit
        self.flat_ref = flat_ref


@pytest.fixture(scope="session")
def nested_archive(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Nested]:
    cache: dict[str, Nested] = {}

    def get(outer: str) -> Nested:
        if outer not in cache:
            base = tmp_path_factory.mktemp(f"nested-{outer}")
            a = build_nested(base, outer)
            ref, made_dirs = tars.gnu_extract_nested(a, base / "ref")
            flat_ref = tars.gnu_extract(a, base / "flat-ref")
            cache[outer] = Nested(a, ref, made_dirs, tars.explicit_dirs(a, nested=True), flat_ref)
        return cache[outer]

    return get


@pytest.mark.parametrize("outer", ["tarfile-gnu", "gnutar-posix", "gnutar-gnu-gz"])
def test_nested_matches_the_shell_loop(stage: Stage, nested_archive: Callable[[str], Nested],
                                       tmp_path: Path, outer: str) -> None:
    n = nested_archive(outer)
    assert n.made_dirs == {"n0001", "n0002", "n0003", "train/n0004"}
    dst = tmp_path / "dst"
    res = stage(n.archive, dst, unpack="nested")
    tars.assert_same_extraction(n.ref, dst, explicit=n.explicit, skip_meta=n.made_dirs)
    trees.assert_no_tmp(dst)
    files = trees.regular_files(n.ref)
    assert (res.files, res.bytes) == (len(files), sum(files.values()))
    assert not list(dst.rglob("*.tar")), "an inner tar was written to disk"
    assert fastload.verify(dst).ok


def test_nested_off_keeps_inner_tars(stage: Stage, nested_archive: Callable[[str], Nested],
                                     tmp_path: Path) -> None:
    n = nested_archive("tarfile-gnu")
    dst = tmp_path / "dst"
    stage(n.archive, dst)  # unpack="auto": the outer archive only
    tars.assert_same_extraction(n.flat_ref, dst, explicit=tars.explicit_dirs(n.archive))
    assert (dst / "n0001.tar").read_bytes() == (n.flat_ref / "n0001.tar").read_bytes()


NESTED_FILTERS = [
    pytest.param(["n0001/*"], None, id="include-one-class"),
    pytest.param(None, ["n0002/*", "*.txt"], id="exclude-class-and-txt"),
    pytest.param(["*_0003.JPEG"], None, id="include-basename"),
    pytest.param(["train/*"], None, id="star-crosses-slash"),
    pytest.param(["n000[13]/*"], ["*sub*"], id="include-and-exclude"),
]


@pytest.mark.parametrize(("include", "exclude"), NESTED_FILTERS)
def test_nested_include_exclude(stage: Stage, nested_archive: Callable[[str], Nested],
                                tmp_path: Path, include: list[str] | None,
                                exclude: list[str] | None) -> None:
    """Globs apply to the output path (n0001/x.JPEG), not to the outer member
    (n0001.tar)."""
    n = nested_archive("tarfile-gnu")
    ref_files = trees.regular_files(n.ref)
    want = tars.selected(ref_files, include, exclude)
    assert want and want != set(ref_files), "the filter must select some, not all"
    dst = tmp_path / "dst"
    res = stage(n.archive, dst, unpack="nested", include=include, exclude=exclude)
    got = set(trees.regular_files(dst))
    assert got == want, f"missing {sorted(want - got)[:10]}, unexpected {sorted(got - want)[:10]}"
    for rel in want:
        assert trees.describe(dst / rel) == trees.describe(n.ref / rel), rel
    assert (res.files, res.bytes) == (len(want), sum(ref_files[p] for p in want))
    assert not list(dst.rglob("*.tar"))
