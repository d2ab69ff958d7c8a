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

from .api import available_engines, stage, verify
from .archive import archive_compression
from .job import Patterns, Progress
from .result import StageResult, VerifyResult

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
