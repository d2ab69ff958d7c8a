"""Interrupted staging: a real child process killed mid-way (SIGKILL) or interrupted
(SIGINT), then resumed.

Kill moments are chosen as fractions of how long one uninterrupted stage of the same tree
takes here (measured first). Those durations only pick when to kill; nothing asserts on
them.
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kit import procs, trees

pytestmark = pytest.mark.native

_durations: dict[str, float] = {}


def full_stage_seconds(src: Path, tmp_path: Path, engine: str) -> float:
    """Wall time of one uninterrupted child stage, from its START line to its exit."""
    if engine not in _durations:
        dst = tmp_path / "calibration"
        child = procs.Child(procs.stage_spec(src, dst, engine=engine),
                              env=procs.child_env())
        assert child.wait_line("START") is not None, child.finish().stderr
        t0 = time.monotonic()
        child.finish()
        _durations[engine] = time.monotonic() - t0
        child.expect_result()
        shutil.rmtree(dst)
    return _durations[engine]


def interrupt_at(src: Path, dst: Path, engine: str, delay: float, sig: int,
                 **spec: Any) -> procs.Child:
    """Starts a stage child, sends ``sig`` ``delay`` s after it began staging, and waits
    for it (a generous limit: a child that does not stop fails the test)."""
    child = procs.Child({**procs.stage_spec(src, dst, engine=engine), **spec},
                          env=procs.child_env())
    assert child.wait_line("START") is not None, child.finish().stderr
    time.sleep(delay)
    child.signal(sig)
    try:
        return child.finish(timeout=60)
    except AssertionError as e:
        raise AssertionError(f"the stage did not stop after signal {sig}: {e}") from None


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
    full = full_stage_seconds(mixed_src, tmp_path, engine)
    rng = random.Random(1234)
    fractions = sorted(rng.uniform(0.1, 0.8) for _ in range(4))
    n_files = len(trees.regular_files(mixed_src))
    killed_runs = []
    for i, frac in enumerate(fractions):
        # The calibration is one run: on a busy machine a later run can be faster and
        # finish before the kill; then the same point is tried again, earlier.
        for attempt in range(5):
            dst = tmp_path / f"dst{i}-{attempt}"
            at = frac * full / 2**attempt
            child = interrupt_at(mixed_src, dst, engine, at, signal.SIGKILL)
            complete = trees.assert_no_partial_files(mixed_src, dst)
            res = resume(mixed_src, dst, engine)
            if landed(child, signal.SIGKILL):
                killed_runs.append((round(at / full, 3), complete, res["copied_files"]))
                break
            assert res["skipped"] is True, res  # it had finished: nothing to do
        else:
            pytest.fail(f"every stage finished before the kill at {frac:.2f} of {full:.2f} s")
    assert any(copied < n_files for _, _, copied in killed_runs), (
        f"no resume skipped anything: (fraction, complete files after kill, copied on "
        f"resume) = {killed_runs}, files = {n_files}, one full stage took {full:.2f} s"
    )


def test_repeated_kills_then_resume(engine: str, mixed_src: Path, tmp_path: Path) -> None:
    """Each run resumes the previous partial state and is itself killed."""
    full = full_stage_seconds(mixed_src, tmp_path, engine)
    for attempt in range(5):  # from the start, earlier, where a run finished first
        dst = tmp_path / f"dst{attempt}"
        for frac in (0.25, 0.4, 0.3):
            child = interrupt_at(mixed_src, dst, engine, frac * full / 2**attempt,
                                 signal.SIGKILL)
            trees.assert_no_partial_files(mixed_src, dst)
            if not landed(child, signal.SIGKILL):
                break
        else:
            break  # three kills, each before the end
    else:
        pytest.fail(f"a run finished before its kill in every attempt ({full:.2f} s)")
    res = resume(mixed_src, dst, engine)
    assert res["skipped"] is False


def test_ctrl_c_stops_and_resumes(engine: str, mixed_src: Path, tmp_path: Path) -> None:
    full = full_stage_seconds(mixed_src, tmp_path, engine)
    for attempt, frac in enumerate((0.4, 0.2, 0.1, 0.05)):
        dst = tmp_path / f"dst{attempt}"
        child = interrupt_at(mixed_src, dst, engine, frac * full, signal.SIGINT,
                             progress=True)
        if child.returncode != 0:
            break
    else:
        # Each finished before Ctrl-C (a fast run after a slow calibration): one held
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
