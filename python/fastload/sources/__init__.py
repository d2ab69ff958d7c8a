"""Sources: where bytes come from, behind one small interface chosen by URL scheme
(``base``): local paths are read by the staging pipelines natively; ``http``/``https``
through ``http``; ``s3://``, ``gs://``, ``az://`` through ``objstore`` (obstore, an
optional extra), which stage() also lists and reads in ranges. ``download`` keeps fetched files
in a node-local cache, once per node.

The object stores' module (and asyncio, ssl, obstore behind it) is imported when a store
URL is first opened, not with this package: a local stage never needs it
(tests/test_imports.py).

May import: ``errors``, ``_util`` (never ``staging`` or anything above it).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from .base import (
    OBJECT_SCHEMES,
    Opener,
    Reader,
    check_supported,
    is_store_url,
    is_url,
    open_url,
    register_scheme,
    register_store,
    scheme_of,
    schemes,
    store_for,
)
from .download import download
from .http import open_http

if TYPE_CHECKING:  # at run time, __getattr__ below imports them on first use
    from .objstore import ObjectStore, is_object_url


def _open_object(url: str) -> AbstractContextManager[tuple[Reader, int | None]]:
    from .objstore import open_object

    return open_object(url)


def _object_store(url: str, options: Mapping[str, Any] | None) -> ObjectStore:
    from .objstore import ObjectStore

    return ObjectStore(url, options)


register_scheme("http", open_http)
register_scheme("https", open_http)
for _scheme in OBJECT_SCHEMES:
    register_scheme(_scheme, _open_object)
    register_store(_scheme, _object_store)


def __getattr__(name: str) -> object:
    if name in ("ObjectStore", "is_object_url", "open_object"):
        from . import objstore

        return getattr(objstore, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Opener",
    "Reader",
    "check_supported",
    "download",
    "is_object_url",
    "is_store_url",
    "is_url",
    "open_url",
    "register_scheme",
    "register_store",
    "scheme_of",
    "schemes",
    "store_for",
]
