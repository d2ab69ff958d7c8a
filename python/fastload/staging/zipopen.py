"""Which zip source a stage() call makes (:func:`open_zip`): a local file, an object
store's object or an http(s):// URL read by ranges, and ``unpack="nested"``'s wrapper."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from .request import StageRequest
from .zipformat import ZipLimits, is_zip_name
from .zipio import ZipData
from .zipsource import ZipSource


def open_zip(src: str | Path, req: StageRequest, spool: Path) -> Any:
    """The zip source of a local path, an object store URL or an http(s):// URL (read by
    ranges; ``spool``: where an HTTP zip whose server serves no ranges is downloaded)."""
    from ..sources import is_store_url
    from .zipio import LocalZip, StoreZip, open_http_zip

    limits = ZipLimits.of(req.zip_options)
    data: ZipData
    if req.nested:
        from .zipnested import NestedZips

        return NestedZips(open_zip(src, dataclasses.replace(req, unpack="auto"), spool), req)
    if isinstance(src, str) and is_store_url(src):
        from ..sources.base import store_for

        store = store_for(src, req.storage_options)
        data = StoreZip(store, store.head())
    elif isinstance(src, str) and src.lower().startswith(("http://", "https://")):
        data = open_http_zip(src, spool)
    else:
        data = LocalZip(Path(src))
    return ZipSource(data, req, limits)


def is_zip_url(src: str) -> bool:
    """Whether stage() takes the URL ``src`` for a zip read by ranges (by its name)."""
    from urllib.parse import urlsplit

    low = src.lower()
    if not low.startswith(("http://", "https://", "s3://", "gs://", "az://")):
        return False
    return is_zip_name(urlsplit(src).path)
