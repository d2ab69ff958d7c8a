"""Drop-ins for ``torchvision.datasets`` that read from node-local disk.

``fastload.torchvision.CIFAR10(root, train=True, ...)`` takes torchvision's own
arguments and returns torchvision's own ``CIFAR10`` object, built on a copy staged to
the environment's ``tmpdir`` ($SLURM_TMPDIR in a job) by :func:`fastload.resolve`. The
data is looked for, in order, in ``root`` (where you would have pointed torchvision:
``/network/datasets/torchvision``...), then in the dataset registry (the cluster's dataset
roots, and with ``download=True`` the published URLs); found nowhere, with
``download=True``, torchvision's own download runs into the environment's cache, and the
result is staged from there. One process per node copies; the others wait for it.

``root`` may be ``None``: the registry alone is searched. ``ImageFolder`` and
``DatasetFolder`` take anything :func:`fastload.resolve` takes (a path, a URL of an
archive, a registry name).

Importing this module never imports torchvision; building a dataset without it raises
an ``ImportError`` that says so.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Union

from ._util import node_lock
from .env import Environment, current, datasets, resolve
from .errors import ChecksumMismatchError

if TYPE_CHECKING:
    from .staging.background import Staging

__all__ = [
    "CIFAR10",
    "CIFAR100",
    "MNIST",
    "DatasetFolder",
    "FashionMNIST",
    "ImageFolder",
    "ImageNet",
]

PathLike = Union[str, "os.PathLike[str]"]
Transform = Union[Callable[..., Any], None]


def _datasets() -> ModuleType:
    try:
        return importlib.import_module("torchvision.datasets")
    except ImportError as e:
        raise ImportError(
            "fastload.torchvision needs torchvision, which is not installed "
            f"(pip install torchvision): {e}"
        ) from e


def _first(
    name: str, candidates: list[tuple[Path, str]], env: Environment
) -> Path | None:
    """Stages the first candidate that exists: ``(source, where inside {tmpdir}/<name>)``;
    returns the local dataset root ({tmpdir}/<name>), or None."""
    for src, into in candidates:
        if not os.path.lexists(src):
            continue
        dst = env.tmpdir / name / into if into else env.tmpdir / name
        got = resolve(name, sources=[src], destination=None if _node_local(src, env) else dst,
                      env=env)
        # A copy already on node-local disk is used where it is.
        return got.parent if into else got
    return None


def _node_local(path: Path, env: Environment) -> bool:
    real, top = Path(os.path.realpath(path)), Path(os.path.realpath(env.tmpdir))
    return top in real.parents


def _registry(name: str, env: Environment, download: bool) -> Path | None:
    try:
        return resolve(name, env=env, download=download)
    except ChecksumMismatchError:
        raise
    except OSError:
        return None  # not there, or its URL cannot be reached: torchvision's turn


def _torchvision_root(
    name: str,
    folder: str,
    archive: str | None,
    root: PathLike | None,
    download: bool,
    fetch: Callable[[str], Any],
) -> Path:
    """The local root to build a torchvision dataset of ``<root>/<folder>`` on."""
    env = current()
    candidates: list[tuple[Path, str]] = []
    if root is not None:
        candidates.append((Path(os.fspath(root)) / folder, folder))
        if archive is not None:
            candidates.append((Path(os.fspath(root)) / archive, ""))
    local = _first(name, candidates, env)
    if local is None:
        local = _registry(name, env, download)
    if local is None and download:
        # Found nowhere: torchvision downloads into the cache (one process per node),
        # and the result is staged from there like any other source.
        cached = env.cache / "torchvision" / name
        cached.mkdir(parents=True, exist_ok=True)
        with node_lock(cached):
            fetch(str(cached))
        local = _first(name, [(cached / folder, folder)], env)
    if local is None:
        local = env.tmpdir / name  # torchvision says what is missing
    return local


def _unview(path: Path) -> Path:
    """``path`` without the symbolic link :func:`_view` left there (a stage into it
    would write through it)."""
    if path.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return path


def _view(got: Path, path: Path) -> None:
    """Where resolve() read the data from elsewhere (it does not fit on node-local disk:
    in place, or from the cache), a symbolic link to it at ``path``, so torchvision finds
    its layout under the node-local root."""
    if got == path or not os.path.lexists(got):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.fastload-link-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(got)
    os.replace(tmp, path)


class _DropIn:
    """Base of the drop-ins: calling the class returns torchvision's own object."""


class CIFAR10(_DropIn):
    """``torchvision.datasets.CIFAR10`` on a node-local copy."""

    _name: str = "cifar10"
    _folder: str = "cifar-10-batches-py"
    _archive: str | None = "cifar-10-python.tar.gz"

    def __new__(
        cls,
        root: PathLike | None = None,
        train: bool = True,
        transform: Transform = None,
        target_transform: Transform = None,
        download: bool = False,
    ) -> Any:
        tv_class = getattr(_datasets(), cls.__name__)

        def fetch(where: str) -> None:
            tv_class(where, train=train, download=True)

        local = _torchvision_root(cls._name, cls._folder, cls._archive, root, download, fetch)
        return tv_class(
            str(local), train=train, transform=transform, target_transform=target_transform
        )


