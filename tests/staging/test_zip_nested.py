"""unpack="nested" with zips (issue 53): a tree holding zips (ScanNet's layout,
``scans/scene0000_00/*.zip``) and a zip holding zips (stored and deflated) are staged
with each inner zip extracted into a folder of its name without ``.zip``; a re-stage
finds every part done by its own manifest; a changed inner zip is extracted again."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

import fastload
from kit import trees, zips


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
