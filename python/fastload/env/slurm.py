"""Any SLURM job (``SLURM_JOB_ID`` is set). SLURM may set ``SLURM_TMPDIR`` to a
node-local directory; where a site does not, configure one
(``[environments.slurm] tmpdir = "/local/{user}"``) or fastload uses a per-user
directory in ``$TMPDIR`` (``/tmp``)."""

from __future__ import annotations

from pathlib import Path

from .base import Context, Detector, Environment, fallback_tmpdir, slurm_cpus, xdg_cache

__all__ = ["DETECTOR"]


def matches(ctx: Context) -> bool:
    return ctx.get("SLURM_JOB_ID") is not None


def build(ctx: Context) -> Environment:
    scratch = ctx.get("SCRATCH")
    return Environment(
        name="slurm",
        tmpdir=fallback_tmpdir(ctx),
        cache=xdg_cache(ctx),
        scratch=Path(scratch) if scratch else None,
        dataset_roots=(),
        cpus=slurm_cpus(ctx),
        user=ctx.user,
        hostname=ctx.hostname,
        cluster=ctx.get("SLURM_CLUSTER_NAME"),
    )


DETECTOR = Detector("slurm", matches, build, "a SLURM job (SLURM_JOB_ID is set)")
