"""The pure functions of a pack plan: the permutation, the cut into shards, the split
across tasks. Plain numpy in, numpy out; no I/O, so each is tested alone.

The permutation is fastload's one permutation, ``_core.permutation`` (the datasets'
epoch orders use it too), defined bit for bit in ``cpp/common/permutation.hpp``, not by
numpy's random generators: every task of a SLURM array, on whatever node and numpy
version, must compute the same one from the same seed.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .. import _core
from .._util import check_seed

__all__ = ["END_BYTES", "cut_shards", "member_bytes", "permutation", "split_key", "task_shards"]

END_BYTES = 1024
"""The end-of-archive marker every shard ends with."""

_BLOCK = 512
_OCTAL_SIZE_MAX = 0o77777777777


def permutation(n: int, seed: int) -> npt.NDArray[np.int64]:
    """A uniformly random permutation of ``range(n)``, the same for the same seed (an
    integer in ``[0, 2**64)``) on any machine: ``_core.permutation(n, [seed])``, pack's
    order since its first release."""
    if n < 0:
        raise ValueError(f"n must be non-negative, not {n}")
    return _core.permutation(n, [check_seed(seed)])


def member_bytes(name_lens: npt.NDArray[np.uint64], sizes: npt.NDArray[np.uint64]) -> npt.NDArray[
    np.uint64
]:
    """Bytes each member takes in a shard (header blocks, data, padding), from the byte
    length of its name and its size: 512 + the padded size for names up to 100 bytes
    and sizes below 8 GiB, else as the native writer computes it (pax header)."""
    name_lens = np.asarray(name_lens, dtype=np.uint64)
    sizes = np.asarray(sizes, dtype=np.uint64)
    out = np.uint64(_BLOCK) + ((sizes + np.uint64(_BLOCK - 1)) & ~np.uint64(_BLOCK - 1))
    special = (name_lens > 100) | (sizes > _OCTAL_SIZE_MAX)
    if special.any():
        out[special] = _core.tar_member_bytes(name_lens[special], sizes[special])
    return out


def cut_shards(
    sample_bytes: npt.NDArray[np.int64], max_size: int, max_count: int | None
) -> npt.NDArray[np.int64]:
    """Shard boundaries over samples in output order: shard ``s`` holds samples
    ``[cuts[s], cuts[s+1])``. A shard takes samples while it stays within ``max_size``
    bytes (end-of-archive marker included) and ``max_count`` samples; a sample larger than
    ``max_size`` gets a shard of its own."""
    n = len(sample_bytes)
    if max_count is not None and max_count < 1:
        raise ValueError(f"max_count must be at least 1, not {max_count}")
    cum = np.cumsum(np.asarray(sample_bytes, dtype=np.int64))
    room = max_size - END_BYTES
    cuts = [0]
    a = 0
    while a < n:
        base = int(cum[a - 1]) if a else 0
        b = int(np.searchsorted(cum, base + room, side="right"))
        b = max(b, a + 1)
        if max_count is not None:
            b = min(b, a + max_count)
        cuts.append(b)
        a = b
    return np.array(cuts, dtype=np.int64)


def task_shards(n_shards: int, task_index: int, num_tasks: int) -> list[int]:
    """The shards task ``task_index`` of ``num_tasks`` writes: every ``num_tasks``-th, so
    the tasks' loads are even whatever the shard sizes along the order."""
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be at least 1, not {num_tasks}")
    if not 0 <= task_index < num_tasks:
        raise ValueError(f"task_index must be in [0, {num_tasks}), not {task_index}")
    return list(range(task_index, n_shards, num_tasks))


def split_key(name: str) -> tuple[str, str] | None:
    """webdataset's rule, as the shard index reads it: the key is the path up to the first
    dot of the base name, the field the rest. None when there is no key or no field
    (``README``, ``.hidden``, ``x.``)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or dot == len(name) - 1:
        return None
    return name[:dot], name[dot + 1 :]
