"""The retry policy's pure parts (sources/retry.py): which errors are transient, the
backoff's bounds, the limits of a request's attempts and their count. The policy against a
real server and its faults: test_s3_retries.py."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastload.sources.retry import RetryCounts, RetryPolicy, Tries, process_retries, transient
from kit.tools import require_module

ox = require_module("obstore.exceptions", "the s3 extra (obstore) is not installed")


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ox.GenericError("Server returned non-2xx status code: 503 Service Unavailable: "
                         "<Error><Code>SlowDown</Code></Error>"), "throttled"),
        (ox.GenericError("Server returned non-2xx status code: 429 Too Many Requests"),
         "throttled"),
        (ox.GenericError("Server returned non-2xx status code: 500 Internal Server Error"),
         "server_error"),
        (ox.GenericError("HTTP error: request or response body error ... IncompleteBody"),
         "short_body"),
        (ox.GenericError("HTTP error: error sending request ... kind: Connect"), "connection"),
        (ox.GenericError("HTTP error: operation timed out"), "timeout"),
        # Not transient: asked again, they would fail again.
        (ox.GenericError("Server returned non-2xx status code: 416 Range Not Satisfiable"),
         None),
        (ox.GenericError("Server returned non-2xx status code: 400 Bad Request"), None),
        (ox.GenericError("Server returned non-2xx status code: 403 Forbidden"), None),
        (ox.NotFoundError("Object at location k not found"), None),
        (ox.PreconditionError("Request precondition failure for path k"), None),
        (ox.PermissionDeniedError("denied"), None),
        (ox.UnauthenticatedError("no"), None),
        (ValueError("timed out"), None),  # not from the store
    ],
)  # fmt: skip
def test_what_is_transient(error: BaseException, reason: str | None) -> None:
    assert transient(error) == reason


@given(st.lists(st.integers(0, 2**32), min_size=1, max_size=30))
def test_backoff_stays_within_its_bounds(seeds: list[int]) -> None:
    policy = RetryPolicy()
    wait = 0.0
    for i, seed in enumerate(seeds):
        random.seed(seed)
        nxt = policy.backoff(wait)
        assert policy.initial <= nxt <= policy.max_backoff
        if i == 0:
            assert nxt == policy.initial
        else:
            assert nxt <= max(policy.initial, wait * policy.base)
        wait = nxt


class _Raised(Exception):
    pass


def _attempts(policy: RetryPolicy, error: BaseException) -> tuple[int, RetryCounts]:
    """Fails every attempt with ``error``: how many retries were made before it was
    raised (as _Raised)."""
    counts = RetryCounts()
    tries = Tries(counts, lambda e, n: _Raised(n), policy)
    while True:
        try:
            tries.failed(error)
        except _Raised as e:
            return e.args[0], counts


def test_retries_end_at_the_limit_and_are_counted() -> None:
    before = process_retries().snapshot().get("server_error", 0)
    policy = RetryPolicy(retries=5, initial=0.001, max_backoff=0.002)
    made, counts = _attempts(policy, ox.GenericError("status code: 502 Bad Gateway"))
    assert made == 5 and counts.snapshot() == {"server_error": 5} and counts.total() == 5
    assert process_retries().snapshot().get("server_error", 0) - before >= 5


def test_retries_end_at_the_deadline() -> None:
    """A deadline shorter than the next backoff: no retry at all (the error at once)."""
    policy = RetryPolicy(retries=8, initial=0.5, deadline=0.1)
    made, counts = _attempts(policy, ox.GenericError("status code: 503"))
    assert made == 0 and counts.total() == 0


def test_the_deadline_counts_from_the_first_attempt() -> None:
    """A tracker made at a request's first failure (a small object's GET makes none
    before) is told when the request began: the time before the failure counts."""
    policy = RetryPolicy(retries=8, initial=0.01, deadline=10.0)
    error = ox.GenericError("status code: 503")
    fresh = Tries(RetryCounts(), lambda e, n: _Raised(n), policy)
    assert fresh.wait_after(error) == policy.initial
    late = Tries(RetryCounts(), lambda e, n: _Raised(n), policy,
                 started=time.monotonic() - 11.0)  # fmt: skip
    with pytest.raises(_Raised):
        late.wait_after(error)


def test_not_transient_is_raised_at_once() -> None:
    made, counts = _attempts(RetryPolicy(), ox.NotFoundError("k"))
    assert made == 0 and counts.snapshot() == {}


def test_counts_are_thread_safe() -> None:
    counts = RetryCounts()

    def add() -> None:
        for _ in range(5000):
            counts.add("connection")

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts.snapshot() == {"connection": 40_000}
