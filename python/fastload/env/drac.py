"""The Digital Research Alliance of Canada (Compute Canada) clusters: ``CC_CLUSTER``
names the cluster (narval, fir, nibi, rorqual, ...), ``$SCRATCH`` is the user's scratch,
``~/projects/<allocation>`` holds group data, and ``$SLURM_TMPDIR`` is the node-local
disk of each job (docs.alliancecan.ca, "Using node-local storage").

Mila's curated datasets are mirrored to these clusters in
``~/projects/rrg-bengioy-ad/data/curated`` (docs.mila.quebec); that directory is a
dataset root where it exists. Other groups add theirs in the configuration file
(``[environments.drac] dataset_roots = [...]``).
"""

from __future__ import annotations

from pathlib import Path

from .base import Context, Detector, Environment, fallback_tmpdir, slurm_cpus

__all__ = ["CURATED", "DETECTOR"]

CURATED = Path("projects/rrg-bengioy-ad/data/curated")
"""Relative to the home directory."""


def matches(ctx: Context) -> bool:
    return ctx.get("CC_CLUSTER") is not None


def build(ctx: Context) -> Environment:
    scratch_var = ctx.get("SCRATCH")
    scratch = Path(scratch_var) if scratch_var else ctx.home / "scratch"
    return Environment(
        name="drac",
        tmpdir=fallback_tmpdir(ctx),
        cache=scratch / ".cache" / "fastload",
        scratch=scratch,
        dataset_roots=ctx.existing([ctx.home / CURATED]),
        cpus=slurm_cpus(ctx),
        user=ctx.user,
        hostname=ctx.hostname,
        cluster=ctx.get("CC_CLUSTER"),
    )


DETECTOR = Detector(
    "drac", matches, build, "Alliance (Compute Canada) cluster (CC_CLUSTER is set)"
)
