"""Packing into an object store (``s3://bucket/prefix/``): shards are written locally
(a temporary folder) and uploaded (several in flight, multipart for big ones: obstore's
``put`` of a file), the index last, once every shard is there, so a reader listing the
prefix never finds an index describing shards that are not all uploaded. Beside the
index goes its zstd-compressed copy (``NAME.zst``, about a tenth of the bytes), which a
remote reader fetches first. ShardWriter uploads each shard as soon as it is complete
and keeps only its headers (a sparse skeleton) for the index; ``pack(path)`` packs
natively into the temporary folder, then uploads. Local copies are removed once
uploaded."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import _core
from ..cache.remote import header_skeleton
from ..sources import is_store_url, store_for
from ..sources.objstore import StorageOptions, split_url

if TYPE_CHECKING:
    from .writer import PackResult

__all__ = ["UPLOADS_IN_FLIGHT", "Uploader", "compress_index", "is_store_url", "pack_to_bucket"]

UPLOADS_IN_FLIGHT = 4
#: Indexes up to this size also get a compressed copy (compressed in memory).
COMPRESS_INDEX_MAX = 2 << 30


class Uploader:
    """Uploads files under ``url`` (a prefix), ``UPLOADS_IN_FLIGHT`` at a time."""

    def __init__(self, url: str, storage_options: StorageOptions | None = None) -> None:
        if not url.endswith("/"):
            url += "/"
        split_url(url)  # checks it
        self.url = url
        self.store = store_for(url, storage_options)
        self._pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="fastload-up")
        self._pending: list[Future[None]] = []

    def submit(self, path: Path, name: str, remove: bool = True) -> None:
        """Uploads ``path`` as ``name`` under the prefix (then removes it)."""

        def run() -> None:
            self.store.put(name, path)
            if remove:
                path.unlink(missing_ok=True)

        self._pending.append(self._pool.submit(run))
        self._raise_failed()

    def submit_index(self, path: Path, name: str) -> None:
        """Uploads the index ``path`` as ``name`` and, where libzstd is present, its
        zstd-compressed copy as ``name.zst`` (then removes ``path``). Call it once every
        shard is uploaded (:meth:`wait`): the index must be the newest object."""
        if _core.zstd_available() and path.stat().st_size <= COMPRESS_INDEX_MAX:
            data = path.read_bytes()  # read now: the upload below removes the file
            self._pending.append(self._pool.submit(
                lambda: self.store.put(name + ".zst", compress_index(data, os.fspath(path)))))
        self.submit(path, name)

    def _raise_failed(self) -> None:
        for f in [f for f in self._pending if f.done()]:
            self._pending.remove(f)
            f.result()

    def wait(self) -> None:
        """Waits for every upload; raises the first failure."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def compress_index(data: bytes, name: str) -> bytes:
    """The zstd copy of an index's bytes, as :meth:`Uploader.submit_index` uploads it
    (``name`` is what an error names). Needs libzstd (:func:`_core.zstd_available`)."""
    return _core.zstd_compress(data, 3, name)


def index_from_skeletons(skeletons: list[Path], names: list[str], dest: Path) -> None:
    """The index of shards from their header skeletons (see
    :func:`fastload.cache.remote.header_skeleton`), recording ``names``."""
    _core.build_index([os.fspath(p) for p in skeletons], names, os.fspath(dest), "error", 0)


def pack_to_bucket(run: Callable[[Path], PackResult], out_url: str,
                   index: str | None) -> PackResult:
    """``run(LOCAL)`` packs into a temporary folder; then its shards (and other files)
    are uploaded under ``out_url``, the index last. Returns ``run``'s result with the
    places it names (``out_dir``, ``shards``, ``index``) in the bucket: the local copies
    are gone."""
    up = Uploader(out_url)
    local = Path(tempfile.mkdtemp(prefix="fastload-pack-"))
    base = out_url if out_url.endswith("/") else out_url + "/"
    try:
        result = run(local)
        names = sorted(p.name for p in local.iterdir() if p.is_file())
        last = [n for n in names if index and n == index]
        for n in names:
            if n not in last:
                up.submit(local / n, n)
        up.wait()
        for n in last:
            up.submit_index(local / n, n)
        up.wait()
        return dataclasses.replace(
            result,
            out_dir=base,
            shards=tuple(base + Path(s).name for s in result.shards),
            index=base + Path(result.index).name if result.index is not None else None,
        )
    finally:
        up.close()
        shutil.rmtree(local, ignore_errors=True)


def skeleton_of(shard: Path, work: Path) -> Path:
    out = work / f".{shard.name}.headers"
    header_skeleton(shard, out, shard.stat().st_size)
    return out
