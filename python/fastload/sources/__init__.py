"""Sources: where bytes come from, behind one small interface chosen by URL scheme
(``base``): local paths are read by the staging pipelines natively; ``http``/``https``
through ``http``; ``s3://``, ``gs://``, ``az://`` through ``objstore`` (obstore, an
optional extra), which stage() also lists and reads in ranges. ``download`` keeps fetched files
in a node-local cache, once per node.

May import: ``errors``, ``_util`` (never ``staging`` or anything above it).
"""

from .base import (
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
from .objstore import SCHEMES as OBJECT_SCHEMES
from .objstore import ObjectStore, is_object_url, open_object

register_scheme("http", open_http)
register_scheme("https", open_http)
for _scheme in OBJECT_SCHEMES:
    register_scheme(_scheme, open_object)
    register_store(_scheme, ObjectStore)

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
