"""What stage() and verify() return."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class StageResult:
    """What stage() did."""

    path: Path
    """The staged file or tree."""
    files: int
    """Files in the staged set."""
    bytes: int
    """Bytes in the staged set."""
    seconds: float
    engine: str
    """The I/O backend that ran: ``"uring"`` or ``"pread"`` (``"none"`` when skipped)."""
    skipped: bool
    """True when a complete copy of the unchanged source was already there."""
    copied_files: int = 0
    """Files this call copied (fewer than ``files`` after a resume)."""
    copied_bytes: int = 0
    nodes: int = 1
    """Nodes that staged this copy together (``fanout=True``), 1 otherwise."""
    read_bytes: int | None = None
    """Bytes this process read from the source for a fanned-out stage (its share, plus
    the pieces of an archive it read for the others); ``None`` for a plain stage."""


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What verify() found."""

    path: Path
    files: int
    bytes: int
    mismatched: list[str]
    """Files whose content (or size) differs from the manifest, relative to ``path``."""
    missing: list[str]
    """Files (or symlinks) of the manifest that are gone."""

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.missing

