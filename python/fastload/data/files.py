"""Map-style datasets of files read through a stage in the background (issue 49):
:class:`FileDataset` (any list of paths) and :class:`FolderDataset` (a tree of class
folders, as torchvision's ``DatasetFolder``/``ImageFolder``; fastload.torchvision builds
it on a handle). Each reads a sample through :meth:`Staging.local`: at once where the
file is staged, else fetched ahead of the stage; a DataLoader's batch of samples is
asked for at once (``__getitems__``). Their length and targets come from the source's
listing, so they are final from the first batch. :meth:`FileDataset.sampler` gives a
DataLoader the epoch's order and tells the stager the files coming next
(:class:`AheadSampler`): the stage follows a shuffled loop."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import torch
from torch.utils.data import Dataset, Sampler

from ..staging.background import Staging

__all__ = ["AheadSampler", "FileDataset", "FolderDataset"]

Loader = Callable[[str], Any]
Where = Union[Staging, str, "os.PathLike[str]"]

AHEAD = 4096  # files hinted ahead of the loop's position
AHEAD_STEP = 1024  # how often (in samples) the window moves on


def _handle(where: Where) -> Staging:
    return where if isinstance(where, Staging) else Staging.ready(Path(os.fspath(where)))


class FileDataset(Dataset[Any]):
    """``loader(path)`` of each of ``files`` (paths relative to the tree ``staging``:
    a :class:`Staging` handle, or a directory), with ``transform`` applied; a sample is
    read as soon as its file is staged."""

    def __init__(self, staging: Where, files: Sequence[str], loader: Loader,
                 transform: Callable[[Any], Any] | None = None) -> None:  # fmt: skip
        self.staging = _handle(staging)
        self.files = list(files)
        self.loader = loader
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def _load(self, path: Path, i: int) -> Any:
        sample = self.loader(str(path))
        return self.transform(sample) if self.transform is not None else sample

    def __getitem__(self, i: int) -> Any:
        return self._load(self.staging.local(self.files[i]), i)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch's samples, their files asked for at once (torch's DataLoader calls
        this for a batch)."""
        paths = self.staging.local_all([self.files[i] for i in indices])
        return [self._load(p, i) for p, i in zip(paths, indices, strict=True)]

    def sampler(self, shuffle: bool = True, seed: int | None = None) -> AheadSampler:
        """A DataLoader's sampler of this dataset (``sampler=``, instead of
        ``shuffle=``) whose order the stage follows while it runs: see
        :class:`AheadSampler`."""
        return AheadSampler(self.staging, self.files, shuffle=shuffle, seed=seed)


class AheadSampler(Sampler[int]):
    """The indices of ``files`` (read through ``staging``) in an epoch's order: a new
    permutation each epoch where ``shuffle`` (as torch's RandomSampler: drawn from
    torch's generator, or from ``seed`` and the epoch), else in order. While the stage
    runs, it tells the stager the files coming next (:meth:`Staging.ahead`: the next
    ``ahead`` files, the window moved on every ``step`` samples; never blocking), so
    that they are fetched before the loop asks for them."""

    def __init__(self, staging: Staging, files: Sequence[str], shuffle: bool = True,
                 seed: int | None = None, ahead: int = AHEAD, step: int = AHEAD_STEP
                 ) -> None:  # fmt: skip
        if ahead < 1 or not 1 <= step <= ahead:
            raise ValueError(f"need 1 <= step <= ahead, not step={step}, ahead={ahead}")
        self.staging, self.files = staging, files
        self.shuffle, self.seed = shuffle, seed
        self.ahead, self.step = ahead, step
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration draws (with ``seed``: its permutation)."""
        self.epoch = epoch

    def order(self) -> list[int]:
        """The next epoch's order (the epoch counted on)."""
        n = len(self.files)
        if not self.shuffle:
            order = list(range(n))
        else:
            g = torch.Generator()
            if self.seed is None:
                g.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
            else:
                g.manual_seed(hash((self.seed, self.epoch)) & (2**63 - 1))
            order = torch.randperm(n, generator=g).tolist()
        self.epoch += 1
        return order

    def __iter__(self) -> Iterator[int]:
        order, files, staging = self.order(), self.files, self.staging
        sent = 0  # hinted: order[:sent]
        for start in range(0, len(order), self.step):
            end = min(len(order), start + self.ahead)
            if sent < end:  # (nothing is sent once the stage is known done)
                staging.ahead([files[i] for i in order[sent:end]])
                sent = end
            yield from order[start : start + self.step]


class FolderDataset(FileDataset):
    """torchvision's ``DatasetFolder`` over a staged tree: a class per top-level folder
    (sorted), its files with one of ``extensions`` (or that ``is_valid_file`` accepts)
    as samples ``(loader(path), class index)``; the listing is the source's (the
    stager's), not the half-staged copy's."""

    def __init__(
        self, staging: Where, loader: Loader, extensions: tuple[str, ...] | None = None,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False,
    ) -> None:  # fmt: skip
        if (extensions is None) == (is_valid_file is None):
            raise ValueError("pass either extensions or is_valid_file, not both or neither")
        handle = _handle(staging)
        listed, root = handle.files(), handle.path
        exts = tuple(e.lower() for e in extensions) if extensions is not None else ()

        def valid(rel: str) -> bool:
            if is_valid_file is not None:
                return is_valid_file(str(root / rel))
            return rel.lower().endswith(exts)

        by_class: dict[str, list[str]] = {}
        for rel in listed:
            top, sep, _ = rel.partition("/")
            if sep:
                by_class.setdefault(top, [])
                if valid(rel):
                    by_class[top].append(rel)
        classes = sorted(by_class)
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
        empty = [c for c in classes if not by_class[c]]
        if empty and not allow_empty:
            raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)} "
                                    f"in {root}")  # fmt: skip
        self.root = str(root)
        self.classes = classes
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        rels = [(rel, self.class_to_idx[c]) for c in classes for rel in sorted(by_class[c])]
        super().__init__(handle, [r for r, _ in rels], loader, transform)
        self.target_transform = target_transform
        self.extensions = extensions
        self.targets = [t for _, t in rels]
        prefix = f"{root}/"  # (a Path per sample costs 0.2 s at 20,000 files)
        self.samples = [(prefix + r, t) for r, t in rels]
        self.imgs = self.samples

    def _load(self, path: Path, i: int) -> Any:
        target = self.targets[i]
        if self.target_transform is not None:
            target = self.target_transform(target)
        return super()._load(path, i), target