class CIFAR100(CIFAR10):
    """``torchvision.datasets.CIFAR100`` on a node-local copy."""

    _name, _folder, _archive = "cifar100", "cifar-100-python", "cifar-100-python.tar.gz"


class MNIST(CIFAR10):
    """``torchvision.datasets.MNIST`` on a node-local copy."""

    _name, _folder, _archive = "mnist", "MNIST", None


class FashionMNIST(CIFAR10):
    """``torchvision.datasets.FashionMNIST`` on a node-local copy."""

    _name, _folder, _archive = "fashionmnist", "FashionMNIST", None


# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _read_through(root: Any, wait: bool) -> Staging | None:
    """The handle to read ``root`` through while it stages: ``root`` itself, or one
    made by ``resolve(root, wait=False)``; None to stage first (torchvision's class)."""
    from .staging.background import Staging

    if isinstance(root, Staging):
        return root
    return resolve(root, wait=False) if not wait else None


def _folder(handle: Staging, loader: Callable[[str], Any] | None, **kwargs: Any) -> Any:
    from .data.files import FolderDataset

    if loader is None:
        loader = importlib.import_module("torchvision.datasets.folder").default_loader
        _datasets()  # without torchvision: an ImportError that says so
    return FolderDataset(handle, loader, **kwargs)


