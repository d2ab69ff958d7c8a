"""Why an object store request failed. Before it reached the store: the client found no
credentials (environment, profile, ``storage_options``) and asked the instance metadata
service (EC2's, at ``AWS_METADATA_ENDPOINT``'s paths, or a container's) for a role's,
which refused or was not there. Told apart from a store that refused the credentials
and from a store that cannot be reached (issue 52): refused, not resolved, or accepting
the connection and never answering (the answer limit, FASTLOAD_STORE_TIMEOUT: issue 50)."""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["ANSWER_TIMEOUT", "answer_timeout", "credentials_not_found", "seconds", "unreachable"]

# How long a request may wait for the server's next bytes before it fails, naming the
# endpoint (seconds; FASTLOAD_STORE_TIMEOUT, or client_options' read_timeout).
ANSWER_TIMEOUT = 60.0

# Where the client fetches credentials when none are configured.
_SERVICES = ("/latest/api/token", "/latest/meta-data/", "169.254.170.2")


def credentials_not_found(text: str) -> str | None:
    """What to say where ``text`` (an obstore error's) is a failure to fetch credentials
    from the metadata service, else None."""
    if not any(where in text for where in _SERVICES):
        return None
    low = text.lower()
    m = re.search(r"status code: (\d{3}[^:\n]*)", low)
    if m is not None:
        why = f"it answered {m.group(1).strip()}"
    elif "dns error" in low or "failed to lookup" in low:
        why = "its host name does not resolve"
    elif "timed out" in low:
        why = "it did not answer in time"
    else:
        why = "it could not be reached"
    return ("none in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
            f"storage_options, and the instance metadata service gave none ({why}); set "
            "them, or pass anonymous=True (--anonymous) for a public bucket")  # fmt: skip


def answer_timeout() -> float:
    """The seconds a request may wait for the server's next bytes: FASTLOAD_STORE_TIMEOUT,
    else :data:`ANSWER_TIMEOUT`."""
    raw = os.environ.get("FASTLOAD_STORE_TIMEOUT", "").strip()
    if not raw:
        return ANSWER_TIMEOUT
    got = seconds(raw, -1.0)
    if got <= 0:
        raise ValueError(f"FASTLOAD_STORE_TIMEOUT must be a number of seconds > 0, not {raw!r}")
    return got


def seconds(value: Any, default: float) -> float:
    """``value`` (``60``, ``"60"``, ``"60s"``, ``"500ms"``, ``"2m"``) in seconds, else
    ``default``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*", str(value)) if value else None
    if m is None:
        return default
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(2) or "s"]


def unreachable(low: str, retries: int, timeout: float = ANSWER_TIMEOUT) -> str:
    """Why a request found no server, in a few words (obstore's text runs to a line of
    retry settings and a nested cause)."""
    tries = f" (after {retries} retries)" if retries else ""
    if "connection refused" in low:
        return "connection refused" + tries
    if any(w in low for w in ("dns error", "failed to lookup", "name or service",
                              "name resolution", "no address associated")):  # fmt: skip
        return "the host name does not resolve" + tries
    if ("timed out" in low or "timeout" in low) and "connect" not in low:
        return (f"it accepted the connection but did not answer within {timeout:g} s{tries} "
                "(FASTLOAD_STORE_TIMEOUT sets the limit for a slow store)")
    if "timed out" in low or "timeout" in low:
        return "timed out" + tries
    return "no answer" + tries
