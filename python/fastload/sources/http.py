"""http(s):// sources: the response body as a stream, through fsspec's HTTP file system
when it (and aiohttp) are installed, else the standard library (``FASTLOAD_HTTP``
chooses)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from .._util import version
from ..errors import stage_error
from .base import Reader, net_error


def _http_backend() -> str:
    """``"fsspec"`` when fsspec's HTTP file system can be used (it needs aiohttp), else
    ``"urllib"`` (the standard library). ``FASTLOAD_HTTP`` chooses one."""
    forced = os.environ.get("FASTLOAD_HTTP", "").strip().lower()
    if forced in ("fsspec", "urllib"):
        return forced
    if forced not in ("", "auto"):
        raise ValueError(f"FASTLOAD_HTTP must be 'fsspec', 'urllib' or 'auto', not {forced!r}")
    try:
        import aiohttp  # noqa: F401
        import fsspec  # noqa: F401
    except ImportError:
        return "urllib"
    return "fsspec"


@contextlib.contextmanager
def open_http(url: str) -> Iterator[tuple[Reader, int | None]]:
    """The response body as a stream, and its length when the server says it."""
    if _http_backend() == "fsspec":
        import fsspec

        try:
            fs = fsspec.filesystem("http")
            f = fs.open(url, "rb", block_size=0)
        except FileNotFoundError:
            raise stage_error(errno.ENOENT, f"'{url}' was not found (HTTP 404)", url) from None
        except Exception as e:
            raise net_error(url, e) from e
        with f:
            size = getattr(f, "size", None)
            yield f, int(size) if size else None
        return
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"User-Agent": f"fastload/{version()}"})
    try:
        resp = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code in (404, 410):
            raise stage_error(
                errno.ENOENT, f"'{url}' was not found (HTTP {e.code})", url
            ) from None
        raise net_error(url, e) from None
    except (urllib.error.URLError, OSError) as e:
        raise net_error(url, e) from None
    with resp:
        yield resp, resp.length

