"""Native jobs driven as stage() drives them, for the tests that make them directly."""

from __future__ import annotations

from typing import Any


def run_copy_job(job: Any) -> list[int]:
    """Starts a ``_core.CopyJob`` and waits for it to end, taking what it finishes as it
    goes: the tasks done, in the order reported (an error is left for ``job.rethrow()``).
    Fails the test if the job has not ended within a minute."""
    job.start()
    done: list[int] = []
    for _ in range(600):  # a hang guard of a minute, in 100 ms waits
        done += [i for i, _d in job.take_done()]
        if job.wait(100):
            break
    else:
        raise AssertionError("the copy did not finish in a minute")
    done += [i for i, _d in job.take_done()]
    return done
