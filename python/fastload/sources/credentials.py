"""Why an object store request failed before it reached the store: the client found no
credentials (environment, profile, ``storage_options``) and asked the instance metadata
service (EC2's, at ``AWS_METADATA_ENDPOINT``'s paths, or a container's) for a role's,
which refused or was not there. Told apart from a store that refused the credentials
and from a store that cannot be reached (issue 52)."""

from __future__ import annotations

import re

__all__ = ["credentials_not_found"]

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
