"""Reads of this process that waited on a stage in the background (issue 49): how many
and for how long, for ``fastload.monitor`` (``stage/waits``, ``stage/wait_s``). Kept apart
from background.py so that a monitored worker imports no more than these counters."""

from __future__ import annotations

import threading

__all__ = ["note_wait", "snapshot"]

_counts = {"stage_waits": 0.0, "stage_wait_s": 0.0}
_lock = threading.Lock()


def note_wait(seconds: float) -> None:
    """A read (or a batch of reads asked for at once) waited ``seconds`` for the stage."""
    with _lock:
        _counts["stage_waits"] += 1
        _counts["stage_wait_s"] += seconds


def snapshot() -> dict[str, float]:
    with _lock:
        return dict(_counts)
