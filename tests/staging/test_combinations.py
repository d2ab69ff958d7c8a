"""Features that each pass their own tests, tried together as a researcher would: a zip
read while it stages (a hostile member, the errors readers get), a registry dataset
that is a zip (``returns``, ``wait=False``), a zip too large for the node-local disk
(``on_full``), ``unpack="nested"`` read while it stages. Real zips, real processes, a
real tmpfs for the node's disk, netsim for a slow shared file system."""

from __future__ import annotations

import os
import pickle
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
import fastload.torchvision as ftv
from fastload.env import Environment, OnFullWarning, detect, placements
from fastload.errors import SourceChangedError
from fastload.staging.background import Staging
from fastload.staging.channel import decode_error, encode_error
from fastload.staging.fanout.exchange import fanout_error
from fastload.staging.zipformat import ZipFormatError, zip_error
from kit import zips
from kit.netsim import mounts
from kit.trees import MiB

SmallFs = Callable[..., Path]


def _zip(path: Path, members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zips.member_bytes(list(members.items()), method=method))
    return path


def _node_env(tmp_path: Path, tmpdir: Path, **extra: str) -> Environment:
    """A simulated node: its node-local disk ``tmpdir``, the rest under ``tmp_path``."""
    values = {
        "USER": "bob", "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "no-config"), "FASTLOAD_ENV": "local",
        "FASTLOAD_TMPDIR": str(tmpdir), "FASTLOAD_CACHE": str(tmp_path / "cache"),
        "FASTLOAD_SCRATCH": str(tmp_path / "scratch"),
        "FASTLOAD_DATASET_ROOTS": str(tmp_path / "datasets"), **extra,
    }  # fmt: skip
    return detect(values, "node1")


# --------------------------------------------------------------------------------------
# Errors readers get through the node-local channel keep their class
# --------------------------------------------------------------------------------------


def test_a_bad_member_read_while_staging_is_a_ZipFormatError(tmp_path: Path) -> None:
    """A reader asks for a member whose CRC-32 is wrong while the stage (from a slow
    shared file system) is still at the start: the readers' job extracts it and the
    reader gets the error over the channel. It is the ZipFormatError (a ValueError) the
    docs promise, naming the archive and the member, not a bare StageError."""
    members = {f"d/{i:03d}.bin": bytes([i]) * 65536 for i in range(160)}
    members["z/bad.bin"] = b"B" * 4096
    data = zips.member_bytes(list(members.items()))
    data = zips.patch_member(data, len(members) - 1, crc=0x12345678)
    src = tmp_path / "src"
    src.mkdir()
    (src / "set.zip").write_bytes(data)
    with mounts(tmp_path) as mount:
        m = mount(src, 2000, 20000)  # 20 ms a read: the stage takes seconds
        h = fastload.stage(m.path / "set.zip", tmp_path / "dst", wait=False, workers=1)
        with pytest.raises(ZipFormatError, match=r"set\.zip', member 'z/bad\.bin'.*CRC") as e:
            h.local("z/bad.bin")
        assert isinstance(e.value, ValueError)
        with pytest.raises(ZipFormatError, match=r"member 'z/bad\.bin'"):
            h.wait()
    assert not (tmp_path / "dst" / "z" / "bad.bin").exists()


@pytest.mark.parametrize("make", [
    lambda: zip_error("/data/set.zip", "a CRC-32 mismatch", "a/b.jpg"),
    lambda: fanout_error("node 2 stopped answering", "/tmp/dst"),
], ids=["ZipFormatError", "FanoutError"])  # fmt: skip
def test_errors_defined_beside_their_code_cross_processes_as_themselves(make: Any) -> None:
    """The channel (and a DataLoader worker, a pool) sends an error pickled: a
    StageError subclass of another module than errors.py arrives as itself."""
    exc = make()
    for back in (pickle.loads(pickle.dumps(exc)), decode_error(encode_error(exc), Path("/x"))):
        assert type(back) is type(exc)
        assert (str(back), back.errno, back.filename) == (str(exc), exc.errno, exc.filename)


