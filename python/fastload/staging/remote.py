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
import logging
import os
import queue
import threading
import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Any, Callable

from .. import _core
from .._util import folders_of, pwrite_all
from ..errors import stage_error
from ..sources import store_for
from ..sources.objlist import ObjectList
from ..sources.objstore import ObjectInfo, ObjectStore
from .columns import FileTable, Listing
from .destination import Destination, recorded_kind
from .job import DIR, FILE, PROGRESS_EVERY, ProgressCallback
from .request import Source, StageRequest
from .result import StageResult
from .state import JournalFlusher, Record, Records, mkdir_parent, previous_stage, trusted
from .tree import TreePlan, plan_against, run_plan

log = logging.getLogger(__name__)

# Whole-object GETs in flight (small objects: latency, not bandwidth, is the limit).
DEFAULT_OBJECTS_IN_FLIGHT = 64
# Ranged GETs of big objects in flight (each holds a piece of its part at a time).
_PARTS_IN_FLIGHT = 8
# Objects up to this size are fetched whole into one buffer; larger ones (and every part
# of a big one) are written piece by piece as they stream in.
_WHOLE_UP_TO = 1 << 20
_MODE = 0o644


def fingerprint(url: str, objects: ObjectList, options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([url, options, "columns"], sort_keys=True).encode())
    objects.digest_into(h)
    return h.hexdigest()


