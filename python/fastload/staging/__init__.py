"""Staging: copy a file or a tree, or extract a (compressed) tar or a tar of tars, from
slow shared storage to node-local disk, once per node, resumably.

- ``api``: :func:`stage` and :func:`verify`, the entry points;
- ``tree``, ``archive``: the two pipelines; ``readers``: how archive bytes reach the
  extractor; ``job``: running the native jobs with progress and Ctrl-C;
- ``engine``: which I/O backend; ``state``: the lock, journal and manifest beside a
  destination, and the checks on the destination itself.

May import: ``sources``, ``index``, ``errors``, ``_util``, ``_core`` (never ``env``,
``data``, ``packing`` or the CLI).
"""

from typing import TYPE_CHECKING

from .api import available_engines, stage, verify
from .job import Patterns, Progress
from .result import StageResult, VerifyResult

if TYPE_CHECKING:  # at run time, __getattr__ below imports it on first use
    from .archive import archive_compression

__all__ = [
    "Patterns",
    "Progress",
    "StageResult",
    "VerifyResult",
    "archive_compression",
    "available_engines",
    "stage",
    "verify",
]


def __getattr__(name: str) -> object:
    # The archive pipeline (and its readers, logging, thread pools) is imported with the
    # first archive: a local tree's stage does without it.
    if name == "archive_compression":
        from .archive import archive_compression

        return archive_compression
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
