"""The retry policy of object-store requests, and the count of the retries it made.

obstore's own retries are off (``max_retries=0``: they could not be counted); every
request of :class:`~fastload.sources.objstore.ObjectStore` goes through :class:`Tries`
instead: up to :attr:`RetryPolicy.retries` retries of what is transient (HTTP 5xx,
429 or SlowDown, a connection refused or reset, a timeout, a body cut short), with
exponential backoff and jitter, within an overall deadline. What is not transient (404,
403, 412 precondition failed, 416, a bad request) is raised at once.

Each retry is counted by reason, in the store that made it and in this process's
total (:func:`process_retries`): ``stage(..., stats=True)`` and ``fastload.monitor``
report them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["REASONS", "RawError", "RetryCounts", "RetryPolicy", "Tries", "process_retries",
           "transient"]

#: The reasons a request is retried for, as counted.
REASONS = ("throttled", "server_error", "connection", "timeout", "short_body")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a transient failure is retried (the limits obstore's own
    retries had: 8 retries, 50 ms first backoff, 5 s at most, 120 s in all)."""

    retries: int = 8
    initial: float = 0.05
    max_backoff: float = 5.0
    base: float = 2.0
    deadline: float = 120.0

    def backoff(self, previous: float) -> float:
        """The wait before the next retry, after a wait of ``previous`` seconds (0 before
        the first): decorrelated jitter, uniform between :attr:`initial` and ``base``
        times the last wait, at most :attr:`max_backoff`."""
        if previous <= 0:
            return self.initial
        return min(self.max_backoff, random.uniform(self.initial, previous * self.base))


POLICY = RetryPolicy()


class RetryCounts:
    """Retries by reason; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: Counter[str] = Counter()

    def add(self, reason: str) -> None:
        with self._lock:
            self._n[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)

    def total(self) -> int:
        with self._lock:
            return sum(self._n.values())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


_PROCESS = RetryCounts()
os.register_at_fork(after_in_child=_PROCESS._after_fork)


def process_retries() -> RetryCounts:
    """The retries of every object-store request this process made."""
    return _PROCESS


class RawError(OSError):
    """The failure of a request made without obstore (sources/s3raw.py): ``status`` (the
    HTTP status, 0 where no server answered) and the server's error code where it sent
    one. Its text reads like obstore's errors (``status 503``, ``connection refused``,
    ``timed out``), so this policy and the error mapping treat both alike."""

    def __init__(self, text: str, status: int = 0, code: str = "") -> None:
        super().__init__(text)
        self.status, self.code = status, code


_STATUS = re.compile(r"status(?: code)?:? (\d{3})")


def transient(e: BaseException) -> str | None:
    """Why ``e`` (an obstore error) is worth retrying (one of :data:`REASONS`), or None
    where it is not: a missing object, refused credentials, a precondition or range that
    failed, a bad request, anything not from the network."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover - no store without obstore
        return None
    if isinstance(e, (FileNotFoundError, ox.NotFoundError, ox.PreconditionError,
                      ox.PermissionDeniedError, ox.UnauthenticatedError,
                      ox.NotModifiedError)):  # fmt: skip
        return None
    if not isinstance(e, (ox.BaseError, RawError)):
        return None
    text = str(e)
    m = _STATUS.search(text)
    if m is not None:
        status = int(m.group(1))
        if status == 429 or "SlowDown" in text:
            return "throttled"
        return "server_error" if status >= 500 else None
    low = text.lower()
    if "body error" in low or "incompletebody" in low or "unexpectedeof" in low:
        return "short_body"
    if "timed out" in low or "kind: timeout" in low:
        return "timeout"
    if any(w in low for w in ("error sending request", "connection reset", "connection refused",
                              "connect error", "broken pipe", "kind: interrupted",
                              "kind: connect")):  # fmt: skip
        return "connection"
    return None


class Tries:
    """The attempts at one request under a policy: call :meth:`failed` with each error;
    it returns (after the backoff) where another attempt is due, else raises
    ``raise_as(e, retries made)`` (the error as the user should see it). Retries are
    counted in ``counts`` and in this process's total."""

    def __init__(self, counts: RetryCounts, raise_as: Callable[[BaseException, int], BaseException],
                 policy: RetryPolicy = POLICY, started: float | None = None,
                 answer_limit: float | None = None) -> None:  # fmt: skip
        self.counts, self.raise_as, self.policy = counts, raise_as, policy
        # A request that timed out is tried again only while the time since the first
        # attempt is under this (the store's answer limit): a server that never answers
        # fails once, within the limit, not after a timeout per retry.
        self.answer_limit = answer_limit
        self.retries = 0
        self._wait = 0.0
        # The deadline counts from the first attempt (``time.monotonic()``; now if not told).
        self._start = time.monotonic() if started is None else started

    def failed(self, e: BaseException) -> None:
        time.sleep(self.wait_after(e))

    def wait_after(self, e: BaseException) -> float:
        """:meth:`failed` less the sleep: the seconds to wait before the next attempt
        (for a caller that waits its own way: an event loop), else raises."""
        reason = transient(e)
        if reason is None or self.retries >= self.policy.retries:
            raise self.raise_as(e, self.retries) from None
        wait = self.policy.backoff(self._wait)
        spent = time.monotonic() - self._start + wait
        if spent > self.policy.deadline or (
            reason == "timeout" and self.answer_limit is not None and spent >= self.answer_limit
        ):
            raise self.raise_as(e, self.retries) from None
        self._wait = wait
        self.retries += 1
        self.counts.add(reason)
        _PROCESS.add(reason)
        return wait
