"""fastload.torchvision: the drop-ins stage their data, then build torchvision's own
class on the local copy.

torchvision is not a dependency, so most tests use a small stand-in ``torchvision``
package written to a temporary directory and put first on ``sys.path``: its classes take
torchvision's arguments and check for, download and prepare files the way torchvision
does, and log what they do. Where the real torchvision is installed, it is used too.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import fastload.torchvision as ftv

pytestmark = pytest.mark.native

STUB = '''
"""A stand-in for torchvision.datasets (the few classes fastload wraps)."""
import os
import tarfile
import time

calls = []


def _log(*what):
    calls.append(what)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


class VisionDataset:
    def __init__(self, root, transform=None, target_transform=None):
        self.root = str(root)
        self.transform = transform
        self.target_transform = target_transform


class CIFAR10(VisionDataset):
    base_folder = "cifar-10-batches-py"
    train_list = ["data_batch_1"]
    test_list = ["test_batch"]

    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        super().__init__(root, transform=transform, target_transform=target_transform)
        self.train = train
        if download:
            self.download()
        names = self.train_list if train else self.test_list
        folder = os.path.join(self.root, self.base_folder)
        if not all(os.path.isfile(os.path.join(folder, n)) for n in names):
            raise RuntimeError("Dataset not found or corrupted. You can use download=True "
                               "to download it")
        self.data = [_read(os.path.join(folder, n)) for n in names]

    def download(self):
        folder = os.path.join(self.root, self.base_folder)
        if os.path.isdir(folder):
            return
        _log("download", type(self).__name__, self.root)
        os.makedirs(folder)
        for n in self.train_list + self.test_list:
            with open(os.path.join(folder, n), "wb") as f:
                f.write(b"downloaded " + n.encode())


class CIFAR100(CIFAR10):
    base_folder = "cifar-100-python"
    train_list = ["train"]
    test_list = ["test"]


class MNIST(VisionDataset):
    files = ["train-images-idx3-ubyte", "t10k-images-idx3-ubyte"]

    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        super().__init__(root, transform=transform, target_transform=target_transform)
        self.train = train
        if download:
            self.download()
        name = self.files[0] if train else self.files[1]
        path = os.path.join(self.raw_folder, name)
        if not os.path.isfile(path):
            raise RuntimeError("Dataset not found. You can use download=True to download it")
        self.data = _read(path)

    @property
    def raw_folder(self):
        return os.path.join(self.root, type(self).__name__, "raw")

    def download(self):
        if os.path.isdir(self.raw_folder):
            return
        _log("download", type(self).__name__, self.root)
        os.makedirs(self.raw_folder)
        for n in self.files:
            with open(os.path.join(self.raw_folder, n), "wb") as f:
                f.write(b"downloaded " + n.encode())


class FashionMNIST(MNIST):
    pass


class DatasetFolder(VisionDataset):
    def __init__(self, root, loader, extensions=None, transform=None, target_transform=None,
                 is_valid_file=None, allow_empty=False):
        super().__init__(root, transform=transform, target_transform=target_transform)
        self.loader = loader
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        self.samples = []
        for i, c in enumerate(self.classes):
            for dirpath, _, files in sorted(os.walk(os.path.join(self.root, c))):
                for name in sorted(files):
                    p = os.path.join(dirpath, name)
                    ok = is_valid_file(p) if is_valid_file else (
                        extensions is None or name.lower().endswith(tuple(extensions)))
                    if ok:
                        self.samples.append((p, i))
        if not self.samples and not allow_empty:
            raise FileNotFoundError(f"Found no valid file in {self.root}")

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        sample = self.loader(path)
        return (self.transform(sample) if self.transform else sample), target


class ImageFolder(DatasetFolder):
    def __init__(self, root, transform=None, target_transform=None, loader=_read,
                 is_valid_file=None, allow_empty=False):
        super().__init__(root, loader, None if is_valid_file else (".jpeg", ".jpg", ".png"),
                         transform=transform, target_transform=target_transform,
                         is_valid_file=is_valid_file, allow_empty=allow_empty)


class ImageNet(ImageFolder):
    def __init__(self, root, split="train", **kwargs):
        self.split = split
        root = str(root)
        meta = os.path.join(root, "meta.bin")
        if not os.path.isfile(meta):
            devkit = os.path.join(root, "ILSVRC2012_devkit_t12.tar.gz")
            if not os.path.isfile(devkit):
                raise RuntimeError(f"The archive {devkit} is not present in the root directory")
            _log("parse_devkit", root)
            with open(meta, "wb") as f:
                f.write(b"meta")
        folder = os.path.join(root, split)
        if not os.path.isdir(folder):
            archive = os.path.join(root, f"ILSVRC2012_img_{split}.tar")
            if not os.path.isfile(archive):
                raise RuntimeError(f"The archive {archive} is not present in the root directory")
            _log("parse_archive", split, root)
            time.sleep(0.2)  # long enough for a race to show
            os.makedirs(os.path.join(folder, "n00000000"))
            with tarfile.open(archive) as tf:
                for m in tf.getmembers():
                    data = tf.extractfile(m).read()
                    with open(os.path.join(folder, "n00000000", os.path.basename(m.name)),
                              "wb") as f:
                        f.write(data)
        super().__init__(folder, **kwargs)
'''


# Variables that steer environment detection (FASTLOAD_ENGINE and the like are kept).
ENV_VARS = {
    "CC_CLUSTER", "SCRATCH", "FASTLOAD_ENV", "FASTLOAD_CONFIG", "FASTLOAD_TMPDIR",
    "FASTLOAD_CACHE", "FASTLOAD_SCRATCH", "FASTLOAD_DATASET_ROOTS", "FASTLOAD_CPUS",
    "FASTLOAD_HTTP",
}


@pytest.fixture(autouse=True)
def node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A node whose environment lives in ``tmp_path``; returns its tmpdir."""
    for var in list(os.environ):
        if var.startswith("SLURM_") or var in ENV_VARS:
            monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    monkeypatch.setenv("FASTLOAD_ENV", "local")
    monkeypatch.setenv("FASTLOAD_TMPDIR", str(tmp_path / "node-local"))
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "datasets").mkdir()
    monkeypatch.setenv("FASTLOAD_DATASET_ROOTS", str(tmp_path / "datasets"))
    return tmp_path / "node-local"


