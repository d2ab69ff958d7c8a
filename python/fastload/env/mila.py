"""Mila (docs.mila.quebec): curated datasets read-only in ``/network/datasets``, the
user's scratch in ``/network/scratch/<u>/<user>`` (``$SCRATCH``), and ``$SLURM_TMPDIR``
on the node-local disk of each job."""

from __future__ import annotations

from pathlib import Path

from .base import Context, Detector, Environment, fallback_tmpdir, slurm_cpus

__all__ = ["DETECTOR", "DOMAIN", "NETWORK_DATASETS"]

DOMAIN = ".server.mila.quebec"
NETWORK_DATASETS = Path("/network/datasets")


def matches(ctx: Context) -> bool:
    return ctx.hostname.lower().rstrip(".").endswith(DOMAIN)


def build(ctx: Context) -> Environment:
    user = ctx.user
    scratch_var = ctx.get("SCRATCH")
    scratch = Path(scratch_var) if scratch_var else Path("/network/scratch") / user[0] / user
    return Environment(
        name="mila",
        tmpdir=fallback_tmpdir(ctx),
        cache=scratch / ".cache" / "fastload",
        scratch=scratch,
        dataset_roots=ctx.existing([NETWORK_DATASETS]),
        cpus=slurm_cpus(ctx),
        user=user,
        hostname=ctx.hostname,
        cluster="mila",
    )


DETECTOR = Detector(
    "mila", matches, build, f"Mila cluster (host name ends with {DOMAIN})"
)
