"""http(s):// sources: the response body as a stream, through fsspec's HTTP file system
when it (and aiohttp) are installed, else the standard library (``FASTLOAD_HTTP``
chooses)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

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
            if not size:  # a stream does not know it: the response's Content-Length does
                headers = getattr(getattr(f, "r", None), "headers", {})
                if headers.get("Content-Encoding", "identity") == "identity":
                    size = headers.get("Content-Length")
            yield f, int(size) if size else None
        return
    with _urlopen(url, {"User-Agent": f"fastload/{version()}"}) as resp:
        yield resp, resp.length


def _urlopen(url: str, headers: dict[str, str]) -> Any:
    """urllib's response to a GET of ``url``; a missing file as FileNotFoundError, any
    other failure as :func:`net_error` says it."""
    import urllib.error
    import urllib.request

    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code in (404, 410):
            raise stage_error(
                errno.ENOENT, f"'{url}' was not found (HTTP {e.code})", url
            ) from None
        raise net_error(url, e) from None
    except (urllib.error.URLError, OSError) as e:
        raise net_error(url, e) from None


def validator(reader: object) -> str | None:
    """What identifies the version of a response's content (its ETag, else its
    Last-Modified), from a urllib response or an fsspec HTTP stream; None if neither."""
    headers = getattr(reader, "headers", None)
    if headers is None:
        headers = getattr(getattr(reader, "r", None), "headers", None)
    if headers is None:
        return None
    etag = headers.get("ETag")
    if etag and not etag.startswith("W/"):  # weak ETags are not allowed in If-Range
        return str(etag)
    modified = headers.get("Last-Modified")
    return str(modified) if modified else None


@contextlib.contextmanager
def open_http_from(
    url: str, start: int, content_version: str
) -> Iterator[tuple[Reader, int | None, int]]:
    """The body from byte ``start`` on, if the content is still ``content_version`` (``Range``
    with ``If-Range``): ``(stream, total size, start)``; a server that ignores the range
    or whose content changed sends it all, and the start is then 0."""
    headers = {
        "User-Agent": f"fastload/{version()}",
        "Range": f"bytes={start}-",
        "If-Range": content_version,
    }
    with _urlopen(url, headers) as resp:
        if resp.status == 206:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            yield resp, int(total) if total.isdigit() else None, start
        else:
            yield resp, resp.length, 0
