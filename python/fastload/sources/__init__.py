"""Sources: where bytes come from, behind one small interface chosen by URL scheme
(``base``): local paths are read by the staging pipelines natively; ``http``/``https``
through ``http``; the object stores register here too. ``download`` keeps fetched files
in a node-local cache, once per node.

May import: ``errors``, ``_util`` (never ``staging`` or anything above it).
"""

from .base import (
    Opener,
    Reader,
    check_supported,
    is_url,
    open_url,
    register_scheme,
    scheme_of,
    schemes,
)
from .download import download
from .http import open_http

register_scheme("http", open_http)
register_scheme("https", open_http)

__all__ = [
    "Opener",
    "Reader",
    "check_supported",
    "download",
    "is_url",
    "open_url",
    "register_scheme",
    "scheme_of",
    "schemes",
]
