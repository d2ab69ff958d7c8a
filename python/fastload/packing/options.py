"""What every pack shares, validated once: the shards' names and sizes, the order, the
workers, the index, and the task of a job array. :func:`fastload.pack` and
:func:`fastload.pack_dataset` build one from their keywords; the pipelines
(:mod:`.folder`, :mod:`.dataset`) take it whole instead of a dozen loose arguments."""

from __future__ import annotations

import dataclasses

from .._util import Size
from .plan import task_shards
from .writer import DEFAULT_INDEX, DEFAULT_PATTERN, check_pattern, parse_size

__all__ = ["PackOptions"]


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """How to pack. Every field is checked when the object is made: a bad value is a
    ValueError naming it, before anything is read or written."""

    pattern: str = DEFAULT_PATTERN
    """Shard file names, ``str.format``-ed with the shard number."""
    max_size: Size = "1GB"
    """A shard closes before it would exceed this (bytes, or ``"512MB"``...)."""
    max_count: int | None = None
    """A shard closes at this many samples."""
    shuffle: bool = False
    """A full permutation of the samples over all shards, fixed by ``seed``."""
    seed: int = 0
    workers: int | None = None
    """Threads (a path, at least 1) or processes (a dataset; 0 loads in this process);
    None: chosen from the CPUs."""
    index: str | None = DEFAULT_INDEX
    """The index's file name beside the shards; None: no index."""
    progress: bool = False
    sync: bool = True
    """Shards fsynced before they are renamed into place."""
    task_index: int = 0
    num_tasks: int = 1
    """This task of a job array writes every ``num_tasks``-th shard of the plan."""

    def __post_init__(self) -> None:
        check_pattern(self.pattern)
        parse_size(self.max_size)
        if self.max_count is not None and self.max_count < 1:
            raise ValueError(f"max_count must be at least 1, not {self.max_count}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be at least 0, not {self.workers}")
        task_shards(0, self.task_index, self.num_tasks)  # checks the task arguments

    @property
    def limit(self) -> int:
        """``max_size`` in bytes."""
        return parse_size(self.max_size)

    @property
    def tasks(self) -> bool:
        """Whether this is one task of several."""
        return self.num_tasks != 1 or self.task_index != 0
