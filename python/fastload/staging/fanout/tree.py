"""Fan-out of a tree (a directory, one file, or a prefix of objects): the units the
nodes lack, dealt by bytes; each leader's sender reads its units (from the source, or
from its own disk when it holds them) and its writer writes what it lacks, journalled,
for the tree pipeline to finish."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ... import _core
from ..._util import parse_size, pwrite_all
from ...errors import SourceChangedError, StageError, stage_error
from ..destination import Destination
from ..job import progress_callback
from ..remote import ObjectPrefix
from ..result import StageResult
from ..state import JournalFlusher, Record
from ..tree import TreePlan, make_dirs, run_plan, space_needed
from .common import (
    ROUND,
    SUBREAD,
    U64,
    WRITERS,
    Bits,
    Sender,
    digest,
    read_range,
)
from .exchange import Exchange, fanout_error


def _read_file(
    path: Path, e: tuple[Any, ...], off: int, view: memoryview, pool: ThreadPoolExecutor
) -> None:
    """``view`` from ``path`` at ``off``, the file still of the listed size and time."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as err:
        raise stage_error(
            err.errno or errno.EIO, f"cannot open '{path}': {err.strerror}", str(path)
        ) from None
    try:
        got = read_range(fd, view, off, pool)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if got != view.nbytes or (st.st_size, st.st_mtime_ns) != (e[2], e[5]):
        raise SourceChangedError(
            errno.EIO,
            f"source file changed: '{path}' was modified while it was being staged; "
            "stage again to pick up the new content",
        )


def _read_source(
    source: Any, plan: TreePlan, f: int, off: int, view: memoryview, pool: ThreadPoolExecutor
) -> None:
    """``view`` from the source's file ``f`` of ``plan`` at ``off``: positional reads of a
    local file, or ranged GETs (If-Match the listed ETag, several in flight for a big
    unit) of an object. (``source`` may be unpack="nested"'s tree without its zips:
    zipnested.py's wrapper, ``tree`` the source it wraps.)"""
    source = getattr(source, "tree", source)
    if not isinstance(source, ObjectPrefix):
        e = plan.files[f]
        _read_file(source.source_path(e), e, off, view, pool)
        return
    o = source.objects[f]
    n = view.nbytes
    got = [0]

    def write(at: int, piece: Any) -> None:
        view[at - off : at - off + len(piece)] = piece
        got[0] += len(piece)  # parts on several threads: += on a list item holds the GIL

    source.store.fetch_parts(
        o.key, o.etag, off + n, write, start=off, part_size=4 * SUBREAD, pool=pool
    )
    if got[0] != n:
        raise SourceChangedError(
            errno.EIO,
            f"source changed: '{source.store.url.rstrip('/')}/{o.key}' is shorter than "
            "listed; stage again to pick up the new content",
        )


@dataclasses.dataclass
class _Units:
    """What the nodes lack, cut into units, in columns: ``file[u]`` (index into the
    plan's files), ``off[u]``, ``size[u]``; ``sender[u]``: the node that reads it,
    ``local[u]``: from its own destination (else from the store); ``rounds[k]``: node
    k's units, round by round."""

    file: array[int]
    off: array[int]
    size: array[int]
    sender: array[int]
    local: bytearray
    rounds: list[list[array[int]]]


