"""A zip in the loopback S3 server, with the features around it: read while it stages
(``wait=False``: a member asked for first, the listing, verify), ``fastload stage
--background`` then a reader, and resolve() of it on a node-local disk too small for
what it extracts to (``on_full``: the cache, decided before the first byte)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from s3server import upload

import fastload
from fastload.env import OnFullWarning, detect, placements
from fastload.staging.background import Staging
from kit import zips
from kit.trees import MiB

SmallFs = Callable[..., Path]


def _zip_bytes(members: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    return zips.member_bytes(list(members.items()), method=method)


MEMBERS = {f"train/{c}/{i:03d}.jpg": bytes([i]) * (3000 + i) for c in ("cat", "dog")
           for i in range(100)}  # fmt: skip


def test_a_zip_in_s3_read_while_it_stages(s3: Any, bucket: str, tmp_path: Path) -> None:
    upload(s3, bucket, {"sets/pets.zip": _zip_bytes(MEMBERS)})
    url = f"s3://{bucket}/sets/pets.zip"
    h = fastload.stage(url, tmp_path / "dst", wait=False)
    assert h.local("train/dog/099.jpg").read_bytes() == MEMBERS["train/dog/099.jpg"]
    assert h.files() == sorted(MEMBERS)
    with pytest.raises(FileNotFoundError, match=r"train/cow\.jpg"):
        h.local("train/cow.jpg")
    assert h.wait().files == len(MEMBERS)
    assert fastload.verify(tmp_path / "dst").ok
    sel = fastload.stage(url, tmp_path / "cats", wait=False, include=["train/cat/*"])
    assert sel.files() == sorted(k for k in MEMBERS if "/cat/" in k)
    with pytest.raises(FileNotFoundError):
        sel.local("train/dog/000.jpg")  # left out by the selection
    assert sel.wait().files == 100


def test_stage_background_of_a_zip_in_s3_then_a_reader(s3: Any, bucket: str,
                                                       tmp_path: Path) -> None:  # fmt: skip
    upload(s3, bucket, {"sets/pets.zip": _zip_bytes(MEMBERS)})
    url, dst = f"s3://{bucket}/sets/pets.zip", tmp_path / "bg"
    r = subprocess.run([sys.executable, "-m", "fastload", "stage", "--background", url, str(dst)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    h = fastload.stage(url, dst, wait=False)
    assert h.local("train/cat/042.jpg").read_bytes() == MEMBERS["train/cat/042.jpg"]
    assert h.wait().files == len(MEMBERS)
    assert fastload.verify(dst).ok


@pytest.mark.native
@pytest.mark.parametrize("wait", [True, False], ids=["wait", "read-while-staging"])
def test_a_zip_in_s3_extracting_beyond_the_node_goes_to_the_cache(
    s3: Any, bucket: str, tmp_path: Path, small_fs: SmallFs, wait: bool
) -> None:
    """3 MiB of zeros deflated to a few KiB, 1 MiB free on the node: measured by its
    central directory, it goes to the cache at once, an archive "extracted" there. (With
    wait=False it was taken for a small object, staged to the node, and the background
    stage failed with NotEnoughSpaceError after resolve() had returned.)"""
    node = small_fs("1m")
    zeros = {f"z{i}.bin": bytes(MiB) for i in range(3)}
    upload(s3, bucket, {"big/zeros.zip": _zip_bytes(zeros)})
    url = f"s3://{bucket}/big/zeros.zip"
    env = detect({"USER": "bob", "HOME": str(tmp_path / "home"), "FASTLOAD_ENV": "local",
                  "XDG_CONFIG_HOME": str(tmp_path / "no-config"),
                  "FASTLOAD_TMPDIR": str(node), "FASTLOAD_CACHE": str(tmp_path / "cache"),
                  "FASTLOAD_SCRATCH": str(tmp_path / "scratch")}, "node1")  # fmt: skip
    with pytest.warns(OnFullWarning) as record:
        got = fastload.resolve(url, env=env, wait=wait)
    assert "extracting it once into the cache" in str(record[0].message)
    (place,) = placements(node)
    assert (place.where, place.kind) == ("cache", "archive") and place.needed >= 3 * MiB
    if isinstance(got, Staging):
        assert got.wait().files == 3
        got = got.path
    assert env.cache in got.parents
    assert {p.name: p.read_bytes() for p in got.iterdir()} == zeros


def test_stage_background_reports_a_source_failing_while_it_is_listed(
    s3: Any, bucket: str, proxy: Any, tmp_path: Path
) -> None:
    """A hostile zip in a bucket, its central directory held at the proxy: the stage is
    not under way until the zip is listed, and when the listing fails the command must
    exit non-zero with the error naming the archive and the member (the docs: it returns
    "once the stage is under way, or with the process's error where it ended first")."""
    upload(s3, bucket, {"sets/evil.zip": _zip_bytes({"ok.txt": b"x", "../evil.txt": b"x"})})
    url = f"s3://{bucket}/sets/evil.zip"
    proxy.gate.clear()  # the ranged GETs of the central directory wait here
    cmd = subprocess.Popen([sys.executable, "-m", "fastload", "stage", "--background", url,
                            str(tmp_path / "ev")], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        proxy.wait_in_flight(1)
    finally:
        proxy.gate.set()
    out, err = cmd.communicate(timeout=120)
    assert cmd.returncode != 0, out
    assert "member '../evil.txt'" in err and "evil.zip" in err
    assert not (tmp_path / "evil.txt").exists()


def test_a_prefix_of_zips_with_unpack_nested(s3: Any, bucket: str, proxy: Any,
                                             tmp_path: Path) -> None:  # fmt: skip
    """ScanNet uploaded to a bucket (a scene's labels as a zip beside its files), staged
    with unpack="nested": each zip extracted into the folder of its name, read by ranges
    from the store, as a local tree's are (its zips were copied as zips, silently)."""
    labels = {f"label-filt/{i}.png": b"png%d" % i for i in range(3)}
    upload(s3, bucket, {"scannet/scans/s0/s0_2d-label.zip": _zip_bytes(labels),
                        "scannet/scans/s0/s0.txt": b"scene",
                        "scannet/scans/s1/s1_2d-label.zip": _zip_bytes(labels)})  # fmt: skip
    url, dst = f"s3://{bucket}/scannet/", tmp_path / "scannet"
    assert fastload.stage(url, dst, unpack="nested").files == 7
    for scene in ("s0", "s1"):
        folder = dst / "scans" / scene / f"{scene}_2d-label"
        assert {p: (folder / p).read_bytes() for p in labels} == labels
        assert not (folder.parent / f"{scene}_2d-label.zip").exists()
    assert (dst / "scans" / "s0" / "s0.txt").read_bytes() == b"scene"
    check = fastload.verify(dst)
    assert check.ok and check.files == 7
    proxy.reset_counts()
    again = fastload.stage(url, dst, unpack="nested")
    assert again.skipped and again.files == 7
    assert proxy.gets() <= 2 * 2  # each zip's central directory at most, no member's data
