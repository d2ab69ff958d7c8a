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

The fetching itself (small objects' GETs on an event loop, written natively in
batches; the parts of big ones) is in :mod:`.fetch`; the client side (listing, ranged
reads, errors) in sources/objstore.py.
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
from itertools import chain, repeat
from pathlib import Path
from typing import Any, Callable

from .._util import folders_of, usable_cores
from ..errors import stage_error
from ..sources import store_for
from ..sources.objlist import ObjectList
from ..sources.objstore import ObjectInfo, ObjectStore
from .columns import FileTable, Listing
from .destination import Destination, recorded_kind
from .fetch import MODE, WHOLE_UP_TO, WRITERS, Fetcher, SmallGets, marked, write_bodies
from .job import DIR, FILE, PROGRESS_EVERY, ProgressCallback, digest_local
from .request import Source, StageRequest
from .result import StageResult
from .state import JournalFlusher, Record, Records, mkdir_parent, previous_stage, trusted
from .tree import TreePlan, plan_against, run_plan

log = logging.getLogger(__name__)

# Whole-object GETs in flight (small objects: latency, not bandwidth, is the limit).
DEFAULT_OBJECTS_IN_FLIGHT = 64


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
                    array("I", [MODE]) * nf, objects.mtime_ns, {})  # fmt: skip
    return folders, files