def _listing(dirs: list[str], objects: ObjectList, name: str | None) -> tuple[Listing, Listing]:
    """The folders, and the objects as files (under their keys, or the one object under
    ``name``), as listings' columns: the files' paths, sizes and times are the objects'
    own columns, shared, not copied."""
    blob, ends = bytearray(), array("q", [0])
    for p in dirs:
        blob += os.fsencode(p)
        ends.append(len(blob))
    nd, nf = len(dirs), len(objects)
    zero = array("q", [0]) * nd
    folders = Listing(bytes(blob), ends, array("B", [DIR]) * nd, zero, zero,
                      array("I", [0o755]) * nd, zero, {})  # fmt: skip
    if name is None:
        paths, offsets = bytes(objects.keys), objects.key_ends
    else:
        paths, offsets = os.fsencode(name), array("q", [0, len(os.fsencode(name))])
    blocks = array("q", ((s + 511) // 512 for s in objects.size))
    files = Listing(paths, offsets, array("B", [FILE]) * nf, objects.size, blocks,
                    array("I", [_MODE]) * nf, objects.mtime_ns, {})  # fmt: skip
    return folders, files


def _digests(chunks: list[int]) -> str:
    return b"".join(d.to_bytes(8, "little") for d in chunks).hex()


class _Fetcher:
    """Fetches objects into ``root`` with bounded memory; thread-safe counters: bytes
    done, and the seconds its threads waited for the store's bytes (``read_seconds``:
    GETs, their retries and backoff) and wrote them (``write_seconds``: the pwrites),
    each summed over the threads."""

    def __init__(self, store: ObjectStore, root: Path, stripe: int, workers: int) -> None:
        self.store, self.root, self.stripe = store, root, stripe
        self.small = ThreadPoolExecutor(workers, thread_name_prefix="fastload-get")
        self.parts = ThreadPoolExecutor(_PARTS_IN_FLIGHT, thread_name_prefix="fastload-part")
        self.bytes_done = 0
        self.read_seconds = 0.0
        self.write_seconds = 0.0
        self.lock = threading.Lock()
        self.cancelled = False

    def _count(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n

    def _times(self, read: float, write: float) -> None:
        with self.lock:
            self.read_seconds += read
            self.write_seconds += write

    def _place(self, tmp: Path, final: Path, obj: ObjectInfo) -> None:
        os.utime(tmp, ns=(obj.mtime_ns, obj.mtime_ns))
        os.replace(tmp, final)

    def _eio(self, obj: ObjectInfo, what: str) -> OSError:
        return stage_error(errno.EIO, f"'{self.store.url.rstrip('/')}/{obj.key}': {what}", obj.key)

    def fetch_small(self, obj: ObjectInfo, final: Path) -> Record:
        """One GET, one write, one rename (an object over :data:`_WHOLE_UP_TO`: written
        as it streams in, as the parts of a big one are; an empty one: no GET)."""
        if self.cancelled:
            raise InterruptedError
        if obj.size > _WHOLE_UP_TO:
            return self._fetch_parts(obj, final, resumable=False)
        t0 = time.monotonic()
        data = self.store.get(obj.key, obj.etag) if obj.size else memoryview(b"")
        t1 = time.monotonic()
        if len(data) != obj.size:
            raise self._eio(obj, f"got {len(data)} bytes, the listing said {obj.size}")
        tmp = final.with_name(f".{final.name}.fastload-tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _MODE)
        try:
            pwrite_all(fd, data, 0, tmp)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk, say: no temporary is left behind
            raise
        finally:
            os.close(fd)
        self._times(t1 - t0, time.monotonic() - t1)
        chunks = [_core.fl64(data[i : i + self.stripe]) for i in range(0, max(1, obj.size),
                                                                       self.stripe)]
        self._place(tmp, final, obj)
        self._count(obj.size)
        return Record(obj.size, obj.mtime_ns, _MODE, _digests(chunks))

    def fetch_big(self, obj: ObjectInfo, final: Path) -> Record:
        return self._fetch_parts(obj, final, resumable=True)

    def _fetch_parts(self, obj: ObjectInfo, final: Path, resumable: bool) -> Record:
        """Ranged GETs of one part each (the store's ``fetch_parts``), the pieces written
        at their offsets and digested as they arrive (while still in the CPU's cache; no
        buffer of a part's size). A big object's part file has a side record of its
        finished parts, kept across a kill: a resume fetches only the others."""
        stripe = self.stripe
        n_parts = max(1, -(-obj.size // stripe))
        record: Path | None = None
        have: dict[int, int] = {}
        if resumable:
            tmp = final.with_name(f".{final.name}.fastload-part")
            record = final.with_name(f".{final.name}.fastload-part.json")
            have = self._resume(tmp, record, obj)
            flags = os.O_RDWR | os.O_CREAT
        else:
            tmp = final.with_name(f".{final.name}.fastload-tmp")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        streams: dict[int, Any] = {}
        got: dict[int, int] = {}
        # Per thread, of the part it fetches (its GET, then on_get, on that thread): the
        # seconds in the part's write callbacks (pwrite, digesting), and in its pwrites.
        inside: dict[int, list[float]] = {}
        lock = threading.Lock()
        fd = os.open(tmp, flags | os.O_CLOEXEC, _MODE)

        def write(off: int, piece: Any) -> None:
            if self.cancelled:
                raise InterruptedError
            t0 = time.monotonic()
            k = off // stripe  # a part's pieces come in order, on one thread
            pwrite_all(fd, piece, off, tmp)
            t1 = time.monotonic()
            if k not in streams:
                streams[k] = _core.Fl64Stream()
            streams[k].update(piece)
            got[k] = got.get(k, 0) + len(piece)
            spent = inside.setdefault(threading.get_ident(), [0.0, 0.0])
            spent[0] += time.monotonic() - t0
            spent[1] += t1 - t0

        def on_get(t0: float) -> None:
            # The part's GET less its callbacks: the wait for the store's bytes.
            callbacks, written = inside.pop(threading.get_ident(), (0.0, 0.0))
            self._times(time.monotonic() - t0 - callbacks, written)

        def on_part(k: int) -> None:
            want = min(stripe, obj.size - k * stripe)
            if got.get(k, 0) != want:
                raise self._eio(obj, f"short read at {k * stripe}: got {got.get(k, 0)} "
                                f"bytes of {want}")  # fmt: skip
            digest = streams.pop(k).digest() if k in streams else _core.fl64(b"")
            with lock:
                have[k] = digest
                if record is not None:
                    snapshot = {"identity": obj.identity, "size": obj.size,
                                "stripe": stripe, "parts": dict(have)}  # fmt: skip
                    side = record.with_name(record.name + ".tmp")
                    side.write_text(json.dumps(snapshot))
                    os.replace(side, record)
            self._count(want)

        try:
            if resumable:
                os.ftruncate(fd, obj.size)
            self.store.fetch_parts(
                obj.key, obj.etag, obj.size, write, part_size=stripe, skip=have,
                on_part=on_part, on_get=on_get, pool=self.parts if resumable else None,
            )  # fmt: skip
        except BaseException:
            if not resumable:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            raise
        finally:
            os.close(fd)
        self._place(tmp, final, obj)
        if record is not None:
            with contextlib.suppress(FileNotFoundError):
                record.unlink()
        return Record(obj.size, obj.mtime_ns, _MODE, _digests([have[k] for k in range(n_parts)]))

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


class ObjectPrefix:
    """Every object under a prefix of a store (a tree, keys split on ``/``), or one
    object (``single``: stored under the destination's name) (:class:`Source`). The
    objects are held in columns (:class:`ObjectList`); an ObjectInfo is made only for an
    object being fetched."""

    def __init__(
        self, store: ObjectStore, objects: ObjectList | None, req: StageRequest, *,
        single: bool, dirs: list[str] | None = None,
    ) -> None:  # fmt: skip
        # ``objects`` None: listed when first needed (fan-out: node 0 alone lists).
        self.listed = objects is not None
        self.listing_seconds = 0.0
        self.store, self.objects, self.single = store, objects or ObjectList(), single
        self.dirs = dirs or []  # folders that markers name (empty ones too)
        self.name = store.url
        self.label = store.prefix.rstrip("/").rsplit("/", 1)[-1] or store.bucket
        self.options: dict[str, Any] = {**req.selection(), "file": single}

    def listing(self, req: StageRequest) -> tuple[ObjectList, list[str]]:
        """The objects and the folders markers name (listed now if they were not)."""
        if not self.listed:
            t0 = time.monotonic()
            self.objects, self.dirs = _listed(self.store, self.store.url, req)
            self.listed = True
            self.listing_seconds = time.monotonic() - t0
        return self.objects, self.dirs

    def _name(self, dest: Destination, i: int) -> str:
        return dest.path.name if self.single else self.objects.key_str(i)

    def plan(self, req: StageRequest, dest: Destination, listing: Any = None) -> TreePlan:
        """What staging the objects into ``dest`` has to do (under its lock), in the tree
        pipeline's terms: ``files`` are the objects (keys relative to the prefix, or the
        destination's name for a single object), ``entries`` also their directories."""
        if listing is not None:
            # fan-out's node 0's: the units are numbered in it
            self.objects, self.dirs = listing
            self.listed = True
        elif not self.listed:
            self.listing(req)
            dest.add_time("listing", self.listing_seconds)
        with dest.timed("planning"):
            return self._plan(req, dest)

    def _plan(self, req: StageRequest, dest: Destination) -> TreePlan:
        objs = self.objects
        shape = {**self.options, "chunk": req.stripe}
        if self.dirs:
            shape["dirs"] = self.dirs  # an added or removed empty folder is a change
        fp = fingerprint(self.name, objs, shape)
        names: set[bytes] = {os.fsencode(d) for d in self.dirs}
        if not self.single:
            for key in chain(list(names), objs.key_bytes()):  # a key at a time
                names.update(folders_of(key))
        dirs = sorted(map(os.fsdecode, names))
        del names
        folders, files = _listing(dirs, objs, dest.path.name if self.single else None)
        return plan_against(dest, folders, fp, self._same(dest), files=files)

    def _same(self, dest: Destination) -> Callable[[int, Record], bool]:
        """Whether object ``i`` is the one an earlier stage recorded under its name (its
        identity, the tag of its row in the earlier table; any where none is recorded:
        a record of the interrupted run's journal)."""
        objs, old = self.objects, dest.old or {}
        legacy: dict[str, str] | None = old.get("objects")  # a manifest of an older version
        if legacy is not None:
            return lambda i, rec: legacy.get(self._name(dest, i)) in (
                None, os.fsdecode(objs.identity(i)))  # fmt: skip
        table: FileTable | None = old.get("files")
        if table is None or table.tags is None:
            return lambda i, rec: True
        if self.single:
            rows = array("q", [table.find(dest.path.name)])
        else:
            rows = table.matches(objs.key_bytes())

        def same(i: int, rec: Record) -> bool:
            r = rows[i]
            return r < 0 or table.tag(r) in (None, b"", objs.tag(i))

        return same

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        return run_plan(self, req, dest, self.plan(req, dest, listing))

    def transfer(
        self,
        req: StageRequest,
        dest: Destination,
        plan: TreePlan,
        done: Records,
        flusher: JournalFlusher,
        on_progress: ProgressCallback | None,
    ) -> tuple[str, int, int]:
        objs = self.objects
        total_bytes, nfiles = plan.total_bytes, len(plan.files)
        workers = max(1, req.workers or DEFAULT_OBJECTS_IN_FLIGHT)
        fetcher = _Fetcher(self.store, dest.root, req.stripe, workers)
        done_before = plan.done.total_bytes
        copied_files = copied_bytes = 0
        pending: dict[Future[Record], int] = {}
        finished_q: queue.SimpleQueue[Future[Record]] = queue.SimpleQueue()
        last = 0.0
        # Big objects first: their parts keep the part pool busy while small ones stream.
        # Objects are submitted a window at a time: a future and an ObjectInfo exist only
        # for the objects in flight, not for every object to fetch.
        big = sorted((i for i in plan.todo if objs.size[i] > req.stripe),
                     key=lambda i: -objs.size[i])  # fmt: skip
        order = chain(big, (i for i in plan.todo if objs.size[i] <= req.stripe))
        window = 4 * workers

        def submit_more() -> None:
            while len(pending) < window:
                i = next(order, None)
                if i is None:
                    return
                o = objs[i]
                fn = fetcher.fetch_big if o.size > req.stripe else fetcher.fetch_small
                fut = fetcher.small.submit(fn, o, dest.root / self._name(dest, i))
                pending[fut] = i
                fut.add_done_callback(finished_q.put)

        try:
            submit_more()
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
                    i = pending.pop(f)
                    rec = f.result()
                    plan.done.set(i, rec)
                    batch.append((self._name(dest, i), *rec))
                    copied_files += 1
                    copied_bytes += objs.size[i]
                flusher.add(batch)
                submit_more()
                now = time.monotonic()
                if on_progress is not None and now - last >= PROGRESS_EVERY:
                    last = now
                    on_progress(done_before + fetcher.bytes_done, total_bytes, len(plan.done),
                                nfiles)  # fmt: skip
        except BaseException:
            fetcher.cancelled = True
            for f in pending:
                f.cancel()
            with contextlib.suppress(Exception):
                # Keep what finished before the error: a resume need not fetch it again.
                for f, i in pending.items():
                    if f.done() and not f.cancelled() and f.exception() is None:
                        flusher.add([(self._name(dest, i), *f.result())])
            fetcher.close()
            raise
        fetcher.close()
        dest.add_time("reading", fetcher.read_seconds)
        dest.add_time("writing", fetcher.write_seconds)
        if on_progress is not None:
            on_progress(total_bytes, total_bytes, nfiles, nfiles)
        return "objstore", copied_files, copied_bytes

    def finish(self, plan: TreePlan, dest: Destination) -> None:
        pass

    def extra(self, plan: TreePlan) -> dict[str, Any]:
        """Each object's identity, the tag of its row in the manifest's table (an MD5's
        ETag: its 16 bytes)."""
        objs = self.objects
        return {"tags": (plan.files, map(objs.tag, range(len(objs))))}


def open_remote(
    url: str, dst: str | os.PathLike[str], req: StageRequest
) -> tuple[Source, Destination]:
    """The source and destination of a stage() of an object store URL: a prefix (a
    tree), an object, or an archive object extracted as it streams in
    """
    from .archive import Archive, detect_compression, not_an_archive, suffix_kind
    from .readers import RemoteArchive

    store: ObjectStore = store_for(url, req.storage_options)
    info: ObjectInfo | None = None
    objects = ObjectList()
    dirs: list[str] = []
    listed = time.monotonic()
    if req.fanout and (url.endswith("/") or not store.prefix):
        # A prefix fanned out: node 0 lists it, once, and sends the others its listing.
        if req.checksum is not None:
            raise ValueError("checksum= applies to an object or an archive, not to a prefix")
        return _destination(dst, req, ObjectPrefix(store, None, req, single=False))
    try:
        if url.endswith("/") or not store.prefix:
            objects, dirs = _listed(store, url, req)
        else:
            try:
                info = store.head()
            except FileNotFoundError:
                store = store_for(url + "/", req.storage_options)
                objects, dirs = _listed(store, url, req)
    except OSError as e:
        if e.errno != errno.EHOSTUNREACH or req.check_source == "strict":
            raise
        held = HeldCopy.find(url, Path(os.fspath(dst)), req, e)
        if held is None:
            raise
        return held
    if info is None:
        if req.checksum is not None:
            raise ValueError("checksum= applies to an object or an archive, not to a prefix")
        listed = time.monotonic() - listed
        source, dest = _destination(
            dst, req, ObjectPrefix(store, objects, req, single=False, dirs=dirs)
        )
        dest.add_time("listing", listed)
        return source, dest
    name = store.prefix.rsplit("/", 1)[-1]
    compression = None
    known = recorded_kind(Path(os.fspath(dst)), name, store.url, info.identity)
    if req.unpack is not False and known is not None:
        compression = known or None  # staged before: no GET to look at its head
    elif req.unpack is not False:
        head = bytearray(min(512, info.size))
        store.read_into("", 0, memoryview(head), info.etag)
        compression = detect_compression(bytes(head), name)
        if compression is None and suffix_kind(name):
            raise not_an_archive(url, name, bytes(head))
    if req.unpack in (True, "nested") and compression is None:
        raise stage_error(errno.EINVAL, f"'{url}' is not a tar archive", url)
    if (req.include or req.exclude) and compression is None:
        raise ValueError("include/exclude select inside a prefix or an archive")
    objects = ObjectList.of([dataclasses.replace(info, key="")])
    if compression is None:
        return _destination(dst, req, ObjectPrefix(store, objects, req, single=True))
    options = {**req.selection(), "file": False, "unpack": req.unpack_option}
    return _destination(dst, req, Archive(RemoteArchive(store, info), compression, options))


def _listed(store: ObjectStore, url: str, req: StageRequest) -> tuple[ObjectList, list[str]]:
    """The objects and marked folders under ``store``'s prefix (``url`` as given); none
    at all is an error naming the URL, unless ``allow_empty``."""
    objects, dirs = store.list_tree(list(req.include), list(req.exclude))
    if not objects and not dirs and not req.allow_empty:
        if (req.include or req.exclude) and len(store.list_columns()):
            raise req.nothing_selected(store.url)
        what = "no objects under it" if store.url == url else "no such object, and none under it"
        raise stage_error(
            errno.ENOENT,
            f"'{url}': {what} at {store.endpoint} (check the bucket and the prefix: keys "
            "are case-sensitive); pass allow_empty=True (--allow-empty) to stage nothing",
            url,
        )
    return objects, dirs


def _destination(
    dst: str | os.PathLike[str], req: StageRequest, source: Any
) -> tuple[Source, Destination]:
    dst_path = Path(os.fspath(dst))
    single = isinstance(source, ObjectPrefix) and source.single
    if single and dst_path.is_dir():
        dst_path = dst_path / source.store.prefix.rsplit("/", 1)[-1]
    dest = Destination(Path(os.path.abspath(dst_path)), req, single=single)
    if not single and dest.path.exists() and not dest.path.is_dir():
        raise stage_error(
            errno.ENOTDIR, f"destination '{dst_path}' exists and is not a directory", str(dst_path)
        )
    mkdir_parent(dest.path.parent)
    return source, dest


class HeldCopy:
    """A complete copy of an object-store source whose store cannot be reached now: used
    as it is, with a one-line warning (``check_source="strict"`` raises instead)."""

    def __init__(self, manifest: dict[str, Any], error: OSError) -> None:
        self.name: str = manifest["source"]
        self.options: dict[str, Any] = manifest["options"]
        self.label = self.name
        self._error = error

    @classmethod
    def find(
        cls, url: str, dst: Path, req: StageRequest, error: OSError
    ) -> tuple[Source, Destination] | None:
        """The source and destination of a complete, trusted earlier stage of ``url``
        into ``dst`` (or, for one object, ``dst/NAME``), if there is one."""
        name = url.rstrip("/").rsplit("/", 1)[-1]
        for candidate in (dst, dst / name):
            path = Path(os.path.abspath(candidate))
            m = previous_stage(path)
            if m is None or not cls._usable(m, url):
                continue
            return cls(m, error), Destination(path, req, single=m.get("kind") == "file")
        return None

    @staticmethod
    def _usable(m: dict[str, Any], url: str) -> bool:
        return bool(
            m.get("complete")
            and not m.get("damaged")
            and m.get("source") in (url, url.rstrip("/") + "/", url.rstrip("/"))
            and trusted(m)
        )

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        old = dest.old
        if old is None or not self._usable(old, self.name) or not os.path.lexists(dest.path):
            raise self._error
        log.warning(
            "fastload: %s; using the complete copy in '%s' staged before, unchecked "
            "(check_source='strict' or --strict-source makes this an error)",
            self._error.args[-1] if self._error.args else self._error, dest.path,
        )
        return dest.skipped(old["files_count"], old["bytes"])
