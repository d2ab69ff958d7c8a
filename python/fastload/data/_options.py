"""The checks of the reading options ShardIterableDataset and Mix share."""

from __future__ import annotations

from typing import Any

from .._util import check_block, check_seed
from ._fetch import check_access

__all__ = ["check_options"]


def check_options(o: dict[str, Any]) -> None:
    """Checks (in place: seed and shuffle_block normalised) the options ``o`` holds:
    access, prefetch, num_workers, seed, shuffle_block, batch_size, batch_by,
    collate_fn; ValueError naming the argument."""
    check_access(o["access"])
    prefetch, num_workers = o["prefetch"], o["num_workers"]
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative integer, not {prefetch!r}")
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
    ):
        raise ValueError(
            f"num_workers must be a non-negative integer or None, not {num_workers!r}"
        )
    o["seed"] = check_seed(o["seed"])
    o["shuffle_block"] = check_block(o["shuffle_block"])
    batch_size, batch_by = o["batch_size"], o["batch_by"]
    if batch_size is not None and (isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size must be positive, not {batch_size!r}")
    if batch_by is not None:
        if batch_size is None:
            raise ValueError("batch_by needs batch_size: the size limit of a batch")
        if not callable(batch_by) and batch_by != "bytes":
            raise ValueError(f"batch_by must be 'bytes' or a function, not {batch_by!r}")
    elif batch_size is not None and not isinstance(batch_size, int):
        raise ValueError(f"batch_size must be an integer, not {batch_size!r}")
    if o["collate_fn"] is not None and batch_size is None:
        raise ValueError("collate_fn needs batch_size (the DataLoader collates single samples)")