class ImageFolder(_DropIn):
    """``torchvision.datasets.ImageFolder`` on a node-local copy of ``root`` (a path, an
    archive, a URL or a registry name: anything :func:`fastload.resolve` takes).

    ``root`` may be a :class:`~fastload.staging.background.Staging` handle
    (``stage(..., wait=False)``), or ``wait=False`` makes one: the dataset
    (:class:`~fastload.data.files.FolderDataset`, with ImageFolder's attributes) then
    reads through it while it stages; its classes and samples come from the source's
    listing, final from the first batch."""

    def __new__(
        cls,
        root: PathLike | Staging,
        transform: Transform = None,
        target_transform: Transform = None,
        loader: Callable[[str], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        wait: bool = True,
    ) -> Any:
        handle = _read_through(root, wait)
        if handle is not None:
            return _folder(
                handle, loader, extensions=None if is_valid_file else IMG_EXTENSIONS,
                transform=transform, target_transform=target_transform,
                is_valid_file=is_valid_file, allow_empty=allow_empty,
            )  # fmt: skip
        tvd = _datasets()
        kwargs: dict[str, Any] = {}
        if loader is not None:
            kwargs["loader"] = loader
        if allow_empty:  # torchvision >= 0.18
            kwargs["allow_empty"] = True
        return tvd.ImageFolder(
            str(resolve(os.fspath(root))),  # type: ignore[arg-type]  # (not a handle)
            transform=transform,
            target_transform=target_transform,
            is_valid_file=is_valid_file,
            **kwargs,
        )


class DatasetFolder(_DropIn):
    """``torchvision.datasets.DatasetFolder`` on a node-local copy of ``root``; as
    :class:`ImageFolder`, ``root`` may be a handle, or ``wait=False`` makes one."""

    def __new__(
        cls,
        root: PathLike | Staging,
        loader: Callable[[str], Any],
        extensions: tuple[str, ...] | None = None,
        transform: Transform = None,
        target_transform: Transform = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        wait: bool = True,
    ) -> Any:
        handle = _read_through(root, wait)
        if handle is not None:
            return _folder(
                handle, loader, extensions=extensions, transform=transform,
                target_transform=target_transform, is_valid_file=is_valid_file,
                allow_empty=allow_empty,
            )  # fmt: skip
        tvd = _datasets()
        kwargs: dict[str, Any] = {"allow_empty": True} if allow_empty else {}
        return tvd.DatasetFolder(
            str(resolve(os.fspath(root))),  # type: ignore[arg-type]  # (not a handle)
            loader,
            extensions=extensions,
            transform=transform,
            target_transform=target_transform,
            is_valid_file=is_valid_file,
            **kwargs,
        )


_IMAGENET_ARCHIVES = {
    "train": "ILSVRC2012_img_train.tar",
    "val": "ILSVRC2012_img_val.tar",
}
_DEVKIT = "ILSVRC2012_devkit_t12.tar.gz"


class ImageNet(_DropIn):
    """``torchvision.datasets.ImageNet`` on a node-local copy: the split (a directory of
    class directories, or its archive: the training tar of tars is extracted in one
    pass) and the devkit (or ``meta.bin``) are staged to ``{tmpdir}/imagenet``, from
    ``root`` or else from the registry. torchvision then reads it; what it still has to
    prepare (``meta.bin``, sorting the validation images) it does once per node.

    ``root`` may be a Staging handle on a split's class folders, or ``wait=False``
    stages the split folder of ``root`` in the background: the dataset then reads
    through it (:meth:`_read_through`)."""

    def __new__(
        cls, root: PathLike | Staging | None = None, split: str = "train", wait: bool = True,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        if not wait or not isinstance(root, (str, os.PathLike, type(None))):
            return cls._read_through(root, split, **kwargs)
        tvd = _datasets()
        env = current()
        local = env.tmpdir / "imagenet"
        src = Path(os.fspath(root)) if root is not None else None
        if src is not None and _node_local(src, env):
            local = src  # already on this node
        else:
            cls._stage_split(src, split, env)
            cls._stage_meta(src, env)
        ready = (local / "meta.bin").exists() and (local / split).is_dir()
        if ready:
            return tvd.ImageNet(str(local), split=split, **kwargs)
        # torchvision writes meta.bin and sorts val/ itself: one process per node.
        local.mkdir(parents=True, exist_ok=True)
        with node_lock(local / f"{split}-prepare"):
            return tvd.ImageNet(str(local), split=split, **kwargs)

    @classmethod
    def _read_through(cls, root: Any, split: str, loader: Callable[[str], Any] | None = None,
                      transform: Transform = None, target_transform: Transform = None,
                      ) -> Any:  # fmt: skip
        """ImageNet's split read while it stages: ``root`` a handle on the split's class
        folders (its ``meta.bin`` beside them, or none), or the root holding ``split``
        (a directory) and ``meta.bin`` or the devkit, staged with wait=False (the meta
        data first: it is small). A FolderDataset with ImageNet's attributes: ``wnids``,
        ``wnid_to_idx``, ``classes`` (names from meta.bin where there is one)."""
        from .staging.background import Staging

        env = current()
        local = env.tmpdir / "imagenet"
        if isinstance(root, Staging):
            handle, meta = root, root.path.parent / "meta.bin"
        else:
            src = Path(os.fspath(root)) if root is not None else None
            if src is None or not (src / split).is_dir():
                raise FileNotFoundError(f"ImageNet(wait=False) reads a split folder "
                                        f"'{split}' of root, not found in {root}")  # fmt: skip
            cls._stage_meta(src, env)
            handle = resolve("imagenet", sources=[src / split],
                             destination=local / split, env=env, wait=False)  # fmt: skip
            meta = local / "meta.bin"
        ds = _folder(handle, loader, extensions=IMG_EXTENSIONS, transform=transform,
                     target_transform=target_transform)  # fmt: skip
        ds.wnids, ds.wnid_to_idx, ds.split = ds.classes, ds.class_to_idx, split
        if meta.is_file():
            import torch

            wnid_to_classes = torch.load(meta)[0]
            ds.classes = [wnid_to_classes[w] for w in ds.wnids]
            ds.class_to_idx = {c: i for i, names in enumerate(ds.classes) for c in names}
        return ds

    @staticmethod
    def _stage_split(src: Path | None, split: str, env: Environment) -> None:
        candidates: list[tuple[Path, str]] = []
        if src is not None:
            candidates.append((src / split, split))
        local = env.tmpdir / "imagenet"
        for cand, into in candidates:
            if os.path.lexists(cand):
                _view(resolve("imagenet", sources=[cand], destination=_unview(local / into),
                              env=env), local / into)
                return
        archive = _IMAGENET_ARCHIVES.get(split)
        if src is not None and archive is not None and (src / archive).exists():
            if split == "train":
                got = resolve("imagenet", sources=[src / archive], unpack="nested",
                              destination=_unview(local / "train"), env=env)
                _view(got, local / "train")
            else:
                got = resolve("imagenet", sources=[src / archive], unpack=False,
                              destination=_unview(local / archive), env=env)
                _view(got, local / archive)
            return
        with contextlib.suppress(FileNotFoundError, ValueError):  # torchvision says what is missing
            for source in datasets(env)["imagenet"].split(split).sources:
                _unview(local / (source.into or Path(source.location).name))
            got = resolve("imagenet", split=split, env=env, download=False)
            _view(got, local / got.name)

    @staticmethod
    def _stage_meta(src: Path | None, env: Environment) -> None:
        local = env.tmpdir / "imagenet"
        if src is not None:
            for name in ("meta.bin", _DEVKIT):
                if (src / name).is_file():
                    _view(resolve("imagenet", sources=[src / name], unpack=False,
                                  destination=_unview(local / name), env=env), local / name)
                    return
        if (local / "meta.bin").exists():
            return
        with contextlib.suppress(FileNotFoundError):
            _unview(local / _DEVKIT)
            got = resolve("imagenet", split="devkit", env=env, download=False)
            _view(got, local / got.name)
