"""The public entry points of packing: :func:`pack` (a path, or an iterable of samples)
and :func:`pack_dataset` (a map-style dataset), which choose a pipeline."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

from .._util import Size
from .dataset import ToSample, pack_iterable, pack_map_dataset
from .folder import pack_path
from .options import PackOptions
from .writer import DEFAULT_INDEX, DEFAULT_PATTERN, PackResult, PathLike

__all__ = ["pack", "pack_dataset"]


def pack(
    source: PathLike | Iterable[Mapping[str, Any]],
    out_dir: PathLike,
    *,
    shuffle: bool = False,
    seed: int = 0,
    pattern: str = DEFAULT_PATTERN,
    max_size: Size = "1GB",
    max_count: int | None = None,
    workers: int | None = None,
    task_index: int = 0,
    num_tasks: int = 1,
    classes: bool | None = None,
    index: str | None = DEFAULT_INDEX,
    progress: bool = False,
    sync: bool = True,
) -> PackResult:
    """Packs samples into indexed tar shards in ``out_dir``.

    ``source`` is a path or an iterable of sample dicts (as :meth:`ShardWriter.write`
    takes, written in order: shuffle them first, or use :func:`pack_dataset`). A path is
    a directory tree (each file a member ``KEY.FIELD`` by its relative path: files that
    share a key form one sample), a tar, or a tar of tars such as ImageNet's train tar
    (each member tar read as the folder of its name), packed natively, in parallel
    (``workers`` threads), from headers and one ordered pass over the data, never
    extracted.

    ``shuffle``: a full random permutation of the samples over all shards, fixed by
    ``seed`` (same source and seed, byte-identical shards). ``classes``: sources whose
    keys all lie in two or more top-level folders (ImageFolder) get a ``cls`` field, the
    position of the folder in the sorted class list, which is saved as ``classes.txt``
    and ``classes.json`` beside the shards (None: when the layout is ImageFolder's).
    ``task_index``/``num_tasks`` split the work across the tasks of a SLURM array: each
    writes every ``num_tasks``-th shard of the same plan; join them with
    ``fastload index OUT`` once all are done.
    """
    opts = PackOptions(
        pattern=pattern, max_size=max_size, max_count=max_count, shuffle=shuffle, seed=seed,
        workers=workers, index=index, progress=progress, sync=sync, task_index=task_index,
        num_tasks=num_tasks,
    )  # fmt: skip
    if isinstance(source, (str, os.PathLike)):
        return pack_path(source, out_dir, opts, classes=classes)
    if shuffle:
        raise ValueError(
            "shuffle=True needs the whole sample list: pack a path, or a map-style "
            "dataset with pack_dataset(), or shuffle the iterable yourself"
        )
    if opts.tasks:
        raise ValueError("tasks split a path or a dataset, not an iterable")
    return pack_iterable(source, out_dir, opts)


def pack_dataset(
    dataset: Any,
    out_dir: PathLike,
    *,
    shuffle: bool = False,
    seed: int = 0,
    pattern: str = DEFAULT_PATTERN,
    max_size: Size = "1GB",
    max_count: int | None = None,
    workers: int | None = None,
    fields: Sequence[str] | None = None,
    to_sample: Callable[[int, Any], Mapping[str, Any]] | None = None,
    index: str | None = DEFAULT_INDEX,
    progress: bool = False,
    sync: bool = True,
) -> PackResult:
    """Packs a map-style dataset (``len()`` and ``ds[i]``, e.g. a torchvision dataset)
    with ``workers`` processes loading samples and writing shards at once.

    An item becomes a sample through ``to_sample(i, item)``, or: a dict as it is, a
    tuple by naming its parts (``fields=("jpg", "cls")``). Keys default to the dataset
    index, zero-padded. ``shuffle`` writes the items in a random permutation fixed by
    ``seed``. The dataset is cut into groups of consecutive samples (``max_count``, or
    the count a probe of the first samples says fills ``max_size``), one group per worker
    task, so the shards do not depend on the number of workers. Values that are not
    bytes, str, numbers or numpy arrays need an encoder (:func:`register_encoder`),
    e.g. PIL images.
    """
    opts = PackOptions(
        pattern=pattern, max_size=max_size, max_count=max_count, shuffle=shuffle, seed=seed,
        workers=workers, index=index, progress=progress, sync=sync,
    )  # fmt: skip
    return pack_map_dataset(dataset, out_dir, opts, ToSample.of(to_sample, fields, len(dataset)))