def _forget_torchvision() -> None:
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]


@pytest.fixture
def tv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in torchvision.datasets, first on sys.path (and gone afterwards)."""
    root = tmp_path / "stub"
    (root / "torchvision" / "datasets").mkdir(parents=True)
    (root / "torchvision" / "__init__.py").write_text("from . import datasets\n")
    (root / "torchvision" / "datasets" / "__init__.py").write_text(textwrap.dedent(STUB))
    saved = {m: mod for m, mod in sys.modules.items() if m.split(".")[0] == "torchvision"}
    _forget_torchvision()
    monkeypatch.syspath_prepend(str(root))
    import torchvision.datasets as stub

    assert stub.__file__ is not None and stub.__file__.startswith(str(root))
    yield stub
    _forget_torchvision()
    sys.modules.update(saved)


def make_tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if path.name.endswith(".gz") else "w") as tf:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def write(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# --------------------------------------------------------------------------------------
# Without torchvision
# --------------------------------------------------------------------------------------


def test_importing_fastload_never_imports_torchvision() -> None:
    code = (
        "import sys, fastload, fastload.torchvision, fastload.env\n"
        "assert 'torchvision' not in sys.modules, 'torchvision was imported'\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_without_torchvision_a_clear_import_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    for make in (
        lambda: ftv.CIFAR10(tmp_path),
        lambda: ftv.MNIST(),
        lambda: ftv.ImageFolder(tmp_path),
        lambda: ftv.DatasetFolder(tmp_path, loader=print),
        lambda: ftv.ImageNet(tmp_path),
    ):
        with pytest.raises(ImportError, match=r"fastload\.torchvision needs torchvision"):
            make()


# --------------------------------------------------------------------------------------
# With the stand-in
# --------------------------------------------------------------------------------------


def test_cifar10_from_the_given_root(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "torchvision"
    write(shared / "cifar-10-batches-py" / "data_batch_1", b"train")
    write(shared / "cifar-10-batches-py" / "test_batch", b"test")

    def transform(x: Any) -> Any:
        return x

    ds = ftv.CIFAR10(shared, train=False, transform=transform)
    assert isinstance(ds, tv.CIFAR10)
    assert ds.root == str(node / "cifar10") and ds.data == [b"test"]
    assert ds.transform is transform and ds.train is False
    assert (node / "cifar10" / "cifar-10-batches-py" / "data_batch_1").read_bytes() == b"train"
    assert tv.calls == []


def test_cifar10_from_the_registry(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    batches = tmp_path / "datasets" / "torchvision" / "cifar-10-batches-py"
    write(batches / "data_batch_1", b"train")
    write(batches / "test_batch", b"test")
    ds = ftv.CIFAR10(tmp_path / "not-here")  # a root without it: the registry's turn
    assert ds.root == str(node / "cifar10") and ds.data == [b"train"]
    assert ftv.CIFAR10().root == str(node / "cifar10")


def test_cifar100_from_an_archive_in_root(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    make_tar(
        tmp_path / "shared" / "cifar-100-python.tar.gz",
        {"cifar-100-python/train": b"tr", "cifar-100-python/test": b"te"},
    )
    ds = ftv.CIFAR100(tmp_path / "shared")
    assert isinstance(ds, tv.CIFAR100) and ds.data == [b"tr"]
    assert ds.root == str(node / "cifar100")


def test_found_nowhere(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    # Without download, torchvision's own error.
    with pytest.raises(RuntimeError, match="Dataset not found"):
        ftv.MNIST(tmp_path / "empty")
    assert tv.calls == []
    # With download, torchvision downloads into the cache, and the copy is staged.
    ds = ftv.MNIST(tmp_path / "empty", train=False, download=True)
    assert isinstance(ds, tv.MNIST) and ds.data == b"downloaded t10k-images-idx3-ubyte"
    assert ds.root == str(node / "mnist")
    cached = str(tmp_path / "cache" / "torchvision" / "mnist")
    assert tv.calls == [("download", "MNIST", cached)]
    again = ftv.MNIST(download=True)
    assert again.root == str(node / "mnist")
    assert len(tv.calls) == 1


def test_fashion_mnist_uses_its_own_folder(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    write(tmp_path / "tv" / "FashionMNIST" / "raw" / "train-images-idx3-ubyte", b"fm")
    ds = ftv.FashionMNIST(tmp_path / "tv")
    assert isinstance(ds, tv.FashionMNIST) and ds.data == b"fm"
    assert ds.root == str(node / "fashionmnist")


def test_image_folder_from_an_archive(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    make_tar(
        tmp_path / "shared" / "pets.tar",
        {"cat/1.jpg": b"c1", "cat/2.png": b"c2", "dog/1.jpeg": b"d1", "dog/notes.txt": b"n"},
    )
    ds = ftv.ImageFolder(tmp_path / "shared" / "pets.tar", transform=bytes.upper)
    assert isinstance(ds, tv.ImageFolder)
    assert ds.root == str(node / "pets") and ds.classes == ["cat", "dog"]
    assert len(ds) == 3 and ds[2] == (b"D1", 1)
    # A copy already on this node is used where it is.
    again = ftv.ImageFolder(node / "pets")
    assert again.root == str(node / "pets")
    assert not (node / "pets" / "pets").exists()


def test_dataset_folder(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    write(tmp_path / "feats" / "a" / "x.bin", b"1")
    write(tmp_path / "feats" / "b" / "y.bin", b"2")
    write(tmp_path / "feats" / "b" / "z.txt", b"3")
    ds = ftv.DatasetFolder(tmp_path / "feats", loader=lambda p: Path(p).read_bytes(),
                           extensions=(".bin",))
    assert isinstance(ds, tv.DatasetFolder) and ds.root == str(node / "feats")
    assert [ds[i] for i in range(len(ds))] == [(b"1", 0), (b"2", 1)]
    empty = tmp_path / "none" / "a"
    empty.mkdir(parents=True)
    assert len(ftv.DatasetFolder(tmp_path / "none", loader=print, allow_empty=True)) == 0


def _imagenet_source(root: Path) -> None:
    inner = root / "build"
    for wnid in ("n01440764", "n01443537"):
        make_tar(inner / f"{wnid}.tar", {f"{wnid}_{i}.JPEG": b"j" for i in range(2)})
    with tarfile.open(root / "ILSVRC2012_img_train.tar", "w") as tf:
        for p in sorted(inner.iterdir()):
            tf.add(p, arcname=p.name)
    make_tar(root / "ILSVRC2012_img_val.tar", {f"ILSVRC2012_val_{i:08d}.JPEG": b"v"
                                               for i in range(3)})
    make_tar(root / "ILSVRC2012_devkit_t12.tar.gz", {"devkit/readme": b"r"})


def test_imagenet_from_its_archives(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    src = tmp_path / "shared" / "imagenet"
    _imagenet_source(src)
    train = ftv.ImageNet(src, split="train")
    assert isinstance(train, tv.ImageNet)
    assert train.root == str(node / "imagenet" / "train")
    assert train.classes == ["n01440764", "n01443537"] and len(train) == 4
    assert ("parse_devkit", str(node / "imagenet")) in tv.calls
    assert not any(e[0] == "parse_archive" for e in tv.calls)  # extracted by fastload

    # Three processes' worth of val at once: the archive is copied once, and torchvision
    # sorts it once.
    results: list[Any] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ftv.ImageNet(src, split="val"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [len(r) for r in results] == [3, 3, 3]
    assert [e for e in tv.calls if e[0] == "parse_archive"] == [
        ("parse_archive", "val", str(node / "imagenet"))
    ]


def test_imagenet_from_the_registry(tv: ModuleType, node: Path, tmp_path: Path) -> None:
    _imagenet_source(tmp_path / "datasets" / "imagenet")
    # The registry's checksums are the real archives': these stand-ins do not match.
    with pytest.raises(fastload_errors().ChecksumMismatchError):
        ftv.ImageNet(split="train")
    sorted_val = tmp_path / "datasets" / "imagenet.var" / "imagenet_torchvision" / "val"
    write(sorted_val / "n01440764" / "a.JPEG")
    write(node / "imagenet" / "meta.bin", b"meta")
    val = ftv.ImageNet(split="val")
    assert val.root == str(node / "imagenet" / "val") and len(val) == 1
    assert tv.calls == []


def fastload_errors() -> ModuleType:
    import fastload.errors

    return fastload.errors


# --------------------------------------------------------------------------------------
# The real torchvision, where it is installed
# --------------------------------------------------------------------------------------


def test_real_torchvision_image_folder(node: Path, tmp_path: Path) -> None:
    saved = {m: mod for m, mod in sys.modules.items() if m.split(".")[0] == "torchvision"}
    torchvision = pytest.importorskip(
        "torchvision", reason="torchvision is not installed (it has no CPU-only build here; "
        "the drop-ins are tested above against a stand-in module)")  # fmt: skip
    try:
        src = tmp_path / "shared" / "pets"
        for cls in ("cat", "dog"):
            for i in range(3):
                write(src / cls / f"{i}.png", b"not decoded here")
        ds = ftv.ImageFolder(src)
        assert isinstance(ds, torchvision.datasets.ImageFolder)
        assert ds.root == str(node / "pets") and ds.classes == ["cat", "dog"] and len(ds) == 6
    finally:
        if not saved:
            _forget_torchvision()
