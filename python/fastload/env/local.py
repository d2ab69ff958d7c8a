"""Anywhere else (a laptop, a workstation): the user's cache directory (XDG) holds
downloads, and data is staged under it too, so it survives from one run to the next."""

from __future__ import annotations

from .base import Context, Detector, Environment, slurm_cpus, xdg_cache

__all__ = ["DETECTOR"]


def matches(ctx: Context) -> bool:
    return True


def build(ctx: Context) -> Environment:
    cache = xdg_cache(ctx)
    return Environment(
        name="local",
        tmpdir=cache / "data",
        cache=cache,
        scratch=None,
        dataset_roots=(),
        cpus=slurm_cpus(ctx),
        user=ctx.user,
        hostname=ctx.hostname,
    )


DETECTOR = Detector("local", matches, build, "anywhere else (the XDG cache directory)")
