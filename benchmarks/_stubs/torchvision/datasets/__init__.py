"""``VisionDataset``: the base streaming.vision.StreamingVisionDataset derives from."""

from __future__ import annotations

from typing import Any


class VisionDataset:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("torchvision is a stub here (benchmarks/_stubs): not installed")
