"""The object-store pipeline: stage every object under a prefix (a directory tree, keys
split on ``/``), or one object, from ``s3://`` (``gs://``, ``az://``) to node-local disk.

One listing plans the work. Objects a complete manifest (or the journal of an interrupted
run) already holds with the same size, time and ETag are not fetched again, so an
unchanged prefix costs one listing and no GET. Small objects are fetched whole, many in
flight; an object larger than a part is fetched in ranged GETs of one part each, a few
objects' parts in flight, written at their offsets into a part file beside its final
name piece by piece as they stream in (so are objects over a MiB), so memory stays
bounded whatever the sizes. Every GET carries ``If-Match`` with the
listed ETag: an object replaced meanwhile fails with SourceChangedError rather than mix
two versions. Each part's digest is computed as it arrives (the manifest's chunk digests,
so :func:`verify` works as for local data); a part file records its finished parts, so
after a kill a big object resumes from its last whole part. Files are renamed into place
once whole; the manifest is written last.

Over 500 lines on purpose: it is one pipeline (plan, fetch, parts, commit) whose steps
share the job's state; the client side (listing, ranged reads, errors) is already
apart in sources/objstore.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from .. import _core
from .._util import node_lock, write_json_atomic
from ..errors import stage_error
from ..sources.objstore import ObjectInfo, ObjectStore
from .job import DIR, FILE, JOURNAL_EVERY, PROGRESS_EVERY, ProgressCallback, prove
from .result import StageResult
from .state import (
    MANIFEST_VERSION,
    Journal,
    JournalFlusher,
    Records,
    boot_id,
    check_space,
    known_records,
    make_durable,
    mkdir_parent,
    named_os_errors,
    previous_stage,
    quick_same,
    read_manifest,
    reread,
    state_dir,
    trusted,
)
from .tree import TreePlan

# Whole-object GETs in flight (small objects: latency, not bandwidth, is the limit).
DEFAULT_OBJECTS_IN_FLIGHT = 64
# Ranged GETs of big objects in flight (each holds a piece of its part at a time).
_PARTS_IN_FLIGHT = 8
# Objects up to this size are fetched whole into one buffer; larger ones (and every part
# of a big one) are written piece by piece as they stream in.
_WHOLE_UP_TO = 1 << 20
_MODE = 0o644


def fingerprint(url: str, objects: list[ObjectInfo], options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([url, options], sort_keys=True).encode())
    for o in objects:
        h.update(f"{o.key}\0{o.size}\0{o.identity}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _digests(chunks: list[int]) -> str:
    return b"".join(d.to_bytes(8, "little") for d in chunks).hex()


class _Fetcher:
    """Fetches objects into ``root`` with bounded memory; thread-safe counters."""

    def __init__(self, store: ObjectStore, root: Path, stripe: int, workers: int) -> None:
        self.store, self.root, self.stripe = store, root, stripe
        self.small = ThreadPoolExecutor(workers, thread_name_prefix="fastload-get")
        self.parts = ThreadPoolExecutor(_PARTS_IN_FLIGHT, thread_name_prefix="fastload-part")
        self.bytes_done = 0
        self.lock = threading.Lock()
        self.cancelled = False

    def _count(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n

    def _place(self, tmp: Path, final: Path, obj: ObjectInfo) -> None:
        os.utime(tmp, ns=(obj.mtime_ns, obj.mtime_ns))
        os.replace(tmp, final)

    def _stream(self, fd: int, obj: ObjectInfo, off: int, want: int) -> int:
        """Bytes ``[off, off + want)`` of ``obj`` written at ``off`` in ``fd`` piece by
        piece as they arrive (each written and digested while it is still in the CPU's
        cache; no buffer of the range's size); returns their fl64."""
        digest = _core.Fl64Stream()
        got = 0
        for piece in self.store.stream_range(obj.key, off, off + want, obj.etag):
            if self.cancelled:
                raise InterruptedError
            n = len(piece)
            done = os.pwrite(fd, piece, off + got)
            while done < n:
                done += os.pwrite(fd, memoryview(piece)[done:], off + got + done)
            digest.update(piece)
            got += n
        if got != want:
            raise self._eio(obj, f"short read at {off}: got {got} bytes of {want}")
        return digest.digest()

    def _eio(self, obj: ObjectInfo, what: str) -> OSError:
        return stage_error(errno.EIO, f"'{self.store.url.rstrip('/')}/{obj.key}': {what}", obj.key)

    def fetch_small(self, obj: ObjectInfo, final: Path) -> tuple[int, int, int, str]:
        """One GET, one write, one rename (an object over :data:`_WHOLE_UP_TO`: written
        as it streams in, as the parts of a big one are)."""
        if self.cancelled:
            raise InterruptedError
        if obj.size > _WHOLE_UP_TO:
            return self._fetch_streamed(obj, final)
        data = self.store.get(obj.key, obj.etag)
        if len(data) != obj.size:
            raise stage_error(
                errno.EIO,
                f"'{self.store.url.rstrip('/')}/{obj.key}': got {len(data)} bytes, "
                f"the listing said {obj.size}",
                obj.key,
            )
        tmp = final.with_name(f".{final.name}.fastload-tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _MODE)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        finally:
            os.close(fd)
        chunks = [_core.fl64(data[i : i + self.stripe]) for i in range(0, max(1, obj.size),
                                                                       self.stripe)]
        self._place(tmp, final, obj)
        self._count(obj.size)
        return (obj.size, obj.mtime_ns, _MODE, _digests(chunks))

    def _fetch_streamed(self, obj: ObjectInfo, final: Path) -> tuple[int, int, int, str]:
        tmp = final.with_name(f".{final.name}.fastload-tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _MODE)
        try:
            digest = self._stream(fd, obj, 0, obj.size)  # one chunk: size <= stripe
        finally:
            os.close(fd)
        self._place(tmp, final, obj)
        self._count(obj.size)
        return (obj.size, obj.mtime_ns, _MODE, _digests([digest]))

    def fetch_big(self, obj: ObjectInfo, final: Path) -> tuple[int, int, int, str]:
        """Ranged GETs of one part each, written at their offsets in a part file whose
        side record lists the finished parts (kept across a kill: a resume fetches only
        the others)."""
        part = final.with_name(f".{final.name}.fastload-part")
        record = final.with_name(f".{final.name}.fastload-part.json")
        n_parts = -(-obj.size // self.stripe)
        have = self._resume(part, record, obj)
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _MODE)
        try:
            os.ftruncate(fd, obj.size)
            lock = threading.Lock()

            def one(k: int) -> None:
                if self.cancelled:
                    raise InterruptedError
                off = k * self.stripe
                want = min(self.stripe, obj.size - off)
                digest = self._stream(fd, obj, off, want)
                with lock:
                    have[k] = digest
                    snapshot = {"identity": obj.identity, "size": obj.size,
                                "stripe": self.stripe, "parts": dict(have)}
                    tmp = record.with_name(record.name + ".tmp")
                    tmp.write_text(json.dumps(snapshot))
                    os.replace(tmp, record)
                self._count(want)

            futures = [self.parts.submit(one, k) for k in range(n_parts) if k not in have]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                wait(futures)  # none may still write to fd once it is closed
                raise
        finally:
            os.close(fd)
        self._place(part, final, obj)
        with contextlib.suppress(FileNotFoundError):
            record.unlink()
        return (obj.size, obj.mtime_ns, _MODE, _digests([have[k] for k in range(n_parts)]))

    def _resume(self, part: Path, record: Path, obj: ObjectInfo) -> dict[int, int]:
        """The parts of an interrupted fetch of the same object whose bytes, read back,
        still have their digests."""
        try:
            saved = json.loads(record.read_text())
            if (saved["identity"], saved["size"], saved["stripe"]) != (
                obj.identity, obj.size, self.stripe
            ):
                return {}
            parts = {int(k): int(v) for k, v in saved["parts"].items()}
            fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError, KeyError, TypeError):
            return {}
        good: dict[int, int] = {}
        try:
            for k, digest in parts.items():
                off = k * self.stripe
                n = min(self.stripe, obj.size - off)
                data = os.pread(fd, n, off)
                if len(data) == n and _core.fl64(data) == digest:
                    good[k] = digest
                    self._count(n)
        finally:
            os.close(fd)
        return good

    def close(self) -> None:
        self.small.shutdown(wait=True, cancel_futures=True)
        self.parts.shutdown(wait=True, cancel_futures=True)


def plan_objects(
    store: ObjectStore,
    objects: list[ObjectInfo],
    dst_abs: Path,
    *,
    single: bool,
    options: dict[str, Any],
    old: dict[str, Any] | None,
    engine: str,
    workers: int | None,
    stripe: int,
) -> TreePlan:
    """What staging ``objects`` into ``dst_abs`` has to do (under the node lock), in the
    tree pipeline's terms: ``files`` are the objects (keys relative to the prefix, or the
    destination's name for a single object), ``entries`` also their directories."""
    root = dst_abs.parent if single else dst_abs
    names = [dst_abs.name if single else o.key for o in objects]
    fp = fingerprint(store.url, objects, {**options, "chunk": stripe})
    files = [(n, FILE, o.size, (o.size + 511) // 512, _MODE, o.mtime_ns, "")
             for n, o in zip(names, objects, strict=True)]  # fmt: skip
    dirs = sorted({"/".join(n.split("/")[:k]) for n in names for k in range(1, n.count("/") + 1)})
    entries = [(d, DIR, 0, 0, 0o755, 0, "") for d in dirs] + files

    def proven(records: Records) -> Records:
        return prove(root, records, engine, workers, stripe)

    old, whole = reread(root, dst_abs, old, fp, proven)
    journal = Journal(dst_abs, stripe)
    if (
        whole
        and old is not None
        and old.get("complete")
        and old.get("fingerprint") == fp
        and os.path.lexists(dst_abs)
    ):
        held = {n: tuple(old["files"][n]) for n in names if n in old["files"]}
        return TreePlan(
            Path(), root, entries, files, [o.key for o in objects], fp, old,
            complete=True, done=held, todo=[], journal=journal,
        )  # fmt: skip

    known = known_records(journal, old, stripe, proven)
    old_ids: dict[str, str] = (old or {}).get("objects", {}) if old is not None else {}
    done: dict[str, tuple[int, int, int, str]] = {}
    todo: list[int] = []
    for i, (path, o) in enumerate(zip(names, objects, strict=True)):
        rec = known.get(path)
        same_id = path not in old_ids or old_ids[path] == o.identity
        if (
            rec is not None
            and same_id
            and rec[0] == o.size
            and rec[1] == o.mtime_ns
            and quick_same(root / path, o.size, o.mtime_ns)
        ):
            done[path] = rec
        else:
            todo.append(i)
    return TreePlan(
        Path(), root, entries, files, [o.key for o in objects], fp, old,
        complete=False, done=done, todo=todo, journal=journal,
    )  # fmt: skip


def stage_objects(
    store: ObjectStore,
    objects: list[ObjectInfo],
    dst_abs: Path,
    *,
    single: bool,
    options: dict[str, Any],
    old: dict[str, Any] | None,
    engine: str,
    on_progress: ProgressCallback | None,
    workers: int | None,
    stripe: int,
    sync: bool,
    t0: float,
) -> StageResult:
    """Stages ``objects`` (keys relative to the store's prefix) into ``dst_abs`` (a tree),
    or the one object into the file ``dst_abs`` when ``single``, under the node lock."""
    root = dst_abs.parent if single else dst_abs
    # A single object is stored under the destination's name.
    name_of: Callable[[ObjectInfo], str] = (
        (lambda o: dst_abs.name) if single else (lambda o: o.key)
    )
    total_bytes = sum(o.size for o in objects)
    plan = plan_objects(
        store, objects, dst_abs, single=single, options=options, old=old, engine=engine,
        workers=workers, stripe=stripe,
    )  # fmt: skip
    fp, old = plan.fingerprint, plan.old
    if plan.complete:
        assert old is not None
        make_durable(dst_abs, old, sync)
        return StageResult(dst_abs, len(objects), total_bytes, time.monotonic() - t0, "none", True)
    journal = plan.journal
    journal.durable = sync
    done = plan.done
    todo = [objects[i] for i in plan.todo]

    if old is not None and old.get("complete") and not single:
        wanted = {o.key for o in objects}
        for p in old.get("files", {}):
            if p not in wanted:
                with contextlib.suppress(OSError):
                    (root / p).unlink()

    check_space(dst_abs.parent, sum(o.size for o in todo), dst_abs)
    with named_os_errors("cannot create directory: "):
        root.mkdir(parents=True, exist_ok=True)
        for d in sorted({os.path.dirname(name_of(o)) for o in todo} - {""}):
            (root / d).mkdir(parents=True, exist_ok=True)

    journal.open(done)
    flusher = JournalFlusher(journal, str(root), JOURNAL_EVERY)
    fetcher = _Fetcher(store, root, stripe, max(1, workers or DEFAULT_OBJECTS_IN_FLIGHT))
    done_before = sum(r[0] for r in done.values())
    copied_files = copied_bytes = 0
    pending: dict[Future[tuple[int, int, int, str]], ObjectInfo] = {}
    finished_q: queue.SimpleQueue[Future[tuple[int, int, int, str]]] = queue.SimpleQueue()
    last = 0.0
    try:
        # Big objects first: their parts keep the part pool busy while small ones stream.
        for o in sorted(todo, key=lambda o: -o.size if o.size > stripe else 0):
            fn = fetcher.fetch_big if o.size > stripe else fetcher.fetch_small
            pool = fetcher.small
            fut = pool.submit(fn, o, root / name_of(o))
            pending[fut] = o
            fut.add_done_callback(finished_q.put)
        while pending:
            # Finished futures come through a queue: wait() on every pending future at
            # each wake-up would lock all of them each time (quadratic in the objects;
            # it was most of the CPU of a 2,000-object stage).
            finished = []
            with contextlib.suppress(queue.Empty):
                finished.append(finished_q.get(timeout=PROGRESS_EVERY))
                while True:
                    finished.append(finished_q.get_nowait())
            batch = []
            for f in finished:
                o = pending.pop(f)
                rec = f.result()
                path = name_of(o)
                done[path] = rec
                batch.append((path, *rec))
                copied_files += 1
                copied_bytes += o.size
            flusher.add(batch)
            now = time.monotonic()
            if on_progress is not None and now - last >= PROGRESS_EVERY:
                last = now
                on_progress(done_before + fetcher.bytes_done, total_bytes, len(done),
                            len(objects))
        flusher.close()
        if sync:
            _core.syncfs(str(root))
    except BaseException:
        fetcher.cancelled = True
        for f in pending:
            f.cancel()
        with contextlib.suppress(Exception):
            # Keep what finished before the error: a resume need not fetch it again.
            for f, o in pending.items():
                if f.done() and not f.cancelled() and f.exception() is None:
                    rec = f.result()
                    flusher.add([(name_of(o), *rec)])
        with contextlib.suppress(Exception):
            flusher.close()
        journal.close()
        fetcher.close()
        raise
    fetcher.close()
    journal.close()
    if on_progress is not None:
        on_progress(total_bytes, total_bytes, len(objects), len(objects))
    manifest = {
        "version": MANIFEST_VERSION,
        "complete": True,
        "source": store.url,
        "options": options,
        "fingerprint": fp,
        "kind": "file" if single else "tree",
        "chunk_size": stripe,
        "digest": "fl64",
        "boot_id": boot_id(),
        "durable": sync,
        "files_count": len(objects),
        "bytes": total_bytes,
        "engine": "objstore",
        "created": time.time(),
        "files": {p: list(done[p]) for p in sorted(done)},
        "objects": {name_of(o): o.identity for o in objects},
        "symlinks": {},
        "dirs": sorted({os.path.dirname(name_of(o)) for o in objects} - {""}),
    }
    write_json_atomic(state_dir(dst_abs) / "manifest.json", manifest)
    journal.remove()
    return StageResult(
        dst_abs,
        len(objects),
        total_bytes,
        time.monotonic() - t0,
        "objstore",
        False,
        copied_files,
        copied_bytes,
    )


def _known_kind(dst: Path, name: str, url: str, info: ObjectInfo) -> str | None:
    """What a complete earlier stage of this very object (same URL and ETag) into ``dst``
    found it to be: its compression (an archive), ``""`` (a file), or None (unknown)."""
    for candidate in (dst, dst / name):
        m = read_manifest(Path(os.path.abspath(candidate)))
        if m is None or not m.get("complete") or m.get("damaged") or m.get("source") != url:
            continue
        archive = m.get("archive")
        if archive is not None and archive.get("identity") == str(info.identity):
            return str(archive["compression"])
        if m.get("kind") == "file" and m.get("objects", {}).get(candidate.name) == info.identity:
            return ""
    return None


def stage_remote(
    url: str,
    dst: str | os.PathLike[str],
    *,
    include: list[str],
    exclude: list[str],
    engine: str,
    progress: Any,
    workers: int | None,
    stripe: int,
    unpack: Any,
    checksum: tuple[str, str] | None,
    sync: bool,
    check_source: bool,
    storage_options: Mapping[str, Any] | None,
    t0: float,
    fanout: Any = False,
) -> StageResult:
    """stage() of an object store URL: a prefix (a tree), an object, or an archive object
    extracted as it streams in; fanned out over the job's nodes with ``fanout``."""
    from .archive import detect_compression, extract, not_an_archive, suffix_kind
    from .job import progress_callback, say_waiting
    from .readers import RemoteArchive
    from .tree import check_file_checksum

    store = ObjectStore(url, storage_options)
    info: ObjectInfo | None = None
    objects: list[ObjectInfo] = []
    if url.endswith("/") or not store.prefix:
        objects = store.list(include, exclude)
    else:
        try:
            info = store.head()
        except FileNotFoundError:
            store = ObjectStore(url + "/", storage_options)
            objects = store.list(include, exclude)
            if not objects and not store.list():
                raise stage_error(
                    errno.ENOENT, f"'{url}': no such object, and no objects under it", url
                ) from None
    compression = None
    if info is not None:
        name = store.prefix.rsplit("/", 1)[-1]
        known = _known_kind(Path(os.fspath(dst)), name, store.url, info)
        if unpack is not False and known is not None:
            compression = known or None  # staged before: no GET to look at its head
        elif unpack is not False:
            head = bytearray(min(512, info.size))
            store.read_into("", 0, memoryview(head), info.etag)
            compression = detect_compression(bytes(head), name)
            if compression is None and suffix_kind(name):
                raise not_an_archive(url, name, bytes(head))
        if unpack in (True, "nested") and compression is None:
            raise stage_error(errno.EINVAL, f"'{url}' is not a tar archive", url)
        if (include or exclude) and compression is None:
            raise ValueError("include/exclude select inside a prefix or an archive")
        objects = [dataclasses.replace(info, key="")]
    elif checksum is not None:
        raise ValueError("checksum= applies to an object or an archive, not to a prefix")

    dst_path = Path(os.fspath(dst))
    single = info is not None and compression is None
    if single and dst_path.is_dir():
        dst_path = dst_path / store.prefix.rsplit("/", 1)[-1]
    dst_abs = Path(os.path.abspath(dst_path))
    if not single and dst_abs.exists() and not dst_abs.is_dir():
        raise stage_error(
            errno.ENOTDIR, f"destination '{dst_path}' exists and is not a directory", str(dst_path)
        )
    mkdir_parent(dst_abs.parent)
    options: dict[str, Any] = {"include": include, "exclude": exclude, "file": single}
    if compression is not None:
        options["unpack"] = "nested" if unpack == "nested" else True

    def locked(listing: Any = None, source: Any = None) -> StageResult:
        """The stage, under the node lock (held by the caller)."""
        old = previous_stage(dst_abs)
        if (
            not check_source
            and old is not None
            and old.get("complete")
            and not old.get("damaged")
            and old.get("source") == store.url
            and old.get("options") == options
            and os.path.lexists(dst_abs)
            and trusted(old)
        ):
            make_durable(dst_abs, old, sync)
            return StageResult(
                dst_abs, old["files_count"], old["bytes"], time.monotonic() - t0, "none", True
            )
        total = info.size if info is not None else sum(o.size for o in objects)
        verb = "extract" if compression is not None else "stage"
        label = store.prefix.rstrip("/").rsplit("/", 1)[-1] or store.bucket
        if compression is not None:
            assert info is not None
            return extract(
                source if source is not None else RemoteArchive(store, info), dst_abs,
                label=f"{verb} {label}", total=total, compression=compression,
                nested=options.get("unpack") == "nested", options=options, old=old,
                checksum=checksum, engine=engine, progress=progress, workers=workers,
                stripe=stripe, sync=sync, t0=t0,
            )  # fmt: skip
        on_progress, bar = progress_callback(progress, f"{verb} {label}", total, 0)
        try:
            result = stage_objects(
                store, listing if listing is not None else objects, dst_abs, single=single,
                options=options, old=old,
                engine=engine, on_progress=on_progress, workers=workers, stripe=stripe,
                sync=sync, t0=t0,
            )
        finally:
            if bar is not None:
                bar.close()
        if checksum is not None:
            check_file_checksum(result.path, store.url, checksum)
        return result

    def plain() -> StageResult:
        with node_lock(dst_abs, on_wait=say_waiting if progress else None):
            return locked()

    with named_os_errors():
        if fanout is not False:
            from .fanout import Request, stage_fanout

            if compression is not None:
                assert info is not None
                found = info
                req = Request(
                    store.url, dst_abs, False, options, compression, checksum, engine,
                    progress, workers, stripe, t0, locked, plain,
                    archive=lambda: RemoteArchive(store, found),
                )  # fmt: skip
            else:
                req = Request(
                    store.url, dst_abs, single, options, None, checksum, engine, progress,
                    workers, stripe, t0, locked, plain,
                    objects=(store, objects, single, plan_objects),
                )  # fmt: skip
            return stage_fanout(req, None if fanout is True else fanout)
        return plain()
