"""The torchvision drop-ins on a node whose disk (a 1 MiB tmpfs) is smaller than the
dataset (issue 54): they no longer fail with NotEnoughSpaceError; torchvision's class is
built on the data where resolve() left it: a root read in place, an ImageNet training
archive extracted into the cache (linked at the node-local root torchvision reads).
The stand-in torchvision package is test_torchvision_shim's."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import fastload.torchvision as ftv
from fastload.env import OnFullWarning
from kit.trees import MiB
from test_torchvision_shim import make_tar, tv, write  # noqa: F401 (tv: the fixture)

pytestmark = pytest.mark.native

SmallFs = Callable[..., Path]


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, small_fs: SmallFs) -> Path:
    """A node whose tmpdir is a 1 MiB tmpfs; the rest of its environment in tmp_path."""
    for var in list(os.environ):
        if var.startswith(("SLURM_", "FASTLOAD_")) or var in ("SCRATCH", "CC_CLUSTER"):
            monkeypatch.delenv(var)
    mount = small_fs("1m")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    monkeypatch.setenv("FASTLOAD_ENV", "local")
    monkeypatch.setenv("FASTLOAD_TMPDIR", str(mount))
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    return mount


def test_cifar10_root_read_in_place(tv: ModuleType, node: Path, tmp_path: Path) -> None:  # noqa: F811
    shared = tmp_path / "shared" / "torchvision"
    write(shared / "cifar-10-batches-py" / "data_batch_1", os.urandom(2 * MiB))
    write(shared / "cifar-10-batches-py" / "test_batch", b"test")
    with pytest.warns(OnFullWarning, match="reading it in place from"):
        ds = ftv.CIFAR10(shared, train=False)
    assert isinstance(ds, tv.CIFAR10)
    assert ds.root == str(shared) and ds.data == [b"test"]
    assert not (node / "cifar10" / "cifar-10-batches-py").exists()


def test_image_folder_read_in_place(tv: ModuleType, node: Path, tmp_path: Path) -> None:  # noqa: F811
    src = tmp_path / "shared" / "pets"
    for c in ("cat", "dog"):
        write(src / c / "a.jpg", os.urandom(MiB))
    with pytest.warns(OnFullWarning):
        ds = ftv.ImageFolder(src)
    assert ds.root == str(src) and ds.classes == ["cat", "dog"] and len(ds) == 2


def test_imagenet_train_archive_into_the_cache(
    tv: ModuleType, node: Path, tmp_path: Path  # noqa: F811
) -> None:
    src = tmp_path / "shared" / "imagenet"
    inner = tmp_path / "build"
    for wnid in ("n01440764", "n01443537"):
        make_tar(inner / f"{wnid}.tar", {f"{wnid}_0.JPEG": os.urandom(MiB)})
    src.mkdir(parents=True)
    with tarfile.open(src / "ILSVRC2012_img_train.tar", "w") as tf:
        for p in sorted(inner.iterdir()):
            tf.add(p, arcname=p.name)
    make_tar(src / "ILSVRC2012_devkit_t12.tar.gz", {"devkit/readme": b"r"})
    with pytest.warns(OnFullWarning, match="extracting it once into the cache"):
        train = ftv.ImageNet(src, split="train")
    local = node / "imagenet" / "train"
    assert train.root == str(local) and local.is_symlink()
    assert (tmp_path / "cache") in local.resolve().parents
    assert train.classes == ["n01440764", "n01443537"] and len(train) == 2
    assert not any(e[0] == "parse_archive" for e in tv.calls)  # extracted by fastload

    # Again (a later process of the node): the same link, nothing extracted again.
    target = os.readlink(local)
    with pytest.warns(OnFullWarning):
        again = ftv.ImageNet(src, split="train")
    assert len(again) == 2 and os.readlink(local) == target

