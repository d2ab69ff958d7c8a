"""What the data tests share: a DataLoader's samples as keys, a collate_fn that keeps a
batch as its list, a transform that tags a sample with the worker that read it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.utils.data import get_worker_info


def keys_of(items: Iterable[Any]) -> list[str]:
    """Keys of a stream of samples or of batches (lists) of samples."""
    out: list[str] = []
    for x in items:
        out += [s["__key__"] for s in x] if isinstance(x, list) else [x["__key__"]]
    return out


def keep_list(batch: list[Any]) -> list[Any]:
    return batch


def tag_worker(sample: dict[str, Any]) -> dict[str, Any]:
    """The sample with ``"__worker__"``: the DataLoader worker that read it (-1: main)."""
    info = get_worker_info()
    return {**sample, "__worker__": -1 if info is None else info.id}