@pytest.mark.parametrize("wait", [True, False], ids=["wait", "read-while-staging"])
def test_a_zip_rewritten_while_it_stages_is_a_source_change(tmp_path: Path, wait: bool) -> None:
    """The zip is rewritten in place (a dataset re-uploaded) after the first members are
    out: a later member's CRC-32 no longer matches. That is the source changing
    (SourceChangedError: stage again), not a broken archive (ZipFormatError's "CRC-32
    mismatch" sends the user to check a zip that is fine)."""
    members = {f"d/{i:03d}.bin": bytes([i % 251]) * 50_000 for i in range(300)}
    archive = tmp_path / "set.zip"
    archive.write_bytes(zips.member_bytes(list(members.items())))
    last = bytes([299 % 251]) * 50_000
    rewritten: list[bool] = []

    def rewrite(*_: int) -> None:
        if not rewritten:
            data = archive.read_bytes()
            at = data.rfind(last)
            archive.write_bytes(data[:at] + b"X" * 16 + data[at + 16 :])  # same size
            os.utime(archive, ns=(1, 1))
            rewritten.append(True)

    with pytest.raises(SourceChangedError, match=r"set\.zip.*modified") as e:
        h = fastload.stage(archive, tmp_path / "dst", wait=wait, workers=1, progress=rewrite)
        if isinstance(h, Staging):
            h.wait()
    assert rewritten and not isinstance(e.value, ZipFormatError)
    archive.write_bytes(zips.member_bytes(list(members.items())))
    assert fastload.stage(archive, tmp_path / "dst").files == 300  # resumed
    assert fastload.verify(tmp_path / "dst").ok


# --------------------------------------------------------------------------------------
# A zip larger than the node-local disk (on_full="fallback", the default)
# --------------------------------------------------------------------------------------


@pytest.fixture
def node(small_fs: SmallFs) -> Path:
    """The node-local disk: 1 MiB."""
    return small_fs("1m")


