"""env.slurm.array_task: a job array's task and task count from SLURM's variables, as
``fastload pack`` takes them when given no --task-index/--num-tasks (no cluster needed;
test_slurm_data.py runs the real array)."""

from __future__ import annotations

import pytest

from fastload.env.slurm import array_task


def array(task: int, low: int, count: int, step: int = 1) -> dict[str, str]:
    """What sbatch --array=LOW-HIGH:STEP sets in one of its tasks (as SLURM 22.05 does:
    --array=1-7:2 gives task 5 ID 5, MIN 1, MAX 7, STEP 2, COUNT 4)."""
    high = low + (count - 1) * step
    return {"SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": str(task),
            "SLURM_ARRAY_TASK_MIN": str(low), "SLURM_ARRAY_TASK_MAX": str(high),
            "SLURM_ARRAY_TASK_STEP": str(step), "SLURM_ARRAY_TASK_COUNT": str(count)}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "num_tasks", "want"),
    [
        ({}, None, None),  # not in an array
        ({}, 4, None),
        (array(2, 0, 4), None, (2, 4)),
        (array(5, 1, 4, step=2), None, (2, 4)),  # --array=1-7:2: 1, 3, 5, 7
        (array(12, 10, 4), None, (2, 4)),  # --array=10-13
        (array(2, 2, 1), None, (0, 1)),  # --array=2 alone: an array of one task
        (array(2, 2, 1), 4, (2, 4)),  # ...unless the count is given: task 2 of 4 again
    ],
)
def test_array_task(
    environ: dict[str, str], num_tasks: int | None, want: tuple[int, int] | None
) -> None:
    assert array_task(environ, num_tasks) == want


@pytest.mark.parametrize(
    "environ",
    [
        array(4, 1, 4, step=2),  # not one of 1, 3, 5, 7
        {**array(2, 0, 4), "SLURM_ARRAY_TASK_COUNT": "2"},  # beyond the count
        # --array=0,3,5 (a list, not a range): what SLURM 22.05 sets in its task 3.
        {**array(3, 0, 3), "SLURM_ARRAY_TASK_MAX": "5"},
        {**array(2, 0, 4), "SLURM_ARRAY_TASK_ID": "two"},
    ],
)
def test_array_task_errors(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"array task|integer"):
        array_task(environ)
