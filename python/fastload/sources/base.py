"""The interface every source implements, and the registry of sources by URL scheme.

A source turns a URL into a byte stream: ``opener(url)`` is a context manager yielding
``(reader, size)``, where ``reader.read(n)`` returns up to ``n`` bytes (``b""`` at the
end) and ``size`` is the length when the server says it. Errors are OSErrors naming the
URL: ``FileNotFoundError`` for a missing object, :class:`fastload.StageError` otherwise.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from typing_extensions import TypeGuard

    from .objstore import ObjectStore

from ..errors import StageError, stage_error


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


Opener = Callable[[str], AbstractContextManager[tuple[Reader, "int | None"]]]

# The object stores' schemes (sources.objstore reads them, through obstore).
OBJECT_SCHEMES = ("s3", "gs", "az")

_OPENERS: dict[str, Opener] = {}
# Object stores (listing, ranged reads, writes), by scheme: store_for() makes one.
_STORES: dict[str, Callable[[str, Mapping[str, Any] | None], Any]] = {}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


# The site's defaults for object stores (sources.settings reads them; here, not there, so
# that the package sets the hook without importing the settings' parsers).
_site_loader: Callable[[], Mapping[str, Any]] | None = None


def set_site_loader(loader: Callable[[], Mapping[str, Any]] | None) -> None:
    """Where the site's defaults come from: ``loader()`` returns ``{"s3": {...}, ...}``
    (the package passes the configuration file's ``[storage]`` tables,
    :func:`fastload.env.config.storage_defaults`)."""
    global _site_loader
    _site_loader = loader


def site_options(scheme: str) -> dict[str, Any]:
    """The site's defaults for ``scheme`` (read at each use: the file may change)."""
    if _site_loader is None:
        return {}
    return dict(_site_loader().get(scheme, {}))


def register_scheme(scheme: str, opener: Opener) -> None:
    """Makes ``scheme://`` URLs readable through ``opener`` (replacing an earlier one)."""
    if not _SCHEME.match(f"{scheme}://"):
        raise ValueError(f"not a URL scheme: {scheme!r}")
    _OPENERS[scheme.lower()] = opener


def register_store(
    scheme: str, factory: Callable[[str, Mapping[str, Any] | None], ObjectStore]
) -> None:
    """Makes ``scheme://bucket/prefix`` URLs an object store: ``factory(url, options)``
    returns the store (sources.objstore.ObjectStore for s3, gs and az)."""
    _STORES[scheme.lower()] = factory


def store_for(url: str, options: Mapping[str, Any] | None = None) -> ObjectStore:
    """The object store of ``url`` (``s3://bucket/prefix/``) with ``options`` (the one
    place storage options are read; clients shared per bucket, safe across fork)."""
    scheme = scheme_of(url)
    factory = _STORES.get(scheme or "")
    if factory is None:
        raise ValueError(f"not an object store URL ({', '.join(sorted(_STORES))}): {url!r}")
    store: ObjectStore = factory(url, options)
    return store


def is_store_url(location: object) -> TypeGuard[str]:
    """Whether ``location`` is a URL of a registered object store (its scheme in lower
    case, as the stores write it: ``S3://b/k`` is a path, which stage() answers with
    "did you mean s3://b/k")."""
    if not isinstance(location, str):
        return False
    m = _SCHEME.match(location)
    return m is not None and m.group(1) in _STORES


def schemes() -> Mapping[str, Opener]:
    """The registered schemes and their openers (read-only)."""
    return MappingProxyType(_OPENERS)


def scheme_of(location: str) -> str | None:
    """``"https"`` for ``https://host/x``; None for a path (which has no ``scheme://``)."""
    m = _SCHEME.match(location)
    return m.group(1).lower() if m else None


def is_url(location: str) -> bool:
    """Whether ``location`` is a URL of a registered scheme."""
    return scheme_of(location) in _OPENERS


def check_supported(location: str) -> None:
    """Raises ValueError when ``location`` looks like a URL of a scheme nobody reads."""
    scheme = scheme_of(location)
    if scheme is not None and scheme not in _OPENERS:
        known = ", ".join(sorted(_OPENERS))
        raise ValueError(f"{location!r}: the {scheme}:// scheme is not supported yet ({known})")


def open_url(url: str) -> AbstractContextManager[tuple[Reader, int | None]]:
    """The body of ``url`` as a stream, through the source registered for its scheme."""
    check_supported(url)
    scheme = scheme_of(url)
    if scheme is None:
        raise ValueError(f"not a URL: {url!r}")
    return _OPENERS[scheme](url)


def net_error(url: str, e: BaseException) -> StageError:
    """A failed transfer of ``url`` as a StageError (EIO) that names it and the cause."""
    return stage_error(errno.EIO, f"cannot download '{url}': {type(e).__name__}: {e}", url)
