"""Where this process runs, and where its data is: the cluster environment, the world of
ranks and workers, the dataset registry, and resolve().

``detect()`` (or ``current()``) tells which environment this is (``mila``, ``drac``,
``slurm``, ``local``, or a site plug-in) and where data goes there: the node-local
``tmpdir``, the persistent ``cache``, ``scratch``, the read-only ``dataset_roots`` and
the CPU budget. ``world()`` tells this process's rank, node and worker.
``resolve()`` (``resolver``) turns a dataset name, a path or a URL into a ready local path,
through the registry of well-known datasets (``datasets``) and :func:`fastload.stage`.

May import: ``staging``, ``sources``, ``index``, ``errors``, ``_util``, ``_core`` (never
``data``, ``packing`` or the CLI).
"""

from .base import Context, Detector, Environment, expand
from .config import config_path, load_config
from .datasets import DatasetSpec, datasets
from .placement import OnFullWarning, Placement, placements
from .registry import (
    ENTRY_POINT_GROUP,
    current,
    detect,
    environments,
    register_environment,
)
from .resolver import resolve
from .world import World, world

__all__ = [
    "ENTRY_POINT_GROUP",
    "Context",
    "DatasetSpec",
    "Detector",
    "Environment",
    "OnFullWarning",
    "Placement",
    "World",
    "config_path",
    "current",
    "datasets",
    "detect",
    "environments",
    "expand",
    "load_config",
    "placements",
    "register_environment",
    "resolve",
    "world",
]