class ObjectPrefix:
    """Every object under a prefix of a store (a tree, keys split on ``/``), or one
    object (``single``: stored under the destination's name) (:class:`Source`). The
    objects are held in columns (:class:`ObjectList`); an ObjectInfo is made only for an
    object being fetched."""

    lands_once = True  # each object lands once, whole, at its final name (Schedule.opened)

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
        plan = plan_against(dest, folders, fp, self._same(dest), files=files)
        journal = dest.journal
        if not plan.complete and plan.todo and journal.found and journal.same_boot:
            self._found_whole(req, dest, plan)
        return plan

    def _found_whole(self, req: StageRequest, dest: Destination, plan: TreePlan) -> None:
        """Files a killed run put in place but had not journalled yet, taken as done: each
        at its name with the listed size and time and the mark of this very object
        (fetch.py's ``MARK``, recorded before it was in place); as long as the machine
        did not reboot since. Their digests are read back locally."""
        objs, files, root = self.objects, plan.files, dest.root
        paths, ends = files.paths, files.offsets
        whole = [i for i in plan.todo
                 if marked(root / os.fsdecode(paths[ends[i] : ends[i + 1]]), objs.size[i],
                           objs.mtime_ns[i], objs.tag(i))]  # fmt: skip
        if not whole:
            return
        got = digest_local(root, [files[i] for i in whole], req.engine, req.workers, req.stripe)
        for i in whole:
            rec = got.get(files[i].path)
            if rec is not None:
                plan.done.set(i, rec)
        plan.todo = array("q", (i for i in plan.todo if not plan.done.is_done(i)))

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
        fetcher = Fetcher(self.store, dest.root, req.stripe, workers)
        done_before = plan.done.total_bytes
        copied = [0, 0]  # files, bytes
        pending: dict[Future[Record], int] = {}
        # Finished futures (objects over WHOLE_UP_TO) and batches of small objects' bodies
        # come through one queue: wait() on every pending future at each wake-up would
        # lock all of them each time (quadratic in the objects).
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Big objects first, on the pool: their parts keep the part pool busy while small
        # ones stream. They are submitted a window at a time: a future and an ObjectInfo
        # exist only for the objects in flight, not for every object to fetch.
        big = sorted((i for i in plan.todo if objs.size[i] > WHOLE_UP_TO),
                     key=lambda i: -objs.size[i])  # fmt: skip
        order = iter(big)
        window = 4 * workers
        small = SmallGets(self.store, objs, (i for i in plan.todo if objs.size[i] <= WHOLE_UP_TO),
                          workers, events)  # fmt: skip
        # Their bodies are written by a few threads (a batch per native call, the GIL
        # released): the kernel's work of creating and writing files, not one thread's.
        writers = ThreadPoolExecutor(min(WRITERS, usable_cores()),
                                     thread_name_prefix="fastload-write")  # fmt: skip
        running = [True, 0]  # the small objects' GETs (until their "end"), batches writing
        last = 0.0

        def submit_more() -> None:
            while len(pending) < window:
                i = next(order, None)
                if i is None:
                    return
                o = objs[i]
                fn = fetcher.fetch_big if o.size > req.stripe else fetcher.fetch_mid
                fut = fetcher.small.submit(fn, o, dest.root / self._name(dest, i))
                pending[fut] = i
                fut.add_done_callback(events.put)

        def record(i: int, rec: Record, into: list[tuple[Any, ...]]) -> None:
            plan.done.set(i, rec)
            into.append((self._name(dest, i), *rec))
            copied[0] += 1
            copied[1] += objs.size[i]

        paths, ends = plan.files.paths, plan.files.offsets

        def names(rows: list[int]) -> list[bytes]:
            """The files' names of ``rows``, encoded (the plan's paths: the keys, or the
            one object's name)."""
            return [paths[ends[i] : ends[i + 1]] for i in rows]

        def write(bodies: list[tuple[int, Any]]) -> list[bytes | OSError]:
            """The bodies of a batch to their files, natively, one call (on a writer)."""
            t0 = time.monotonic()
            rows = [i for i, _ in bodies]
            got = write_bodies(dest.root, list(zip(names(rows), [b for _, b in bodies],
                                                   map(objs.mtime_ns.__getitem__, rows),
                                                   map(objs.tag, rows), strict=True)),
                               req.stripe)  # fmt: skip
            fetcher.add_times(0.0, time.monotonic() - t0)
            with unjournalled_lock:  # on this thread: no interrupt comes between
                unjournalled[id(bodies)] = (bodies, got)
            small.taken(len(bodies))
            return got

        def to_write(bodies: list[tuple[int, Any]]) -> None:
            running[1] += 1
            fut = writers.submit(write, bodies)
            fut.add_done_callback(lambda f: events.put(("written", bodies, f)))

        def written(bodies: list[tuple[int, Any]], got: list[bytes | OSError],
                    into: list[tuple[Any, ...]]) -> None:  # fmt: skip
            """The records of a batch written into ``into`` (each file as listed: the
            object's size and time, MODE; its raw digests), in a few calls for the whole
            batch; the first failure is raised after the others' records."""
            failed: OSError | None = None
            rows: list[int] = []
            digests: list[bytes] = []
            for (i, _), res in zip(bodies, got, strict=True):
                if isinstance(res, OSError):
                    failed = failed or res
                else:
                    rows.append(i)
                    digests.append(res)
            plan.done.set_listed(rows, digests)
            sizes = list(map(objs.size.__getitem__, rows))
            into.extend(zip(names(rows), sizes, map(objs.mtime_ns.__getitem__, rows),
                            repeat(MODE), digests))  # fmt: skip
            n = sum(sizes)
            copied[0] += len(rows)
            copied[1] += n
            fetcher.count(n)
            if failed is not None:
                raise failed

        # Batches written and not yet journalled, put here by the writer itself: a Ctrl-C
        # can come between any two steps of this thread (an event taken off the queue and
        # not yet handled, say), never between a write and this record of it. Whatever is
        # here when the stage stops is journalled: a resume need not fetch it again.
        unjournalled: dict[int, tuple[list[tuple[int, Any]], list[bytes | OSError]]] = {}
        unjournalled_lock = threading.Lock()
        try:
            submit_more()
            small.start()
            while pending or running[0] or running[1]:
                got = []
                with contextlib.suppress(queue.Empty):
                    got.append(events.get(timeout=PROGRESS_EVERY))
                    while True:
                        got.append(events.get_nowait())
                batch: list[tuple[Any, ...]] = []
                failed: BaseException | None = None
                try:
                    for ev in got:
                        try:
                            if isinstance(ev, Future):
                                record(pending.pop(ev), ev.result(), batch)
                            elif ev[0] == "bodies":
                                if failed is None:
                                    to_write(ev[1])
                            elif ev[0] == "written":
                                running[1] -= 1
                                written(ev[1], ev[2].result(), batch)
                                with unjournalled_lock:
                                    del unjournalled[id(ev[1])]
                            elif ev[0] == "error":
                                raise ev[1]
                            else:
                                running[0] = False
                        except Exception as e:
                            # The other events taken with it are handled first: what was
                            # written is journalled, not fetched again by a resume.
                            failed = failed or e
                finally:
                    flusher.add(batch)  # an error's batch too: a resume need not fetch it
                if failed is not None:
                    raise failed
                submit_more()
                now = time.monotonic()
                if on_progress is not None and now - last >= PROGRESS_EVERY:
                    last = now
                    on_progress(done_before + fetcher.bytes_done, total_bytes, len(plan.done),
                                nfiles)  # fmt: skip
        except BaseException:
            fetcher.cancelled = True
            small.cancel()
            writers.shutdown(wait=True, cancel_futures=True)
            for bodies, results in unjournalled.values():  # (twice is harmless)
                done_now: list[tuple[Any, ...]] = []
                with contextlib.suppress(OSError):
                    written(bodies, results, done_now)
                flusher.add(done_now)
            for f in pending:
                f.cancel()
            with contextlib.suppress(Exception):
                # Keep what finished before the error: a resume need not fetch it again.
                for f, i in pending.items():
                    if f.done() and not f.cancelled() and f.exception() is None:
                        flusher.add([(self._name(dest, i), *f.result())])
            fetcher.close()
            raise
        small.cancel()
        writers.shutdown(wait=True)
        fetcher.close()
        dest.add_time("reading", fetcher.read_seconds + small.read_seconds)
        dest.add_time("writing", fetcher.write_seconds)
        if on_progress is not None:
            on_progress(total_bytes, total_bytes, nfiles, nfiles)
        return "objstore", copied[0], copied[1]

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
