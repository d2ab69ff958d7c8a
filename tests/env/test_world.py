"""fastload.env.world: rank and world size from torch.distributed, torchrun or SLURM (in
that order), the worker from the DataLoader; never imports torch."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from fastload.env.world import World, world


class FakeDist:
    """What world() reads of torch.distributed."""

    def __init__(self, rank: int, size: int, initialised: bool = True) -> None:
        self.rank, self.size, self.initialised = rank, size, initialised

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialised

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.size


@pytest.fixture(autouse=True)
def _no_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no initialised process group unless they pass one."""
    monkeypatch.setitem(sys.modules, "torch.distributed", FakeDist(0, 1, initialised=False))


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}


@pytest.mark.parametrize(
    ("environ", "expect"),
    [
        ({}, World(0, 1, 0, 0, 1, "single")),
        (TORCHRUN, World(3, 8, 1, 0, 1, "torchrun")),
        (SLURM, World(5, 6, 2, 0, 1, "slurm")),
        # SLURM's variables are set in a SLURM job whatever launched the ranks: torchrun's win.
        ({**SLURM, **TORCHRUN}, World(3, 8, 1, 0, 1, "torchrun")),
        ({**SLURM, "RANK": "1", "WORLD_SIZE": "2"}, World(1, 2, 0, 0, 1, "torchrun")),
        ({"SLURM_PROCID": "0"}, World(0, 1, 0, 0, 1, "single")),  # not a whole SLURM world
        ({"RANK": " 2 ", "WORLD_SIZE": "4\n"}, World(2, 4, 0, 0, 1, "torchrun")),
    ],
)
def test_environment(environ: dict[str, str], expect: World) -> None:
    assert world(environ) == expect


def test_dist_first() -> None:
    dist = FakeDist(1, 2)
    w = world({**TORCHRUN, **SLURM}, dist=dist)
    assert (w.rank, w.world_size, w.local_rank, w.source) == (1, 2, 1, "dist")
    assert world(SLURM, dist=dist).local_rank == 2
    # Not initialised: the environment decides.
    assert world(TORCHRUN, dist=FakeDist(1, 2, initialised=False)).source == "torchrun"


def test_dist_found_in_sys_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed", FakeDist(3, 4))
    assert (world({}).rank, world({}).world_size, world({}).source) == (3, 4, "dist")
    monkeypatch.delitem(sys.modules, "torch.distributed")
    assert world({}).source == "single"


def test_worker() -> None:
    w = world(TORCHRUN, SimpleNamespace(id=2, num_workers=3, seed=0))
    assert (w.worker_id, w.num_workers) == (2, 3)
    assert w.consumers == 24 and w.consumer == 3 * 3 + 2
    assert world({}).consumers == 1


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is not in a world of size 2"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "world of size 0"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, "local rank -1"),
    ],
)
def test_errors(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        world(environ)


def test_bad_worker_info() -> None:
    with pytest.raises(ValueError, match="worker 2 is not one of 2"):
        world({}, SimpleNamespace(id=2, num_workers=2))


def test_world_is_frozen() -> None:
    w: Any = world({})
    with pytest.raises(AttributeError):
        w.rank = 1


def test_no_torch_import() -> None:
    """env/ and `import fastload` never import torch; the datasets import it on use."""
    code = (
        "import sys, fastload\n"
        "from fastload.env.world import world\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "world({})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
