"""Anywhere else (a laptop, a workstation): the user's cache directory (XDG) holds
downloads, and data is staged under it too, so it survives from one run to the next.

A set ``SLURM_TMPDIR`` is the node-local disk wherever it comes from (an ``salloc``
shell, a site's prolog, a job whose ``SLURM_JOB_ID`` was not passed on): data is
staged there, as in a SLURM job, not into the home directory's cache."""

from __future__ import annotations

from pathlib import Path

from .base import Context, Detector, Environment, slurm_cpus, xdg_cache

__all__ = ["DETECTOR"]


def matches(ctx: Context) -> bool:
    return True


def build(ctx: Context) -> Environment:
    cache = xdg_cache(ctx)
    node_local = ctx.get("SLURM_TMPDIR")
    return Environment(
        name="local",
        tmpdir=Path(node_local) if node_local else cache / "data",
        cache=cache,
        scratch=None,
        dataset_roots=(),
        cpus=slurm_cpus(ctx),
        user=ctx.user,
        hostname=ctx.hostname,
    )


DETECTOR = Detector("local", matches, build, "anywhere else (the XDG cache directory, or "
                    "SLURM_TMPDIR where it is set)")
