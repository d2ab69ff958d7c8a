"""Interrupted staging: a real child process killed mid-way (SIGKILL) or interrupted
(SIGINT), then resumed.

Each SIGKILL or Ctrl-C lands once a given number of files is whole at their names (a
point in the stage's progress, not in time: on a busy machine a moment may come before the
first file, or after the last).
"""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

import pytest

from kit import procs, trees

pytestmark = pytest.mark.native

def landed(child: procs.Child, sig: int) -> bool:
    """Whether ``sig`` ended the child before its stage() returned."""
    return child.returncode == -sig and child.result is None and child.error is None


def resume(src: Path, dst: Path, engine: str) -> dict[str, Any]:
    """Resumes in a child too: a lock left held by the killed process would hang it."""
    res = procs.run_child(procs.stage_spec(src, dst, engine=engine), timeout=180,
                            env=procs.child_env()).expect_result()
    trees.assert_same_tree(src, dst)
    assert trees.tmp_leftovers(dst) == []
    n, size = len(trees.regular_files(src)), sum(trees.regular_files(src).values())
    assert (res["files"], res["bytes"]) == (n, size)
    assert 0 <= res["copied_files"] <= n
    assert 0 <= res["copied_bytes"] <= size
    return res


def test_sigkill_at_random_moments(engine: str, mixed_src: Path, tmp_path: Path) -> None:
    """Killed once a random fraction of the files is whole at their names (a point in
    the stage's progress: a moment in time may come before the first file on a busy
    machine), and resumed: each resume copies less than the whole tree."""
    rng = random.Random(1234)
    fractions = sorted(rng.uniform(0.1, 0.8) for _ in range(4))
    n_files = len(trees.regular_files(mixed_src))
    killed_runs = []
    for i, frac in enumerate(fractions):
        # A stage can finish between two looks at its destination; then the same point
        # is tried again, earlier.
        for attempt in range(5):
            dst = tmp_path / f"dst{i}-{attempt}"
            at = frac / 2**attempt
            child = procs.signal_once_done(procs.stage_spec(mixed_src, dst, engine=engine),
                                         dst, max(1, int(at * n_files)))
            complete = trees.assert_no_partial_files(mixed_src, dst)
            res = resume(mixed_src, dst, engine)
            # Nothing whole is copied again. (Not "==": the kernel may finish a rename the
            # killed process queued after its files were counted.)
            assert res["copied_files"] <= n_files - complete, (res, complete)
            if landed(child, signal.SIGKILL):
                killed_runs.append((round(at, 3), complete, res["copied_files"]))
                break
            assert res["skipped"] is True, res  # it had finished: nothing to do
        else:
            pytest.fail(f"every stage finished before the kill at {frac:.2f} of the files")
    assert all(copied < n_files for _, _, copied in killed_runs), (
        f"a resume copied again files already whole: (fraction, complete files after the "
        f"kill, copied on resume) = {killed_runs}, files = {n_files}"
    )


def test_repeated_kills_then_resume(engine: str, mixed_src: Path, tmp_path: Path) -> None:
    """Each run resumes the previous partial state and is itself killed, further into
    the tree each time: what one run finished, the next keeps."""
    n_files = len(trees.regular_files(mixed_src))
    for attempt in range(5):  # from the start, earlier, where a run finished first
        dst = tmp_path / f"dst{attempt}"
        whole = [0]
        for _ in range(3):  # each killed 20% of the files further on
            more = max(1, int(0.2 * n_files / 2**attempt))
            child = procs.signal_once_done(procs.stage_spec(mixed_src, dst, engine=engine),
                                           dst, whole[-1] + more)
            whole.append(trees.assert_no_partial_files(mixed_src, dst))
            if not landed(child, signal.SIGKILL):
                break
        else:
            break  # three kills, each before the end
    else:
        pytest.fail("a run finished before its kill in every attempt")
    res = resume(mixed_src, dst, engine)
    assert res["skipped"] is False
    assert 0 < res["copied_files"] <= n_files - whole[-1], (res, whole)


def test_ctrl_c_stops_and_resumes(engine: str, mixed_src: Path, tmp_path: Path) -> None:
    n_files = len(trees.regular_files(mixed_src))
    for attempt, frac in enumerate((0.4, 0.2, 0.1, 0.05)):
        dst = tmp_path / f"dst{attempt}"
        child = procs.signal_once_done(
            {**procs.stage_spec(mixed_src, dst, engine=engine), "progress": True}, dst,
            max(1, int(frac * n_files)), signal.SIGINT)
        # (A Ctrl-C after stage() returned and the child printed its result is late.)
        if child.returncode != 0 and child.result is None:
            break
    else:
        # Each finished before Ctrl-C (between two looks at the destination): one held
        # mid-way in its progress callback, and interrupted there.
        dst = tmp_path / "held"
        child = procs.Child({**procs.stage_spec(mixed_src, dst, engine=engine),
                             "progress": True, "hold": True}, env=procs.child_env())
        assert child.wait_line("HELD") is not None, child.finish().stderr
        child.signal(signal.SIGINT)
        child = child.finish(timeout=60)
    assert child.result is None
    assert child.error is None, f"Ctrl-C became another exception: {child.error}"
    assert "KeyboardInterrupt" in child.stderr, child.stderr[-2000:]
    trees.assert_no_partial_files(mixed_src, dst)
    resume(mixed_src, dst, engine)
