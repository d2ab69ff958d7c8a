"""Where this process runs: the cluster environment and the world of ranks and workers.

``detect()`` (or ``current()``) tells which environment this is (``mila``, ``drac``,
``slurm``, ``local``, or a site plug-in) and where data goes there: the node-local
``tmpdir``, the persistent ``cache``, ``scratch``, the read-only ``dataset_roots`` and
the CPU budget. ``world()`` tells this process's rank, node and worker.
"""

from .base import Context, Detector, Environment, expand
from .config import config_path, load_config
from .registry import (
    ENTRY_POINT_GROUP,
    current,
    detect,
    environments,
    register_environment,
)
from .world import World, world

__all__ = [
    "ENTRY_POINT_GROUP",
    "Context",
    "Detector",
    "Environment",
    "World",
    "config_path",
    "current",
    "detect",
    "environments",
    "expand",
    "load_config",
    "register_environment",
    "world",
]
