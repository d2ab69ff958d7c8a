"""Zip archives staged as trees (issue 53): zips made by Info-ZIP zip, bsdtar and Python's
zipfile (zip64 forced, data descriptors, bzip2, lzma) extracted exactly as ``unzip``
extracts them; once per destination (a re-stage does nothing), verify, include and
exclude, legacy names, unpack=False, the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import pytest

import fastload
from fastload.staging.state import read_manifest
from kit import trees, zips

Make = Callable[[Path, Path], Path]

MAKERS: dict[str, Make] = {
    "infozip": lambda src, out: zips.infozip(src, out),
    "infozip-stored": lambda src, out: zips.infozip(src, out, "-0"),
    "infozip-zip64": lambda src, out: zips.infozip(src, out, "-fz"),
    "bsdtar": zips.bsdtar_zip,
    "zipfile": lambda src, out: zips.py_zip(src, out),
    "zipfile-zip64": lambda src, out: zips.py_zip(src, out, zip64=True),
    "zipfile-descriptors": lambda src, out: zips.py_zip(src, out, descriptors=True),
    "zipfile-bzip2": lambda src, out: zips.py_zip(src, out, method=zipfile.ZIP_BZIP2),
    "zipfile-lzma": lambda src, out: zips.py_zip(src, out, method=zipfile.ZIP_LZMA),
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zips.build_tree(tmp_path_factory.mktemp("zip-tree") / "src")


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_extracts_as_unzip_does(maker: str, tree: Path, tmp_path: Path) -> None:
    archive = MAKERS[maker](tree, tmp_path / "data.zip")
    # unzip reads no lzma: its reference is the same tree zipped with deflate.
    readable = zips.py_zip(tree, tmp_path / "deflate.zip") if "lzma" in maker else archive
    ref = zips.unzip_ref(readable, tmp_path / "ref")
    res = fastload.stage(archive, tmp_path / "dst")
    zips.assert_same_extraction(archive, ref, tmp_path / "dst")
    files = trees.regular_files(ref)
    assert (res.files, res.bytes, res.copied_files) == (len(files), sum(files.values()),
                                                        len(files))  # fmt: skip
    m = read_manifest(tmp_path / "dst")
    assert m is not None and m["complete"] and m["archive"]["compression"] == "zip"
    assert set(m["files"]) == set(files)
    assert m["symlinks"] == {"a/link": "b/random.bin"}
    again = fastload.stage(archive, tmp_path / "dst")
    assert again.skipped and again.copied_files == 0
    assert fastload.verify(tmp_path / "dst").ok


def test_zip64_records_and_descriptors_are_used(tree: Path, tmp_path: Path) -> None:
    """The archives really carry what they are meant to test."""
    z64 = zips.infozip(tree, tmp_path / "z64.zip", "-fz").read_bytes()
    assert b"PK\x06\x06" in z64 and b"PK\x06\x07" in z64  # zip64 end records
    forced = zips.py_zip(tree, tmp_path / "forced.zip", zip64=True)
    with zipfile.ZipFile(forced) as zf:
        info = zf.getinfo("a/text.txt")
    head = forced.read_bytes()[info.header_offset :]
    assert head[26 + 4 : 26 + 4] == b"" and b"\x01\x00" in head[30 + 10 : 30 + 14]
    dd = zips.py_zip(tree, tmp_path / "dd.zip", descriptors=True)
    with zipfile.ZipFile(dd) as zf:
        assert all(i.flag_bits & 0x8 for i in zf.infolist() if not i.is_dir())


def test_resume_rewrites_only_what_is_missing(tree: Path, tmp_path: Path) -> None:
    archive = zips.infozip(tree, tmp_path / "data.zip")
    dst = tmp_path / "dst"
    fastload.stage(archive, dst)
    (dst / "a" / "text.txt").unlink()
    (dst / "a" / "b" / "random.bin").write_bytes(b"damaged")
    res = fastload.stage(archive, dst)  # the manifest matches: trusted as it is
    assert res.skipped
    bad = fastload.verify(dst)
    assert sorted(bad.mismatched + bad.missing) == ["a/b/random.bin", "a/text.txt"]
    res = fastload.stage(archive, dst)
    assert res.copied_files == 2, res
    zips.assert_same_extraction(archive, zips.unzip_ref(archive, tmp_path / "ref"), dst)


def test_include_exclude_select_members(tree: Path, tmp_path: Path) -> None:
    archive = zips.infozip(tree, tmp_path / "data.zip")
    fastload.stage(archive, tmp_path / "inc", include=["*.txt"])
    got = sorted(trees.regular_files(tmp_path / "inc"))
    assert got == ["a/text.txt", "café/naïve name.txt"]
    fastload.stage(archive, tmp_path / "exc", exclude=["a/*"])
    assert sorted(trees.regular_files(tmp_path / "exc")) == ["café/naïve name.txt"]
    with pytest.raises(FileNotFoundError, match="matched nothing"):
        fastload.stage(archive, tmp_path / "none", include=["*.nothing"])


def test_detected_by_content_and_copied_with_unpack_false(tree: Path, tmp_path: Path) -> None:
    archive = zips.infozip(tree, tmp_path / "data.zip")
    unnamed = tmp_path / "data.bin"
    shutil.copy(archive, unnamed)
    fastload.stage(unnamed, tmp_path / "dst")
    assert (tmp_path / "dst" / "a" / "run.sh").read_bytes() == b"#!/bin/sh\necho hi\n"
    res = fastload.stage(archive, tmp_path / "copy", unpack=False)
    assert res.files == 1 and (tmp_path / "copy").read_bytes() == archive.read_bytes()


def test_legacy_names_in_cp437_or_another_code_page(tmp_path: Path) -> None:
    data = zips.member_bytes([("cafXX.txt", b"x")], system=0)  # made on MS-DOS
    (tmp_path / "legacy.zip").write_bytes(zips.rename_member(data, b"cafXX", b"caf\x82\x82"))
    fastload.stage(tmp_path / "legacy.zip", tmp_path / "dos")
    assert os.listdir(tmp_path / "dos") == ["caféé.txt"]  # CP437: 0x82 is é
    fastload.stage(tmp_path / "legacy.zip", tmp_path / "latin",
                   zip_options={"encoding": "latin-1"})  # fmt: skip
    assert os.listdir(tmp_path / "latin") == ["caf\x82\x82.txt"]
    with pytest.raises(ValueError, match="unknown encoding"):
        fastload.stage(tmp_path / "legacy.zip", tmp_path / "x", zip_options={"encoding": "no"})


def test_cli_extracts_a_zip_with_stats(tree: Path, tmp_path: Path) -> None:
    archive = zips.infozip(tree, tmp_path / "data.zip")
    out = subprocess.run(
        [sys.executable, "-m", "fastload", "stage", str(archive), str(tmp_path / "dst"),
         "--stats", "--no-progress", "--zip-max-ratio", "5000"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    files = len(trees.regular_files(tree))
    assert f"staged {files} of {files} files" in out.stdout, out.stdout
    zips.assert_same_extraction(archive, zips.unzip_ref(archive, tmp_path / "ref"),
                                tmp_path / "dst")  # fmt: skip


def test_empty_zip(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "empty.zip", "w"):
        pass
    res = fastload.stage(tmp_path / "empty.zip", tmp_path / "dst")
    assert res.files == 0 and os.listdir(tmp_path / "dst") == []


def test_resolve_extracts_a_zip_with_its_checksum(tree: Path, tmp_path: Path) -> None:
    import hashlib

    archive = zips.infozip(tree, tmp_path / "mydata.zip")
    digest = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    path = fastload.resolve(archive, destination=tmp_path / "staged" / "{name}", checksum=digest)
    assert path == tmp_path / "staged" / "mydata"
    zips.assert_same_extraction(archive, zips.unzip_ref(archive, tmp_path / "ref"), path)
    with pytest.raises(fastload.ChecksumMismatchError, match="nothing was extracted"):
        fastload.stage(archive, tmp_path / "bad", checksum="sha256:" + "0" * 64)
    assert not (tmp_path / "bad" / "a").exists()


def test_progress_and_stats(tree: Path, tmp_path: Path) -> None:
    archive = zips.infozip(tree, tmp_path / "data.zip")
    calls: list[tuple[int, int, int, int]] = []
    res = fastload.stage(archive, tmp_path / "dst", progress=lambda *a: calls.append(a),
                         stats=True)  # fmt: skip
    assert calls and calls[-1] == (res.bytes, res.bytes, res.files, res.files)
    assert all(a[0] <= a[1] for a in calls)
    assert res.stats is not None and res.stats.listing_seconds > 0
    assert res.stats.read_busy_seconds > 0 and res.stats.write_busy_seconds > 0


@pytest.mark.parametrize("adjusted", [False, True], ids=["raw-prefix", "zip-A"])
def test_bytes_before_the_archive(adjusted: bool, tree: Path, tmp_path: Path) -> None:
    """A self-extractor's stub before the zip: offsets relative to the zip (found from
    where the central directory really is) or adjusted to the file (``zip -A``)."""
    plain = zips.infozip(tree, tmp_path / "plain.zip")
    archive = tmp_path / "sfx.zip"
    archive.write_bytes(os.urandom(1000) + plain.read_bytes())
    if adjusted:
        zips.run(["zip", "-qA", str(archive)])
    fastload.stage(archive, tmp_path / "dst")
    zips.assert_same_extraction(plain, zips.unzip_ref(plain, tmp_path / "ref"), tmp_path / "dst")


def test_fanout_in_a_single_process_is_a_plain_stage(tree: Path, tmp_path: Path) -> None:
    """fanout=True in a single process is a plain stage, nested or not (several nodes:
    test_zip_fanout.py)."""
    archive = zips.infozip(tree, tmp_path / "data.zip")
    res = fastload.stage(archive, tmp_path / "dst", fanout=True)
    assert res.files == len(trees.regular_files(tree)) and res.nodes == 1
    res = fastload.stage(archive, tmp_path / "nested", fanout=True, unpack="nested")
    assert res.files == len(trees.regular_files(tree)) and res.nodes == 1
