"""``to_tensor``: imported by streaming.vision.base, never called by the benchmarks."""

from __future__ import annotations

from typing import Any


def to_tensor(pic: Any) -> Any:
    raise ImportError("torchvision is a stub here (benchmarks/_stubs): not installed")
