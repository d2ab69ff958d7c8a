"""A real SLURM cluster for the tests in this folder: scripts/slurm-cluster.sh starts
slurmctld and three slurmd (n1, n2, n3) on loopback under a temporary directory, once
per session, and stops what it started at the end.

Tests that take ``slurm`` skip, saying why, where SLURM's daemons or clients are not
installed (Debian: ``apt-get install slurmctld slurmd slurm-client``; scripts/test.sh
installs them). Job steps run this interpreter (by absolute path) and the fastload this
session imports (its folder on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from kit import tools
from kit.slurm import BINARIES, NODES, SCRIPT, Cluster


def _missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = _missing()
    if missing:
        tools.missing(
            f"SLURM is not installed here ({', '.join(missing)} not found; Debian: "
            "apt-get install slurmctld slurmd slurm-client, as scripts/test.sh does)"
        )
    root = tmp_path_factory.mktemp("slurm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    start = subprocess.run(
        [str(SCRIPT), "start", str(root), str(len(NODES))],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    try:
        if start.returncode != 0:
            raise AssertionError(f"the test cluster did not start:\n{start.stderr[-4000:]}")
        yield Cluster(root)
    finally:
        stop = subprocess.run([str(SCRIPT), "stop", str(root)], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert stop.returncode == 0, stop.stderr