@pytest.mark.native
@pytest.mark.parametrize("wait", [True, False], ids=["wait", "read-while-staging"])
def test_a_zip_too_big_for_the_node_is_extracted_into_the_cache(
    tmp_path: Path, node: Path, wait: bool
) -> None:
    """A zip of 3 MiB, 1 MiB free on the node: it is extracted once into the cache (as
    a tar is), not 'read in place' (which returned the zip file itself to a caller
    expecting a folder, and a handle on a file with wait=False)."""
    members = {f"d/{i}.bin": os.urandom(MiB // 4) for i in range(12)}
    archive = _zip(tmp_path / "shared" / "bigds.zip", members)
    env = _node_env(tmp_path, node)
    with pytest.warns(OnFullWarning) as record:
        got = fastload.resolve(archive, env=env, wait=wait)
    text = str(record[0].message)
    assert "extracting it once into the cache" in text and "in place" not in text
    (place,) = placements(node)
    assert (place.where, place.kind) == ("cache", "archive")
    assert place.needed >= 3 * MiB  # what it extracts to, not the zip's size
    if isinstance(got, Staging):
        assert got.local("d/7.bin").read_bytes() == members["d/7.bin"]
        assert sorted(got.files()) == sorted(members)
        got.wait()
        got = got.path
    assert env.cache in got.parents and got.is_dir()
    assert {p: (got / p).read_bytes() for p in members} == members
    assert not (node / "bigds").exists()


@pytest.mark.native
def test_a_zip_that_extracts_beyond_the_node_is_measured_by_its_members(
    tmp_path: Path, node: Path
) -> None:
    """A deflated zip of 3 MiB of zeros is a few KiB: its central directory says 3 MiB,
    so it goes to the cache before a byte lands on the 1 MiB disk, read while staging
    too (where a background stage that found no room would fail after resolve())."""
    archive = _zip(tmp_path / "shared" / "zeros.zip", {f"z{i}.bin": bytes(MiB) for i in range(3)},
                   zipfile.ZIP_DEFLATED)  # fmt: skip
    assert archive.stat().st_size < 64 * 1024
    with pytest.warns(OnFullWarning):
        h = fastload.resolve(archive, env=_node_env(tmp_path, node), wait=False)
    assert isinstance(h, Staging)
    assert h.wait().files == 3 and h.local("z2.bin").stat().st_size == MiB


def _scannet(root: Path, mib: int = 0) -> Path:
    """ScanNet's layout: a scene's labels as a zip beside its other files."""
    scene = root / "scans" / "scene0000_00"
    members = {f"label-filt/{i}.png": os.urandom(MiB) if mib else b"png%d" % i
               for i in range(max(mib, 3))}  # fmt: skip
    _zip(scene / "scene0000_00_2d-label.zip", members)
    (scene / "scene0000_00.txt").write_text("axisAlignment = 1 0 0 0\n")
    return root


def test_resolve_of_a_tree_of_zips_with_unpack_nested_extracts_them(tmp_path: Path) -> None:
    """resolve(tree, unpack="nested"), as stage() does it: each zip into the folder of its
    name (resolve() gave stage() unpack="auto" for any folder: the zips stayed zips)."""
    src = _scannet(tmp_path / "datasets" / "scannet")
    env = _node_env(tmp_path, tmp_path / "node")
    for name in (src, "scannet"):
        got = fastload.resolve(name, unpack="nested", env=env)
        labels = got / "scans" / "scene0000_00" / "scene0000_00_2d-label"
        assert (labels / "label-filt" / "2.png").read_bytes() == b"png2"
        assert not (labels.parent / "scene0000_00_2d-label.zip").exists()


@pytest.mark.native
def test_a_tree_of_zips_too_big_for_the_node_is_extracted_into_the_cache(
    tmp_path: Path, node: Path
) -> None:
    """The same tree, 3 MiB of labels, 1 MiB free: it cannot be read in place (its zips
    are to be extracted), so it goes to the cache, extracted, as an archive does; a tree
    without zips is still read in place."""
    src = _scannet(tmp_path / "shared" / "scannet", mib=3)
    env = _node_env(tmp_path, node)
    with pytest.warns(OnFullWarning) as record:
        got = fastload.resolve(src, unpack="nested", env=env)
    assert "extracting it once into the cache" in str(record[0].message)
    assert env.cache in got.parents
    labels = got / "scans" / "scene0000_00" / "scene0000_00_2d-label" / "label-filt"
    assert sorted(p.name for p in labels.iterdir()) == ["0.png", "1.png", "2.png"]
    plain = tmp_path / "shared" / "plain"
    (plain / "d").mkdir(parents=True)
    for i in range(3):
        (plain / "d" / f"{i}.bin").write_bytes(os.urandom(MiB))
    with pytest.warns(OnFullWarning, match="reading it in place"):
        assert fastload.resolve(plain, unpack="nested", env=env) == plain


@pytest.mark.parametrize("outer", ["tree", "zip", "tar"])
def test_verify_after_a_nested_stage_reads_the_inner_archives_folders(
    tmp_path: Path, outer: str
) -> None:
    """unpack="nested": each inner zip is a stage of its own (its manifest beside its
    folder). verify() of the destination checks them too: a member changed or deleted
    after the stage is named (it checked the outer source's files alone, "all match"),
    and the next stage() puts it back."""
    src = _scannet(tmp_path / "scannet")
    if outer == "zip":
        src = _zip(tmp_path / "scannet.zip", {p.relative_to(src).as_posix(): p.read_bytes()
                                              for p in src.rglob("*") if p.is_file()})  # fmt: skip
    elif outer == "tar":
        subprocess.run(["tar", "-cf", str(tmp_path / "scannet.tar"), "-C", str(src), "scans"],
                       check=True)  # fmt: skip
        src = tmp_path / "scannet.tar"
    dst = tmp_path / "dst"
    assert fastload.stage(src, dst, unpack="nested").files == 4
    ok = fastload.verify(dst)
    assert ok.ok and ok.files == 4
    labels = "scans/scene0000_00/scene0000_00_2d-label/label-filt"
    (dst / labels / "1.png").write_bytes(b"PNG1")  # same size, other bytes
    (dst / labels / "2.png").unlink()
    bad = fastload.verify(dst)
    assert (bad.mismatched, bad.missing) == ([f"{labels}/1.png"], [f"{labels}/2.png"])
    fastload.stage(src, dst, unpack="nested")
    assert (dst / labels / "1.png").read_bytes() == b"png1"
    assert (dst / labels / "2.png").read_bytes() == b"png2"
    assert fastload.verify(dst).ok


def test_a_zip_of_zips_whose_inner_zip_is_alone_in_its_folder(tmp_path: Path) -> None:
    """A zip holding ``scans/s1/s1_2d-label.zip`` and nothing else under ``scans/``: the
    inner zip's folder is made (the outer stage, its zips left out, made none: "cannot
    use '.../scans/s1/s1_2d-label': No such file or directory")."""
    inner = zips.member_bytes([("label-filt/0.png", b"p0"), ("label-filt/1.png", b"p1")])
    archive = _zip(tmp_path / "outer.zip", {"scans/s1/s1_2d-label.zip": inner, "a.txt": b"a"})
    assert fastload.stage(archive, tmp_path / "dst", unpack="nested").files == 3
    labels = tmp_path / "dst" / "scans" / "s1" / "s1_2d-label" / "label-filt"
    assert (labels / "1.png").read_bytes() == b"p1"
    assert fastload.verify(tmp_path / "dst").ok


# --------------------------------------------------------------------------------------
# For the owner of staging/background.py, schedule.py (read while staging): the bugs
# --------------------------------------------------------------------------------------


def test_resolve_wait_false_of_a_registry_zip_with_returns(tmp_path: Path) -> None:
    """COCO-style: a registry dataset that is a zip holding ``train2017/<class>/*.jpg``,
    ``returns = "train2017"``. resolve() gives the train2017 folder; resolve(wait=False)
    must give a handle on that same folder, or an ImageFolder over it sees one class
    ("train2017") instead of the image classes."""
    members = {f"train2017/{c}/{i:03d}.jpg": bytes([i]) * 100 for c in ("cat", "dog")
               for i in range(10)}  # fmt: skip
    _zip(tmp_path / "datasets" / "coco" / "train2017.zip", members)
    cfg = tmp_path / "config.toml"
    cfg.write_text('[datasets.coco]\nreturns = "train2017"\n'
                   'sources = [{ path = "coco/train2017.zip" }]\n')  # fmt: skip
    env = _node_env(tmp_path, tmp_path / "node", FASTLOAD_CONFIG=str(cfg))
    h = fastload.resolve("coco", env=env, wait=False)
    assert isinstance(h, Staging)
    dataset = ftv.ImageFolder(h, loader=os.fspath)
    h.wait()
    assert fastload.resolve("coco", env=env) == h.path
    assert dataset.classes == ["cat", "dog"] and len(dataset) == 20
    # Its names, reads and copies (a DataLoader worker's) are those of the folder.
    assert h.files() == sorted(m.removeprefix("train2017/") for m in members)
    again = pickle.loads(pickle.dumps(h))
    assert again.path == h.path and again.local("dog/003.jpg").read_bytes() == bytes([3]) * 100
    with pytest.raises(PermissionError, match="not a path inside"):
        h.local("../train2017.zip")


@pytest.mark.parametrize("outer", ["tree", "zip"])
def test_nested_zips_read_while_staging(tmp_path: Path, outer: str) -> None:
    """ScanNet's layout (a tree of zips) and a zip of zips on a slow shared file system,
    staged with unpack="nested" and wait=False: a member of an inner zip, asked for
    while the outer source is still staging, is read once extracted (as the same case
    through a tar of tars is), and files() lists it."""
    top = tmp_path / "shared"
    inner = _zip(top / "scannet" / "scans" / "s0" / "s0_2d-label.zip",
                 {f"label-filt/{i}.png": b"png" * (i + 1) for i in range(5)})  # fmt: skip
    for i in range(40):
        (top / "scannet" / "scans" / "s0" / f"frame{i:02d}.txt").write_text("x" * 5000)
    if outer == "zip":
        _zip(top / "outer.zip", {**{f"a/f{i:02d}.txt": b"x" * 5000 for i in range(40)},
                                 "a/inner.zip": inner.read_bytes()})  # fmt: skip
    with mounts(tmp_path) as mount:
        m = mount(top, 5000, 20000)  # the outer source takes seconds with 1 in flight
        if outer == "tree":
            src, rel = m.path / "scannet", "scans/s0/s0_2d-label/label-filt/3.png"
        else:
            src, rel = m.path / "outer.zip", "a/inner/label-filt/3.png"
        h = fastload.stage(src, tmp_path / "dst", unpack="nested", wait=False, workers=1)
        with h.open(rel) as f:
            assert f.read() == b"png" * 4
        assert rel in h.files()
        # Not in the source: missing once the archive that would hold it has been staged
        # (inside its folder), or once the outer source has named all of them.
        for missing in (rel.replace("3.png", "99.png"), "nowhere/x.txt"):
            with pytest.raises(FileNotFoundError):
                h.local(missing)
        assert h.wait().files == 45
        assert rel in h.files()  # from the manifests, once done


def test_a_single_file_read_through_its_handle(tmp_path: Path) -> None:
    """A single file staged with wait=False (a checkpoint, an HDF5 file): the names
    files() gives open, as FileDataset(handle, handle.files(), loader) does."""
    src = tmp_path / "weights.bin"
    src.write_bytes(b"w" * 1000)
    h = fastload.stage(src, tmp_path / "node" / "weights.bin", wait=False)
    assert h.local("weights.bin").read_bytes() == b"w" * 1000  # at once, or once whole
    h.wait()
    assert h.files() == ["weights.bin"]
    dataset = fastload.FileDataset(h, h.files(), lambda p: Path(p).read_bytes())
    assert dataset[0] == b"w" * 1000
