"""Downloads into a node-local cache: once per node (the others wait on the lock beside
the file), into a temporary renamed into place once whole and its checksum verified,
with what was downloaded (URL, size, time, digests) kept beside it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Union

from .._util import node_lock, parse_checksum, write_json_atomic
from ..errors import ChecksumMismatchError, stage_error
from .base import Reader, net_error, open_url, scheme_of
from .http import open_http_from
from .http import validator as http_version

Progress = Union[bool, Callable[[int, int, int, int], None], None]
_CHUNK = 1 << 20


def _url_filename(url: str) -> str:
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    name = os.path.basename(path.rstrip("/"))
    return name if name and name not in (".", "..") else "download"


def _meta_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.fastload-download.json")


def _hash_file(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _cached(target: Path, url: str, want: tuple[str, str] | None) -> bool | None:
    """Whether the cached download can be used: True; False when it is there but does
    not match the checksum; None when there is no complete download."""
    try:
        with open(_meta_path(target), encoding="utf-8") as f:
            meta = json.load(f)
        st = os.stat(target)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(meta, dict)
        or meta.get("url") != url
        or meta.get("size") != st.st_size
        or meta.get("mtime_ns") != st.st_mtime_ns
    ):
        return None
    if want is None:
        return True
    digests = meta.setdefault("digests", {})
    if want[0] not in digests:
        digests[want[0]] = _hash_file(target, want[0])
        write_json_atomic(_meta_path(target), meta)
    return bool(digests[want[0]] == want[1])


def download(url: str, cache_dir: Path, checksum: str | None, progress: Progress) -> Path:
    """Downloads ``url`` once into ``cache_dir/downloads/`` (one process per node; the
    others wait for it) and returns the local file."""
    want = parse_checksum(checksum)
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    target = cache_dir / "downloads" / key / _url_filename(url)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO,
            f"cannot create the download cache '{target.parent}': {e.strerror}",
            str(target.parent),
        ) from None
    with _cache_lock(target) as locked:
        if _cached(target, url, want):
            return target
        _fetch(url, target, want, progress, shared_part=locked)
    return target


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@contextlib.contextmanager
def _cache_lock(target: Path) -> Iterator[bool]:
    """The lock beside a cached download (True), or none (False) where the cache's file
    system refuses locks (some network file systems): then every process downloads to
    its own temporary and the renames stay atomic."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(node_lock(target))
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            yield False
        else:
            yield True


def _resume_point(part: Path, record: Path, url: str) -> tuple[int, str | None]:
    """Where an interrupted download of ``url`` into ``part`` may go on: its length and
    the version (ETag or Last-Modified) it had; (0, None) when it cannot."""
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
        size = os.path.getsize(part)
    except (OSError, ValueError):
        return 0, None
    if not isinstance(saved, dict) or saved.get("url") != url or not saved.get("version"):
        return 0, None
    return size, str(saved["version"])


def _fetch(
    url: str,
    target: Path,
    want: tuple[str, str] | None,
    progress: Progress,
    *,
    shared_part: bool = True,
) -> None:
    """Downloads into a temporary beside ``target``, hashing on the way, then renames it
    into place. Under the lock the temporary has a fixed name, and a side record of the
    version being fetched: after an interruption (a reset connection, a body cut short,
    a killed process), the next call asks http(s) servers for the rest only (``Range``
    with ``If-Range``, so a changed file is fetched whole). Without the lock, a name of
    this process's own, removed on failure."""
    suffix = ".part" if shared_part else f".part-{os.uname().nodename}-{os.getpid()}"
    part = target.with_name(f".{target.name}{suffix}")
    record = part.with_name(part.name + ".json")
    hashes = {"sha256": hashlib.sha256()}
    if want is not None and want[0] != "sha256":
        hashes[want[0]] = hashlib.new(want[0])
    start, version = _resume_point(part, record, url) if shared_part else (0, None)
    resumable = shared_part and scheme_of(url) in ("http", "https")
    bar = None
    done = 0
    keep = False  # the part survives a failure: a later call resumes it
    try:
        opened = (
            open_http_from(url, start, version)
            if resumable and start and version
            else _whole(url)
        )
        with opened as (stream, size, begin):
            mode = "r+b" if begin else "wb"
            with open(part, mode) as out:
                if begin:
                    out.truncate(begin)
                    out.seek(0)
                    while block := out.read(8 << 20):  # hash what is already there
                        for h in hashes.values():
                            h.update(block)
                    out.seek(begin)
                elif resumable and (v := http_version(stream)):
                    write_json_atomic(record, {"url": url, "version": v})
                keep = resumable and record.exists()
                done = begin
                if progress is True:
                    from tqdm.auto import tqdm

                    bar = tqdm(
                        total=size, initial=begin, unit="B", unit_scale=True,
                        unit_divisor=1024, desc=f"download {target.name}",
                    )
                last = 0.0
                while True:
                    try:
                        chunk = stream.read(_CHUNK)
                    except OSError as e:
                        raise net_error(url, e) from e
                    except Exception as e:  # aiohttp's errors are not OSErrors
                        raise net_error(url, e) from e
                    if not chunk:
                        break
                    out.write(chunk)
                    for h in hashes.values():
                        h.update(chunk)
                    done += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                    elif callable(progress) and time.monotonic() - last > 0.25:
                        last = time.monotonic()
                        progress(done, size or 0, 0, 1)
                out.flush()
                os.fsync(out.fileno())
        if size is not None and done != size:
            raise stage_error(
                errno.EIO, f"download of '{url}' ended after {done} of {size} bytes", url
            )
        keep = False
        digests = {algo: h.hexdigest() for algo, h in hashes.items()}
        if want is not None and digests[want[0]] != want[1]:
            exc = ChecksumMismatchError(
                errno.EIO,
                f"checksum mismatch for '{url}': expected {want[0]}:{want[1]}, "
                f"got {want[0]}:{digests[want[0]]}",
            )
            exc.filename = url
            raise exc
        os.replace(part, target)
        st = os.stat(target)
        meta = {
            "url": url,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "digests": digests,
            "downloaded": time.time(),
        }
        write_json_atomic(_meta_path(target), meta)
        with contextlib.suppress(OSError):
            record.unlink()
        if callable(progress):
            progress(done, done, 1, 1)
    except BaseException:
        if not keep:
            for leftover in (part, record):
                with contextlib.suppress(OSError):
                    leftover.unlink()
        raise
    finally:
        if bar is not None:
            bar.close()


@contextlib.contextmanager
def _whole(url: str) -> Iterator[tuple[Reader, int | None, int]]:
    with open_url(url) as (stream, size):
        yield stream, size, 0