def _deal(
    sizes: Sequence[int],
    need: list[Bits],
    have: list[Bits],
    stripe: int,
    round_bytes: int,
) -> _Units:
    """The units and who sends each: the same on every node (a pure function of the
    plan every node shares)."""
    nodes = len(need)
    u = _Units(array("q"), array("q"), array("q"), array("q"), bytearray(),
               [[] for _ in range(nodes)])  # fmt: skip
    load = [0] * nodes
    store_units = array("q")
    for i in Bits.union(need, len(sizes)):
        size = sizes[i]
        holders = [k for k in range(nodes) if i in have[k]]
        for off in range(0, size, stripe):
            idx = len(u.file)
            u.file.append(i)
            u.off.append(off)
            u.size.append(min(stripe, size - off))
            if holders:
                k = min(holders, key=lambda h: (load[h], h))
                load[k] += u.size[idx]
                u.sender.append(k)
                u.local.append(1)
            else:
                u.sender.append(-1)
                u.local.append(0)
                store_units.append(idx)
    # The store's units in contiguous runs, one per node, balanced by bytes (including
    # what each node already sends from its disk).
    total = sum(u.size[j] for j in store_units) + sum(load)
    target = total / nodes
    k = 0
    for j in store_units:
        while k < nodes - 1 and load[k] + u.size[j] / 2 > target:
            k += 1
        u.sender[j] = k
        load[k] += u.size[j]
    del store_units
    for k in range(nodes):
        batch = array("q")
        nbytes = 0
        for j in (j for j in range(len(u.file)) if u.sender[j] == k):
            if batch and nbytes + u.size[j] > round_bytes:
                u.rounds[k].append(batch)
                batch, nbytes = array("q"), 0
            batch.append(j)
            nbytes += u.size[j]
        if batch:
            u.rounds[k].append(batch)
    return u


class _TreeSender(Sender):
    """Reads this node's units, a round ahead of the exchange: payload = the units'
    digests (8 bytes each), then their bytes."""

    def __init__(self, plan: TreePlan, units: _Units, node: int, source: Any, root: Path):
        super().__init__()
        self._plan, self._u, self._node = plan, units, node
        self._source, self._root = source, root
        self._next = 0
        self._fill()

    def _fill(self) -> None:
        rounds = self._u.rounds[self._node]
        while len(self._ahead) < 2 and self._next < len(rounds):
            self._ahead.append(self._pool.submit(self._build, rounds[self._next]))
            self._next += 1

    def _read_unit(self, j: int, view: memoryview) -> int:
        u, plan = self._u, self._plan
        f = u.file[j]
        if u.local[j]:
            _read_file(self._root / plan.files[f].path, plan.files[f], u.off[j], view, self._sub)
        else:
            _read_source(self._source, plan, f, u.off[j], view, self._sub)
        return digest(view)

    def _build(self, batch: Sequence[int]) -> bytearray:
        u = self._u
        head = 8 * len(batch)
        buf = bytearray(head + sum(u.size[j] for j in batch))
        view = memoryview(buf)
        pos = head
        futures = []
        for j in batch:
            futures.append(self._pool_small(j, view[pos : pos + u.size[j]]))
            pos += u.size[j]
        for i, (j, fut) in enumerate(zip(batch, futures, strict=True)):
            U64.pack_into(buf, 8 * i, fut.result())
            if not u.local[j]:
                self.store_bytes += u.size[j]
        return buf

    def _pool_small(self, j: int, view: memoryview) -> Future[int]:
        # Small units go to the sub-read pool as whole reads (many files in flight); a
        # big unit reads itself in parallel sub-reads from that pool.
        if self._u.size[j] <= SUBREAD:
            return self._sub.submit(self._read_unit, j, view)
        done: Future[int] = Future()
        try:
            done.set_result(self._read_unit(j, view))
        except BaseException as e:
            done.set_exception(e)
        return done


