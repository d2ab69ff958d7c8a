"""unpack="nested" with zips (issue 53): a tree holding zips (ScanNet's layout,
``scans/scene0000_00/*.zip``), a zip holding zips (stored and deflated), a tar holding
zips and a zip holding tars are staged with each inner archive extracted into a folder
of its name without its suffix, as ``tar -x`` and ``unzip`` give level by level; a
re-stage finds every part done by its own manifest; a changed inner zip is extracted
again; a hostile inner zip is refused naming the outer archive, the inner one and the
member."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.staging.zipformat import ZipFormatError
from kit import tars, trees, zips
from kit.web import serving
from sources.s3server import upload_file


def staged(dst: Path) -> dict[str, bytes]:
    """The files staged, without the state of the inner zips' stages (the dot entries
    beside their folders)."""
    return {rel: (dst / rel).read_bytes() for rel in trees.regular_files(dst)
            if not any(part.startswith(".") for part in rel.split("/"))}  # fmt: skip


def _scene_zips(root: Path, scenes: int = 3) -> dict[str, bytes]:
    """ScanNet-like: per scene a _2d-label.zip and a _2d-instance.zip of small PNG-like
    files, and a plain .txt beside them. Returns the expected staged files."""
    want: dict[str, bytes] = {}
    for s in range(scenes):
        scene = f"scene{s:04d}_00"
        d = root / "scans" / scene
        d.mkdir(parents=True)
        (d / f"{scene}.txt").write_bytes(f"axis {s}\n".encode())
        want[f"scans/{scene}/{scene}.txt"] = f"axis {s}\n".encode()
        for kind in ("2d-label", "2d-instance"):
            with zipfile.ZipFile(d / f"{scene}_{kind}.zip", "w", zipfile.ZIP_DEFLATED) as zf:
                for i in range(20):
                    body = os.urandom(500) + bytes([i]) * 300
                    name = f"{kind.replace('2d-', '')}-filt/{i}.png"
                    zf.writestr(name, body)
                    want[f"scans/{scene}/{scene}_{kind}/{name}"] = body
    return want


def test_a_tree_of_zips(tmp_path: Path) -> None:
    want = _scene_zips(tmp_path / "src")
    res = fastload.stage(tmp_path / "src", tmp_path / "dst", unpack="nested")
    got = staged(tmp_path / "dst")
    assert got == want
    assert (res.files, res.copied_files) == (len(want), len(want))
    again = fastload.stage(tmp_path / "src", tmp_path / "dst", unpack="nested")
    assert again.skipped and again.copied_files == 0
    # One inner zip changes: only it is extracted again.
    inner = tmp_path / "src" / "scans" / "scene0001_00" / "scene0001_00_2d-label.zip"
    with zipfile.ZipFile(inner, "a") as zf:
        zf.writestr("label-filt/new.png", b"new")
    res = fastload.stage(tmp_path / "src", tmp_path / "dst", unpack="nested")
    assert res.copied_files == 1 and not res.skipped
    assert (tmp_path / "dst/scans/scene0001_00/scene0001_00_2d-label/label-filt/new.png"
            ).read_bytes() == b"new"  # fmt: skip
    # Without "nested" a tree's zips are copied as files.
    fastload.stage(tmp_path / "src", tmp_path / "plain")
    assert (tmp_path / "plain/scans/scene0000_00/scene0000_00_2d-label.zip").is_file()


def test_a_zip_named_in_capitals_is_extracted_not_also_copied(tmp_path: Path) -> None:
    """``SCAN.ZIP`` and ``b.Zip`` are zips as ``scan.zip`` is (their names are told
    without case): each extracted into its folder, neither also copied as a file (the
    tree's listing left out only ``*.zip``: both landed, and the file count said 4)."""
    src = tmp_path / "src"
    (src / "s").mkdir(parents=True)
    with zipfile.ZipFile(src / "s" / "SCAN.ZIP", "w") as zf:
        zf.writestr("x.txt", b"upper")
    with zipfile.ZipFile(src / "s" / "b.Zip", "w") as zf:
        zf.writestr("y.txt", b"mixed")
    (src / "a.txt").write_bytes(b"plain")
    res = fastload.stage(src, tmp_path / "dst", unpack="nested")
    assert staged(tmp_path / "dst") == {"a.txt": b"plain", "s/SCAN/x.txt": b"upper",
                                        "s/b/y.txt": b"mixed"}  # fmt: skip
    assert res.files == 3
    assert fastload.stage(src, tmp_path / "dst", unpack="nested").skipped


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_zip_of_zips(method: int, tmp_path: Path) -> None:
    want = _scene_zips(tmp_path / "src", scenes=2)
    outer = tmp_path / "scans.zip"
    with zipfile.ZipFile(outer, "w", method) as zf:
        for p in sorted((tmp_path / "src").rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(tmp_path / "src").as_posix())
    res = fastload.stage(outer, tmp_path / "dst", unpack="nested")
    got = staged(tmp_path / "dst")
    assert got == want and res.files == len(want)
    assert fastload.stage(outer, tmp_path / "dst", unpack="nested").skipped
    assert not [p for p in (tmp_path / ".dst.fastload").iterdir() if p.name.startswith(".inner")]
    flat = fastload.stage(outer, tmp_path / "flat")
    assert flat.files == 2 + 4  # the txt files and the four inner zips, as files
    zips.assert_same_extraction(outer, zips.unzip_ref(outer, tmp_path / "ref"), tmp_path / "flat")


def _inner_sources(base: Path) -> tuple[Path, Path]:
    """A folder of files to pack, and a folder ``outer`` where the inner archives made
    of it are put (by Info-ZIP ``zip``, Python's zipfile, GNU tar, GNU tar -z)."""
    files = base / "files"
    for i in range(6):
        trees.write_file(files / "frames" / f"{i}.png", os.urandom(300) + bytes([i]) * 700,
                         mtime_index=i)  # fmt: skip
    trees.write_file(files / "meta.txt", b"six frames\n", mtime_index=9)
    return files, base / "outer"


def _unpack_level(ref: Path, suffixes: tuple[str, ...], keep: bool) -> None:
    """Each archive in ``ref`` named with one of ``suffixes`` extracted by ``unzip`` or
    GNU tar into the folder of its name without the suffix (the archive removed unless
    ``keep``)."""
    for p in sorted(ref.rglob("*")):
        suffix = next((s for s in suffixes if p.name.endswith(s)), None)
        if suffix is None or not p.is_file():
            continue
        folder = p.with_name(p.name[: -len(suffix)])
        if suffix == ".zip":
            shutil.copytree(zips.unzip_ref(p, ref.parent / "unzip-tmp"), folder,
                            dirs_exist_ok=True)  # fmt: skip
            shutil.rmtree(ref.parent / "unzip-tmp")
        else:
            tars.gnu_extract(p, folder)
        if not keep:
            p.unlink()


@pytest.mark.parametrize("outer_kind", ["tar", "tar.gz"])
def test_zips_in_a_tar(outer_kind: str, tmp_path: Path) -> None:
    """A tar (GNU tar, plain or gzip) holding zips: the tar's members are extracted,
    and each zip into its folder (the zip not kept, as an inner tar is not)."""
    files, outer = _inner_sources(tmp_path)
    (outer / "scans").mkdir(parents=True)
    zips.infozip(files, (outer / "scans" / "a_2d-label.zip").resolve())
    zips.py_zip(files, outer / "scans" / "b_2d-instance.zip")
    trees.write_file(outer / "scans" / "a.txt", b"axis\n", mtime_index=20)
    archive = tars.gnu_create(outer, tmp_path / f"scans.{outer_kind}", "posix",
                              extra=["-z"] if outer_kind == "tar.gz" else [])  # fmt: skip
    ref = tars.gnu_extract(archive, tmp_path / "ref")
    _unpack_level(ref, (".zip",), keep=False)
    want = staged(ref)
    assert "scans/a_2d-label/frames/5.png" in want and "scans/b_2d-instance/meta.txt" in want
    dst = tmp_path / "dst"
    res = fastload.stage(archive, dst, unpack="nested")
    assert staged(dst) == want and res.files == len(want)
    assert not list(tmp_path.glob("dst/**/*.zip")) and not list(tmp_path.rglob("zips/*"))
    assert all(fastload.verify(d).ok for d in (dst, dst / "scans" / "a_2d-label"))
    again = fastload.stage(archive, dst, unpack="nested")
    assert again.skipped and again.copied_files == 0 and again.files == len(want)
    # A zip's folder deleted: the next stage puts it back (from the tar: the zip is gone).
    shutil.rmtree(dst / "scans" / "a_2d-label")
    res = fastload.stage(archive, dst, unpack="nested")
    assert staged(dst) == want and not res.skipped and res.files == len(want)


@pytest.mark.parametrize("outer_maker", ["infozip", "zipfile-stored"])
def test_tars_in_a_zip(outer_maker: str, tmp_path: Path) -> None:
    """A zip (Info-ZIP deflated, or Python's zipfile stored) holding tars (GNU tar,
    plain and gzip, one a folder down): each tar is extracted into its folder, none
    is left as a file, and a re-stage decodes nothing."""
    files, outer = _inner_sources(tmp_path)
    tars.gnu_create(files, outer / "n0001.tar", "gnu")
    tars.gnu_create(files, outer / "train" / "n0002.tar.gz", "posix", extra=["-z"])
    trees.write_file(outer / "README.txt", b"two tars\n", mtime_index=30)
    archive = tmp_path / "train.zip"
    if outer_maker == "infozip":
        zips.infozip(outer, archive)
    else:
        zips.py_zip(outer, archive, method=zipfile.ZIP_STORED)
    ref = zips.unzip_ref(archive, tmp_path / "ref")
    _unpack_level(ref, (".tar.gz", ".tar"), keep=False)
    want = staged(ref)
    assert "n0001/frames/3.png" in want and "train/n0002/meta.txt" in want
    dst = tmp_path / "dst"
    res = fastload.stage(archive, dst, unpack="nested")
    assert staged(dst) == want and res.files == len(want)
    assert not list(dst.rglob("*.tar*")), "an inner tar was left as a file"
    assert fastload.verify(dst / "train" / "n0002").ok
    again = fastload.stage(archive, dst, unpack="nested")
    assert again.skipped and again.copied_files == 0
    assert not [p for p in (tmp_path / ".dst.fastload").iterdir() if p.name.startswith(".inner")]


def test_a_hostile_zip_in_a_tar(tmp_path: Path) -> None:
    """A zip inside a tar with a member climbing out: refused naming the tar, the zip and
    the member; nothing of it is written, inside the destination or above it; a
    re-stage refuses it again (the tar's stage is complete, the zip's is not)."""
    outer = tmp_path / "outer"
    outer.mkdir()
    with zipfile.ZipFile(outer / "bad.zip", "w") as zf:
        zf.writestr("ok.txt", b"fine")
        zf.writestr("../evil.txt", b"evil")
    archive = tars.gnu_create(outer, tmp_path / "outer.tar", "posix", dot=False)
    dst = tmp_path / "dst"
    for _ in range(2):
        with pytest.raises(ZipFormatError,
                           match=r"outer\.tar!/bad\.zip', member '\.\./evil\.txt'"):
            fastload.stage(archive, dst, unpack="nested")
        assert not list(tmp_path.rglob("evil*"))


def _tar_of_zips(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A GNU tar holding two zips (Info-ZIP, zipfile) and a file; and what a stage with
    unpack="nested" gives: ``tar -x``, then ``unzip`` of each zip into its folder."""
    files, outer = _inner_sources(tmp_path)
    (outer / "scans").mkdir(parents=True)
    zips.infozip(files, (outer / "scans" / "a_2d-label.zip").resolve())
    zips.py_zip(files, outer / "scans" / "b_2d-instance.zip")
    trees.write_file(outer / "scans" / "a.txt", b"axis\n", mtime_index=20)
    archive = tars.gnu_create(outer, tmp_path / "scans.tar", "posix")
    ref = tars.gnu_extract(archive, tmp_path / "ref")
    _unpack_level(ref, (".zip",), keep=False)
    want = staged(ref)
    assert "scans/a_2d-label/frames/5.png" in want and "scans/b_2d-instance/meta.txt" in want
    return archive, want


def test_zips_in_a_tar_from_s3(s3: Any, bucket: str, tmp_path: Path) -> None:
    """A tar in the loopback S3 server holding zips: each zip extracted into its folder
    (they stayed files); a re-stage is skipped."""
    archive, want = _tar_of_zips(tmp_path)
    upload_file(s3, bucket, "sets/scans.tar", archive)
    url = f"s3://{bucket}/sets/scans.tar"
    dst = tmp_path / "dst"
    res = fastload.stage(url, dst, unpack="nested")
    assert staged(dst) == want and res.files == len(want)
    assert not list(dst.rglob("*.zip"))
    again = fastload.stage(url, dst, unpack="nested")
    assert again.skipped and again.copied_files == 0 and again.files == len(want)


def test_zips_in_a_tar_over_http(tmp_path: Path) -> None:
    """A tar behind an HTTP server holding zips: each zip extracted into its folder."""
    archive, want = _tar_of_zips(tmp_path)
    with serving(archive.parent) as server:
        res = fastload.stage(server.url(archive.name), tmp_path / "dst", unpack="nested")
    assert staged(tmp_path / "dst") == want and res.files == len(want)


def test_zips_in_a_tar_stream(tmp_path: Path) -> None:
    """A tar read as a stream (a file object, as stdin is) holding zips: each zip
    extracted into its folder; a re-stage (a stream is read again) keeps the files."""
    archive, want = _tar_of_zips(tmp_path)
    dst = tmp_path / "dst"
    for _ in range(2):
        with open(archive, "rb") as f:
            res = fastload.stage(f, dst, unpack="nested")
        assert staged(dst) == want and res.files == len(want)
        assert not list(dst.rglob("*.zip")) and not list(tmp_path.rglob("zips/*"))


def test_zips_in_the_tars_of_a_zip(tmp_path: Path) -> None:
    """A zip holding a tar holding zips: the tar into its folder, its zips into theirs;
    a re-stage is skipped; a deleted inner zip's folder is put back."""
    tar, _ = _tar_of_zips(tmp_path / "inner")
    top = tmp_path / "top"
    top.mkdir()
    shutil.copyfile(tar, top / "scans.tar")
    trees.write_file(top / "README.txt", b"a tar of zips\n", mtime_index=40)
    archive = zips.infozip(top, tmp_path / "outer.zip")
    ref = zips.unzip_ref(archive, tmp_path / "ref")
    _unpack_level(ref, (".tar",), keep=False)
    _unpack_level(ref, (".zip",), keep=False)
    want = staged(ref)
    assert "scans/scans/a_2d-label/frames/5.png" in want
    dst = tmp_path / "dst"
    res = fastload.stage(archive, dst, unpack="nested")
    assert staged(dst) == want and res.files == len(want)
    assert not list(dst.rglob("*.zip")) and not list(dst.rglob("*.tar"))
    again = fastload.stage(archive, dst, unpack="nested")
    assert again.skipped and again.copied_files == 0 and again.files == len(want)
    shutil.rmtree(dst / "scans" / "scans" / "b_2d-instance")
    res = fastload.stage(archive, dst, unpack="nested")
    assert staged(dst) == want and not res.skipped and res.files == len(want)
