"""What stage() and verify() return."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class StageStats:
    """Where a stage's time went (``stage(..., stats=True)``)."""

    seconds: float
    """From the call to its return."""
    lock_wait_seconds: float
    """Waiting for the node lock (another process staging the same destination)."""
    setup_seconds: float
    """From the lock to the first bytes copied: listing the source, comparing with an
    earlier stage, planning, checking space (the whole stage when nothing was copied)."""
    copy_seconds: float
    """From the first progress report to the last: reading and writing."""
    cpu_user_seconds: float
    cpu_system_seconds: float
    """CPU time of this process (every thread), from ``getrusage``."""
    samples: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)
    """``(seconds since the call, bytes done, files done)``, a few times a second."""
    listing_seconds: float = 0.0
    """Listing the source (walking a tree, listing a bucket's prefix), within setup."""
    planning_seconds: float = 0.0
    """Comparing the listing with an earlier stage and its journal, within setup."""
    read_busy_seconds: float = 0.0
    write_busy_seconds: float = 0.0
    meta_busy_seconds: float = 0.0
    """Of a local copy: the time at least one read (write; open or close) was in flight,
    summed over the copier's submitter threads. Which of them fills the copy's time
    says whether the source, the destination or the metadata holds it back. Of an
    object prefix: the time the fetching threads waited for the store's bytes (GETs,
    their retries and backoff included) against the time they wrote them (summed over
    the threads; no metadata time). Of an archive: the time in reads of the archive (a
    file's reads, or an object's ranged GETs; summed over the reading threads; none for
    a mapped archive) against the time the feeding thread spent in the extractor
    (parsing, handing members to its writer threads, waiting for them when they lag);
    no metadata time."""
    retries: int = 0
    """Object-store requests this process retried during the stage (503 SlowDown,
    throttling, connection resets, timeouts, bodies cut short)."""
    retry_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    """:attr:`retries` by reason (``throttled``, ``server_error``, ``connection``,
    ``timeout``, ``short_body``)."""

    def rates(self) -> list[tuple[float, float, float]]:
        """``(seconds, bytes/s, files/s)`` between consecutive samples: the throughput
        over time."""
        out = []
        for (t0, b0, f0), (t1, b1, f1) in zip(self.samples, self.samples[1:], strict=False):
            if t1 > t0:
                out.append((t1, (b1 - b0) / (t1 - t0), (f1 - f0) / (t1 - t0)))
        return out

    def to_dict(self) -> dict[str, float]:
        """The totals as a flat dict (``stage/...``) for a logger."""
        rates = [r[1] for r in self.rates()]
        return {
            "stage/seconds": self.seconds,
            "stage/lock_wait_s": self.lock_wait_seconds,
            "stage/setup_s": self.setup_seconds,
            "stage/copy_s": self.copy_seconds,
            "stage/listing_s": self.listing_seconds,
            "stage/planning_s": self.planning_seconds,
            "stage/read_busy_s": self.read_busy_seconds,
            "stage/write_busy_s": self.write_busy_seconds,
            "stage/meta_busy_s": self.meta_busy_seconds,
            "stage/retries": float(self.retries),
            "stage/cpu_user_s": self.cpu_user_seconds,
            "stage/cpu_system_s": self.cpu_system_seconds,
            "stage/peak_bytes_per_s": max(rates, default=0.0),
        }


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
    stats: StageStats | None = None
    """Where the time went, with ``stats=True``; else ``None``."""


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