class _TreeWriter:
    """Writes the units this node lacks under temporary names; a file whole is chmod'ed,
    given its source time, renamed into place and journalled."""

    def __init__(
        self, plan: TreePlan, units: _Units, mine: Bits, flusher: JournalFlusher, root: Path
    ) -> None:
        self._plan, self._u, self._flusher, self._root = plan, units, flusher, root
        self._left = array("q", [0]) * len(plan.files)  # units still to come, per file
        self._digests: dict[int, dict[int, int]] = {}  # of the files being written
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        for f in units.file:
            if f in mine:
                self._left[f] += 1
        self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="fastload-fanout-write")
        self._pending: list[Future[None]] = []
        self.files = 0
        self.bytes = 0

    def _tmp(self, f: int) -> Path:
        return self._root / _core.temp_name(self._plan.files[f][0])

    def _write(self, j: int, data: memoryview, sent: int) -> None:
        u, plan = self._u, self._plan
        f = u.file[j]
        e = plan.files[f]
        if digest(data) != sent:
            raise stage_error(
                errno.EIO,
                f"fan-out: '{e[0]}' arrived damaged (chunk at {u.off[j]} fails its digest)",
                str(self._root / e[0]),
            )
        with self._lock:
            fd = self._fds.get(f)
            if fd is None:
                fd = os.open(
                    self._tmp(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
                )
                self._fds[f] = fd
        pwrite_all(fd, data, u.off[j], self._tmp(f))
        with self._lock:
            self._digests.setdefault(f, {})[u.off[j]] = sent
            self._left[f] -= 1
            whole = self._left[f] == 0
            if whole:
                del self._fds[f]
        if whole:
            self._finish(f, fd)

    def _finish(self, f: int, fd: int | None) -> None:
        e = self._plan.files[f]
        tmp = self._tmp(f)
        if fd is None:  # an empty file
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            chunks = [_core.fl64(b"")]
        else:
            got = self._digests.pop(f)
            chunks = [got[k] for k in sorted(got)]
        try:
            os.fchmod(fd, stat.S_IMODE(e[4]))
        finally:
            os.close(fd)
        os.utime(tmp, ns=(e[5], e[5]))
        os.replace(tmp, self._root / e[0])
        digests = b"".join(U64.pack(c) for c in chunks).hex()
        rec = Record(e.size, e.mtime_ns, e.mode, digests)
        self._plan.done.set(f, rec)
        self._flusher.add([(e[0], *rec)])
        with self._lock:
            self.files += 1
            self.bytes += e[2]

    def empty(self, f: int) -> None:
        self._finish(f, None)

    def take(self, node: int, batch: Sequence[int], payload: memoryview, mine: Bits) -> None:
        u = self._u
        pos = 8 * len(batch)
        for i, j in enumerate(batch):
            data = payload[pos : pos + u.size[j]]
            pos += u.size[j]
            if u.file[j] in mine:
                sent = U64.unpack_from(payload, 8 * i)[0]
                self._pending.append(self._pool.submit(self._write, j, data, sent))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def fan_tree(x: Exchange, source: Any, dest: Destination) -> StageResult:
    """``source`` (a local tree or an object prefix) staged on every node, each unit
    read once in total (under ``dest``'s lock)."""
    return exchange(x, source, dest, *listed_and_planned(x, source, dest, dest.req,
                                                          source.listing))  # fmt: skip


def listed_and_planned(
    x: Exchange, source: Any, dest: Destination, req: Any,
    listing_of: Callable[[Any], Any], scope: str = "",
) -> tuple[TreePlan, list[Bits], list[Bits], int]:  # fmt: skip
    """Node 0 lists the source once (``listing_of(req)``) and sends the listing in
    columns (a Listing, an ObjectList, a zip's members); every node plans against it,
    sends what it needs and holds as two bitmaps, and lets the listing go (the plan, and
    an object prefix's objects, hold what is left to do). Returns the plan, every node's
    bitmaps and the round's bytes. ``scope`` keeps the sync points apart from other
    stages' over the same exchange."""
    listing: list[Any] = [None]
    if x.node == 0:
        try:
            entries = listing_of(req)
            listing = [
                ("ok", entries, parse_size(os.environ.get("FASTLOAD_FANOUT_ROUND") or ROUND))
            ]
            del entries
        except (OSError, StageError) as e:
            listing = [("error", str(e), 0)]
    x.sync(f"{scope}listed")
    x.broadcast_object(listing)
    status, entries, round_bytes = listing[0]
    del listing
    if status != "ok":
        raise fanout_error(
            f"node 0 ({x.hosts[0]}) could not list the source: {entries}", source.name
        )
    plan = source.plan(req, dest, entries)
    del entries  # the plan holds the files (and an object prefix, its objects)
    nfiles = len(plan.files)
    need_me = Bits.of([] if plan.complete else plan.todo, nfiles)
    have_me = Bits(plan.done.mask_bits(), nfiles)
    if need_me:
        dest.check_space(space_needed(plan, dest.path.parent))
    x.sync(f"{scope}planned")
    gathered = x.all_gather_object((need_me.data, have_me.data))
    need = [Bits(a, nfiles) for a, _ in gathered]
    have = [Bits(b, nfiles) for _, b in gathered]
    return plan, need, have, round_bytes


def exchange(
    x: Exchange,
    source: Any,
    dest: Destination,
    plan: TreePlan,
    need: list[Bits],
    have: list[Bits],
    round_bytes: int,
    *,
    before: Callable[[], tuple[int, int, int]] | None = None,
    finish: Callable[[], StageResult] | None = None,
) -> StageResult:
    """The exchange of a planned tree: ``need``/``have`` are every node's bitmaps of
    ``plan``'s files; the units some node needs are dealt, read, sent and written, and
    ``finish`` (the ordinary pipeline on ``plan`` by default) writes the manifest.
    ``before`` (fanout/zips.py) runs with the folders made, before the rounds, and
    returns the files, bytes it wrote and the bytes it read from the store."""
    req = dest.req
    end = finish if finish is not None else (lambda: finish_plan(dest, source, plan))
    if not any(need):
        return end()
    units = _deal(plan.files.size, need, have, req.stripe, round_bytes)
    mine = need[x.node]
    del need, have
    flusher = None
    early = (0, 0, 0)
    if mine or before is not None:
        make_dirs(plan, dest)
        if before is not None:
            early = before()
    if mine:
        flusher = dest.begin(plan.done)

    total = sum(plan.files.size[f] for f in mine)
    on_progress, bar = progress_callback(req.progress, f"fan-out {source.label}", total, 0)
    sender = _TreeSender(plan, units, x.node, source, dest.root)
    writer = _TreeWriter(plan, units, mine, flusher, dest.root) if flusher is not None else None
    rounds = max(len(r) for r in units.rounds)
    try:
        if writer is not None:
            for f in mine:
                if plan.files.size[f] == 0:
                    writer.empty(f)
        for r in range(rounds):
            payload = sender.next()
            views = x.round_trip(payload)
            if writer is not None:
                writer.wait()  # the previous round's writes: memory stays at two rounds
                for k in range(x.nodes):
                    if r < len(units.rounds[k]):
                        writer.take(k, units.rounds[k][r], views[k], mine)
                if on_progress is not None:
                    on_progress(writer.bytes, total, writer.files, len(mine))
        if writer is not None:
            writer.wait()
    finally:
        sender.close()
        if writer is not None:
            writer.close()
        if flusher is not None:
            with contextlib.suppress(Exception):
                flusher.close()
        dest.journal.close()
        if bar is not None:
            bar.close()
    del units
    result = end()
    return dataclasses.replace(
        result,
        seconds=time.monotonic() - req.t0,
        engine="fanout",
        skipped=False,
        copied_files=(writer.files if writer is not None else 0) + early[0],
        copied_bytes=(writer.bytes if writer is not None else 0) + early[1],
        nodes=x.nodes,
        read_bytes=sender.store_bytes + early[2],
    )


def finish_plan(
    dest: Destination, source: Any, plan: TreePlan, req: Any = None
) -> StageResult:
    """The ordinary pipeline on the plan made before the exchange, whose files the
    writers set done as they landed: nothing left to copy, the manifest written (no
    second listing or plan). ``req``: the run's request where it is not ``dest``'s (a
    zip's, its checksum checked once before)."""
    if not dest.req.check_source and dest.holds(source.name, source.options):
        assert dest.old is not None
        return dest.skipped(int(dest.old["files_count"]), int(dest.old["bytes"]))
    plan.todo = array("q", (i for i in plan.todo if not plan.done.is_done(i)))
    return run_plan(source, req if req is not None else dest.req, dest, plan)
