"""Any SLURM job (``SLURM_JOB_ID`` is set). SLURM may set ``SLURM_TMPDIR`` to a
node-local directory; where a site does not, configure one
(``[environments.slurm] tmpdir = "/local/{user}"``) or fastload uses a per-user
directory in ``$TMPDIR`` (``/tmp``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .base import Context, Detector, Environment, fallback_tmpdir, slurm_cpus, xdg_cache

__all__ = ["DETECTOR", "array_task"]


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


def array_task(environ: Mapping[str, str], num_tasks: int | None = None) -> tuple[int, int] | None:
    """``(task_index, num_tasks)`` of this task of a SLURM job array, ``None`` outside one.

    With ``num_tasks`` given, the index is ``SLURM_ARRAY_TASK_ID`` itself: a task re-run
    alone (``sbatch --array=2``) still writes its own part. Without, the tasks are the
    array's: the place of ``SLURM_ARRAY_TASK_ID`` in ``MIN-MAX:STEP`` of
    ``SLURM_ARRAY_TASK_COUNT`` (raises ``ValueError`` where the ids are not such a range).
    """
    text = environ.get("SLURM_ARRAY_TASK_ID")
    if text is None:
        return None

    def num(name: str, default: int) -> int:
        value = environ.get(name)
        try:
            return default if value is None else int(value)
        except ValueError:
            raise ValueError(f"environment variable {name}={value!r} is not an integer") from None

    task = num("SLURM_ARRAY_TASK_ID", 0)
    if num_tasks is not None:
        return task, num_tasks
    low, step = num("SLURM_ARRAY_TASK_MIN", 0), num("SLURM_ARRAY_TASK_STEP", 1)
    count = num("SLURM_ARRAY_TASK_COUNT", 1)
    index, off = divmod(task - low, max(step, 1))
    if off or not 0 <= index < count:
        raise ValueError(
            f"array task {task} is not one of {count} tasks from {low} in steps of {step}: "
            "give --task-index and --num-tasks"
        )
    return index, count
