"""Fan-out staging: the nodes of a job stage one dataset while the shared store serves
it about once in total.

Every process of the job calls ``stage(src, dst, fanout=True)``. The first process of
each node (its leader) takes the node lock; the others wait on it as for any stage and
then find the copy complete. The leaders form a gloo group (exchange.py) and:

- a tree or a file: node 0 lists the source and sends the listing; each leader works
  out what its destination lacks (the tree pipeline's own plan: journal, manifest);
  what any node lacks is cut into units (a small file, or a chunk of a big one, on the
  manifest's chunk boundaries) and dealt out: a unit some node already holds is read
  from that node's disk, the rest in contiguous runs balanced by bytes, one per node,
  from the store. In rounds, each leader sends its next units (about ``ROUND`` bytes,
  with their chunk digests) and receives everyone's; it writes what it lacks under a
  temporary name, checks the digests on arrival, renames each file into place once
  whole, and journals it. The tree pipeline then runs as usual: it finds every file in
  the journal, copies nothing and writes the manifest.
- an archive: its bytes are cut into pieces dealt round-robin (piece ``k`` to node
  ``k mod N``), so each round delivers the next ``N`` pieces in order to everyone, and
  each node feeds the whole stream to its own extractor (the archive pipeline, with a
  reader that takes its blocks from the exchange). A node whose copy is complete still
  reads its pieces for the others and extracts nothing.

Failure anywhere stops every leader within the round timeout, naming the node; what each
finished stays journalled, so a rerun fetches only what is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import socket
import stat
import struct
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .. import _core
from .._util import node_lock, parse_size, write_json_atomic
from ..errors import SourceChangedError, StageError, stage_error
from .exchange import Exchange, FanoutError, fanout_error, timeout_from_env
from .job import JOURNAL_EVERY, Progress, progress_callback, say_waiting
from .readers import LocalArchive
from .result import StageResult
from .state import JournalFlusher, check_space, previous_stage, state_dir
from .tree import TreePlan, list_tree, make_dirs, plan_tree, space_needed

__all__ = ["FanoutError", "Request", "stage_fanout"]

# Bytes a leader sends per round (every leader receives N times that); node 0's
# FASTLOAD_FANOUT_ROUND overrides it (tests use small rounds to have many).
ROUND = 32 << 20
PIECE = 16 << 20  # bytes of an archive per piece
SUBREAD = 1 << 20  # a chunk is read in parallel positional reads of this size
READERS = 32  # reads in flight on a leader
WRITERS = 8  # writes in flight on a leader

_Q = struct.Struct("<Q")


@dataclasses.dataclass
class Request:
    """A stage() call, its arguments checked, as the fan-out needs it. ``locked(listing,
    source)`` runs the ordinary stage under the node lock the caller already holds (with
    the tree listing, or the archive source, to use instead of its own)."""

    src: Path | str
    dst: Path
    is_file: bool
    options: dict[str, Any]
    compression: str | None
    checksum: tuple[str, str] | None
    engine: str
    progress: Progress
    workers: int | None
    stripe: int
    t0: float
    locked: Callable[..., StageResult]
    plain: Callable[[], StageResult]
    archive: Callable[[], Any] | None = None
    """The archive as a source (an object in a store); default: the file ``src``."""
    objects: tuple[Any, list[Any], bool, Callable[..., TreePlan]] | None = None
    """A prefix of a store: (the store, its objects, a single object?, plan_objects)."""


# --- the group ---------------------------------------------------------------


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _slurm_first_host(nodelist: str) -> str:
    """The address of the job's first node: the rendezvous of a group made from
    SLURM's variables (its name, or its NodeAddr where the name does not resolve)."""
    names = _scontrol("show", "hostnames", nodelist).split()
    if names:
        host = names[0]
    else:
        # "n[1-3,7],m2" -> "n1": the first name of a compressed list, without scontrol.
        head = nodelist.split(",")[0]
        if "[" in head:
            prefix, rest = head.split("[", 1)
            head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
        host = head
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    for word in _scontrol("show", "node", host).split():
        if word.startswith("NodeAddr="):
            return word[len("NodeAddr=") :]
    return host


def _init_from_env(dist: Any, timeout: float) -> bool:
    """Initialises the default group from torchrun's or SLURM's variables; False where
    they describe a single process (or none)."""
    import datetime

    env = os.environ
    pg_timeout = datetime.timedelta(seconds=max(timeout, 1800.0))
    if "RANK" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) < 2:
            return False
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ValueError(
                "fanout=True under torchrun's variables needs MASTER_ADDR and MASTER_PORT"
            )
        dist.init_process_group("gloo", init_method="env://", timeout=pg_timeout)
        return True
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        host = env.get("MASTER_ADDR") or _slurm_first_host(env.get("SLURM_JOB_NODELIST", ""))
        port = env.get("FASTLOAD_FANOUT_PORT") or str(
            29500 + 1 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            timeout=pg_timeout,
        )
        return True
    return False


def node_key() -> str:
    """Which node this process is on: SLURM's node number, else torchrun's group rank,
    else the host name (several "nodes" can so share one machine in tests)."""
    env = os.environ
    if "SLURM_NODEID" in env:
        return f"slurm:{env['SLURM_NODEID']}"
    if "GROUP_RANK" in env:
        return f"torchrun:{env['GROUP_RANK']}"
    return f"host:{socket.gethostname()}"


def destination_id(dst: Path) -> str:
    """An id of the directory ``dst`` lands in, the same for every process that sees
    that directory: a random word kept beside it (created once, atomically, also on
    NFS). Processes with the same id share one copy (the same node, or a destination on
    a shared file system); different ids are different disks."""
    path = dst.parent / f".{dst.name}.fastload.id"
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        pass
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(uuid.uuid4().hex, encoding="ascii")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text(encoding="ascii").strip()


def stage_fanout(req: Request, group: Any = None) -> StageResult:
    """Stages ``req`` across the nodes of the job (see the module's description)."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise ImportError(
            "stage(..., fanout=True) exchanges data over torch.distributed: "
            "pip install torch (or drop fanout=True)"
        ) from None
    timeout = timeout_from_env()
    created = False
    if not dist.is_available():
        return req.plain()
    if not dist.is_initialized():
        created = _init_from_env(dist, timeout)
        if not created:
            return req.plain()
    try:
        if dist.get_world_size(group) < 2:
            return req.plain()
        return _stage_in_group(dist, group, req, timeout)
    finally:
        if created:
            dist.destroy_process_group()


def _stage_in_group(dist: Any, group: Any, req: Request, timeout: float) -> StageResult:
    import datetime

    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    everyone: list[Any] = [None] * size
    # One leader per destination, not per node name: three "nodes" whose destination
    # is one directory of a shared file system are one copy (and one node lock).
    me = (node_key(), destination_id(req.dst), socket.gethostname(), uuid.uuid4().hex)
    dist.all_gather_object(everyone, me, group)
    leaders: dict[str, int] = {}
    for r, (_, dest, _, _) in enumerate(everyone):
        leaders.setdefault(dest, r)
    order = sorted(leaders.values())
    token = everyone[0][3]
    hosts = [everyone[r][2] for r in order]
    me_leader = leaders[everyone[rank][1]] == rank
    # Global ranks of the leaders (new_group wants ranks of the default group).
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in order]
    # The group's own timeout is the round timeout: work of unequal length happens
    # between rounds (Exchange.sync), so no process waits longer on a peer that is gone.
    leader_group = dist.new_group(
        ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout)
    )
    if len(order) == 1:
        # One node: its processes share the node lock as in a plain stage.
        return req.plain()
    on_wait = say_waiting if req.progress else None
    if not me_leader:
        dist.barrier(group)  # the leaders hold their node locks from here on
        with node_lock(req.dst, on_wait=on_wait):
            failed = _read_failure(req.dst, token)
        if failed is not None:
            raise fanout_error(failed, str(req.src))
        return req.plain()
    with node_lock(req.dst, on_wait=on_wait):
        dist.barrier(group)
        x = Exchange(dist, leader_group, hosts, str(req.src), timeout)
        ok = False
        try:
            fan = _fan_archive if req.compression is not None else _fan_tree
            result = fan(x, req)
            ok = True
            return result
        except BaseException as e:
            x.abort(e)
            _write_failure(req.dst, token, str(e))
            raise
        finally:
            x.close(ok)


def _write_failure(dst: Path, token: str, text: str) -> None:
    with contextlib.suppress(OSError):
        state_dir(dst).mkdir(exist_ok=True)
        write_json_atomic(state_dir(dst) / "fanout-failed.json", {"token": token, "error": text})


def _read_failure(dst: Path, token: str) -> str | None:
    try:
        with open(state_dir(dst) / "fanout-failed.json", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("token") == token:
        return str(data.get("error"))
    return None


# --- reading -----------------------------------------------------------------


def _read_range(fd: int, view: memoryview, off: int, pool: ThreadPoolExecutor) -> int:
    """Fills ``view`` from ``fd`` at ``off`` with parallel reads of ``SUBREAD`` bytes
    (a network file system serves one request at a time per read). Returns the bytes
    read (short at the end of the file)."""

    def one(start: int, end: int) -> int:
        got = start
        while got < end:
            k = os.preadv(fd, [view[got:end]], off + got)
            if k == 0:
                break
            got += k
        return got - start

    n = view.nbytes
    if n <= SUBREAD:
        return one(0, n)
    parts = [(s, min(s + SUBREAD, n)) for s in range(0, n, SUBREAD)]
    futures = [pool.submit(one, s, e) for s, e in parts[1:]]
    total = one(*parts[0])
    for fut in futures:
        total += fut.result()
    return total


def _digest(view: memoryview) -> int:
    return _core.fl64(view)


# --- trees -------------------------------------------------------------------


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
        got = _read_range(fd, view, off, pool)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if got != view.nbytes or (st.st_size, st.st_mtime_ns) != (e[2], e[5]):
        raise SourceChangedError(
            errno.EIO,
            f"source file changed: '{path}' was modified while it was being staged; "
            "stage again to pick up the new content",
        )


class _TreeSource:
    """A tree's source: a directory (or one file) on a file system."""

    def __init__(self, req: Request) -> None:
        self.req, self.src = req, Path(req.src)
        self.label = self.src.name

    def listing(self) -> Any:
        return list_tree(self.src, self.req.is_file, self.req.options, self.req.workers)

    def plan(self, listing: Any) -> TreePlan:
        r = self.req
        return plan_tree(
            self.src, r.dst, r.is_file, r.options, previous_stage(r.dst), r.engine, r.workers,
            r.stripe, listing,
        )  # fmt: skip

    def read(
        self, plan: TreePlan, f: int, off: int, view: memoryview, pool: ThreadPoolExecutor
    ) -> None:
        e = plan.files[f]
        path = self.src if self.req.is_file else plan.src_root / e[0]
        _read_file(path, e, off, view, pool)


class _ObjectsSource(_TreeSource):
    """A prefix (or one object) of an object store: ranged GETs, If-Match the listed
    ETag, several in flight for a big unit."""

    def __init__(self, req: Request) -> None:
        super().__init__(req)
        assert req.objects is not None
        self.store, self.objects, self.single, self.plan_objects = req.objects
        self.label = str(req.src).rstrip("/").rsplit("/", 1)[-1]

    def listing(self) -> Any:
        return self.objects

    def plan(self, listing: Any) -> TreePlan:
        r = self.req
        self.objects = listing  # node 0's: the units are numbered in it
        plan: TreePlan = self.plan_objects(
            self.store, listing, r.dst, single=self.single, options=r.options,
            old=previous_stage(r.dst), engine=r.engine, workers=r.workers, stripe=r.stripe,
        )  # fmt: skip
        return plan

    def read(
        self, plan: TreePlan, f: int, off: int, view: memoryview, pool: ThreadPoolExecutor
    ) -> None:
        o = self.objects[f]
        step = 4 * SUBREAD
        n = view.nbytes
        parts = [(s, min(s + step, n)) for s in range(0, n, step)]
        read = self.store.read_into
        if len(parts) == 1:
            got = read(o.key, off, view, o.etag)
        else:
            futures = [pool.submit(read, o.key, off + s, view[s:e], o.etag) for s, e in parts]
            got = sum(fut.result() for fut in futures)
        if got != n:
            raise SourceChangedError(
                errno.EIO,
                f"source changed: '{self.store.url.rstrip('/')}/{o.key}' is shorter than "
                "listed; stage again to pick up the new content",
            )


@dataclasses.dataclass
class _Units:
    """What the nodes lack, cut into units: ``file[u]`` (index into the plan's files),
    ``off[u]``, ``size[u]``; ``sender[u]``: the node that reads it, ``local[u]``: from its
    own destination (else from the store); ``rounds[k]``: node k's units, round by round."""

    file: list[int]
    off: list[int]
    size: list[int]
    sender: list[int]
    local: list[bool]
    rounds: list[list[list[int]]]


def _deal(
    files: list[tuple[Any, ...]],
    need: list[set[int]],
    have: list[set[int]],
    stripe: int,
    round_bytes: int,
) -> _Units:
    """The units and who sends each: the same on every node (a pure function of the
    plan every node shares)."""
    nodes = len(need)
    wanted = sorted(set().union(*need))
    u = _Units([], [], [], [], [], [[] for _ in range(nodes)])
    load = [0] * nodes
    store_units: list[int] = []
    for i in wanted:
        size = files[i][2]
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
                u.local.append(True)
            else:
                u.sender.append(-1)
                u.local.append(False)
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
    for k in range(nodes):
        mine = [j for j in range(len(u.file)) if u.sender[j] == k]
        batch: list[int] = []
        nbytes = 0
        for j in mine:
            if batch and nbytes + u.size[j] > round_bytes:
                u.rounds[k].append(batch)
                batch, nbytes = [], 0
            batch.append(j)
            nbytes += u.size[j]
        if batch:
            u.rounds[k].append(batch)
    return u


class _TreeSender:
    """Reads this node's units, a round ahead of the exchange: payload = the units'
    digests (8 bytes each), then their bytes."""

    def __init__(self, plan: TreePlan, units: _Units, node: int, source: _TreeSource):
        self._plan, self._u, self._node = plan, units, node
        self._source = source
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="fastload-fanout-read")
        self._sub = ThreadPoolExecutor(READERS, thread_name_prefix="fastload-fanout-sub")
        self._ahead: deque[Future[bytearray]] = deque()
        self._next = 0
        self.store_bytes = 0
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
            _read_file(plan.dst_root / plan.files[f][0], plan.files[f], u.off[j], view, self._sub)
        else:
            self._source.read(plan, f, u.off[j], view, self._sub)
        return _digest(view)

    def _build(self, batch: list[int]) -> bytearray:
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
            _Q.pack_into(buf, 8 * i, fut.result())
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

    def next(self) -> bytearray:
        if not self._ahead:
            return bytearray()
        buf = self._ahead.popleft().result()
        self._fill()
        return buf

    def close(self) -> None:
        for fut in self._ahead:
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sub.shutdown(wait=True, cancel_futures=True)


class _TreeWriter:
    """Writes the units this node lacks under temporary names; a file whole is chmod'ed,
    given its source time, renamed into place and journalled."""

    def __init__(self, plan: TreePlan, units: _Units, mine: set[int], flusher: JournalFlusher):
        self._plan, self._u, self._flusher = plan, units, flusher
        self._left: dict[int, int] = {}
        self._digests: dict[int, dict[int, int]] = {}
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        for j in range(len(units.file)):
            f = units.file[j]
            if f in mine:
                self._left[f] = self._left.get(f, 0) + 1
        self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="fastload-fanout-write")
        self._pending: list[Future[None]] = []
        self.files = 0
        self.bytes = 0

    def _tmp(self, f: int) -> Path:
        return self._plan.dst_root / _core.temp_name(self._plan.files[f][0])

    def _write(self, j: int, data: memoryview, digest: int) -> None:
        u, plan = self._u, self._plan
        f = u.file[j]
        e = plan.files[f]
        if _digest(data) != digest:
            raise stage_error(
                errno.EIO,
                f"fan-out: '{e[0]}' arrived damaged (chunk at {u.off[j]} fails its digest)",
                str(plan.dst_root / e[0]),
            )
        with self._lock:
            fd = self._fds.get(f)
            if fd is None:
                fd = os.open(
                    self._tmp(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
                )
                self._fds[f] = fd
        view = data
        off = u.off[j]
        while view.nbytes:
            k = os.pwrite(fd, view, off)
            view, off = view[k:], off + k
        with self._lock:
            self._digests.setdefault(f, {})[u.off[j]] = digest
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
        os.replace(tmp, self._plan.dst_root / e[0])
        digests = b"".join(_Q.pack(c) for c in chunks).hex()
        rec = (e[2], e[5], e[4], digests)
        self._plan.done[e[0]] = rec
        self._flusher.add([(e[0], *rec)])
        with self._lock:
            self.files += 1
            self.bytes += e[2]

    def empty(self, f: int) -> None:
        self._finish(f, None)

    def take(self, node: int, batch: list[int], payload: memoryview, mine: set[int]) -> None:
        u = self._u
        pos = 8 * len(batch)
        for i, j in enumerate(batch):
            data = payload[pos : pos + u.size[j]]
            pos += u.size[j]
            if u.file[j] in mine:
                digest = _Q.unpack_from(payload, 8 * i)[0]
                self._pending.append(self._pool.submit(self._write, j, data, digest))

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


def _bits(indices: set[int] | list[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in indices:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def _unbits(data: bytes, n: int) -> set[int]:
    return {i for i in range(n) if data[i >> 3] >> (i & 7) & 1}


def _fan_tree(x: Exchange, req: Request) -> StageResult:
    source = _ObjectsSource(req) if req.objects is not None else _TreeSource(req)
    listing: list[Any] = [None]
    if x.node == 0:
        try:
            entries = source.listing()
            listing = [
                ("ok", entries, parse_size(os.environ.get("FASTLOAD_FANOUT_ROUND") or ROUND))
            ]
        except (OSError, StageError) as e:
            listing = [("error", str(e), 0)]
    x.sync("listed")
    x.broadcast_object(listing)
    status, entries, round_bytes = listing[0]
    if status != "ok":
        raise fanout_error(
            f"node 0 ({x.hosts[0]}) could not list the source: {entries}", str(req.src)
        )
    plan = source.plan(entries)
    nfiles = len(plan.files)
    need_me = [] if plan.complete else plan.todo
    index = {e[0]: i for i, e in enumerate(plan.files)}
    have_me = {index[p] for p in plan.done if p in index}
    if need_me:
        check_space(req.dst.parent, space_needed(plan, req.dst.parent), req.dst)
    x.sync("planned")
    gathered = x.all_gather_object((_bits(need_me, nfiles), _bits(have_me, nfiles)))
    need = [_unbits(a, nfiles) for a, _ in gathered]
    have = [_unbits(b, nfiles) for _, b in gathered]
    if not any(need):
        return req.locked(listing=entries)
    units = _deal(plan.files, need, have, req.stripe, round_bytes)
    mine = need[x.node]
    if mine:
        make_dirs(plan, req.dst, req.is_file)
        plan.journal.open(dict(plan.done))
    flusher = JournalFlusher(plan.journal, str(plan.dst_root), JOURNAL_EVERY) if mine else None

    total = sum(plan.files[f][2] for f in mine)
    on_progress, bar = progress_callback(req.progress, f"fan-out {source.label}", total, 0)
    sender = _TreeSender(plan, units, x.node, source)
    writer = _TreeWriter(plan, units, mine, flusher) if flusher is not None else None
    rounds = max(len(r) for r in units.rounds)
    try:
        if writer is not None:
            for f in mine:
                if plan.files[f][2] == 0:
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
        plan.journal.close()
        if bar is not None:
            bar.close()
    result = req.locked(listing=entries)
    return dataclasses.replace(
        result,
        seconds=time.monotonic() - req.t0,
        engine="fanout",
        skipped=False,
        copied_files=writer.files if writer is not None else 0,
        copied_bytes=writer.bytes if writer is not None else 0,
        nodes=x.nodes,
        read_bytes=sender.store_bytes,
    )


# --- archives ----------------------------------------------------------------


class _PieceReader:
    """Reads this node's pieces of the archive (``k``, ``k + N``, ...), two ahead, each
    in parallel reads of ``subread`` bytes: positional reads of a file, or ranged GETs
    of an object (``RemoteArchive.read_into``)."""

    def __init__(self, base: Any, node: int, nodes: int) -> None:
        self._fd = -1
        if isinstance(base, LocalArchive):
            self._fd = os.open(base.path, os.O_RDONLY | os.O_CLOEXEC)
            self._read_at: Callable[[memoryview, int], int] = self._pread
            self._subread = SUBREAD
        else:
            self._read_at = base.read_into
            self._subread = 4 * SUBREAD
        self._name, self._size, self._node, self._nodes = base.name, base.size, node, nodes
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="fastload-fanout-piece")
        self._sub = ThreadPoolExecutor(READERS, thread_name_prefix="fastload-fanout-sub")
        self._ahead: deque[Future[bytearray]] = deque()
        self._next = node
        self.store_bytes = 0
        self._fill()

    def _pread(self, view: memoryview, off: int) -> int:
        got = 0
        while got < view.nbytes:
            k = os.preadv(self._fd, [view[got:]], off + got)
            if k == 0:
                break
            got += k
        return got

    def _fill(self) -> None:
        while len(self._ahead) < 2 and self._next * PIECE < self._size:
            self._ahead.append(self._pool.submit(self._read, self._next))
            self._next += self._nodes

    def _read(self, piece: int) -> bytearray:
        off = piece * PIECE
        n = min(PIECE, self._size - off)
        buf = bytearray(8 + n)
        view = memoryview(buf)[8:]
        parts = [(s, min(s + self._subread, n)) for s in range(0, n, self._subread)]
        futures = [self._sub.submit(self._read_at, view[s:e], off + s) for s, e in parts]
        got = sum(f.result() for f in futures)
        if got != n:
            raise SourceChangedError(
                errno.EIO,
                f"source file changed: '{self._name}' is shorter than when staging began; "
                "stage again to pick up the new content",
            )
        _Q.pack_into(buf, 0, _digest(view))
        self.store_bytes += n
        return buf

    def next(self) -> bytearray:
        if not self._ahead:
            return bytearray()
        buf = self._ahead.popleft().result()
        self._fill()
        return buf

    def close(self) -> None:
        for fut in self._ahead:
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sub.shutdown(wait=True, cancel_futures=True)
        if self._fd >= 0:
            os.close(self._fd)


def _pieces_of_round(
    x: Exchange, views: list[memoryview], r: int, size: int, what: str
) -> Iterator[tuple[int, memoryview]]:
    """The round's pieces in archive order, their digests checked."""
    for k in range(x.nodes):
        piece = r * x.nodes + k
        if piece * PIECE >= size:
            return
        v = views[k]
        data = v[8:]
        if (
            data.nbytes != min(PIECE, size - piece * PIECE)
            or _digest(data) != _Q.unpack_from(v, 0)[0]
        ):
            raise stage_error(
                errno.EIO,
                f"fan-out: piece {piece} of '{what}' from node {k} ({x.hosts[k]}) arrived damaged",
                what,
            )
        yield piece * PIECE, data


class _ExchangeReader:
    """An archive reader (as stage_archive iterates it) whose blocks come from the
    exchange: each round, this node's next piece goes out and ``N`` pieces come in, in
    order; they are copied into the extraction job's blocks."""

    def __init__(
        self, x: Exchange, pieces: _PieceReader, size: int, what: str, job: Any, hasher: Any
    ):
        self._x, self._pieces, self._size, self._what = x, pieces, size, what
        self._job, self._hasher = job, hasher
        self._rounds = -(-size // (PIECE * x.nodes))
        self._round = 0
        self._skip_to = 0
        self._synced = False

    def _start(self) -> None:
        # The extraction's set-up (reading back an earlier copy, say) takes as long as
        # it takes on each node: the rounds start once every node is ready.
        if not self._synced:
            self._synced = True
            self._x.sync("extracting")

    def seek(self, offset: int) -> None:
        self._skip_to = offset  # the bytes before it still travel; they are not fed

    def __iter__(self) -> Iterator[tuple[int, int, int, memoryview]]:
        block = self._job.block_size
        self._start()
        while self._round < self._rounds:
            r = self._round
            views = self._x.round_trip(self._pieces.next())
            self._round += 1
            for off, data in _pieces_of_round(self._x, views, r, self._size, self._what):
                if self._hasher is not None:
                    self._hasher.update(data)
                for start in range(0, data.nbytes, block):
                    at = off + start
                    part = data[start : start + block]
                    if at + part.nbytes <= self._skip_to:
                        continue
                    if at < self._skip_to:
                        part = part[self._skip_to - at :]
                        at = self._skip_to
                    lent = self._job.lend(True)
                    if lent is None:
                        return  # the job stopped: its error comes from job.finish()
                    b, buf = lent
                    view = memoryview(buf)
                    try:
                        view[: part.nbytes] = part
                        yield at, part.nbytes, b, view[: part.nbytes]
                    finally:
                        self._job.release(b)

    def pump(self) -> None:
        """Takes part in the remaining rounds without extracting (this node's copy is
        complete, or its extraction ended early)."""
        self._start()
        while self._round < self._rounds:
            self._x.round_trip(self._pieces.next())
            self._round += 1

    def close(self) -> None:
        pass


class _ExchangeArchive:
    """The archive as stage_archive() sees it: the local one's name, size and identity
    (so the manifest is the one a plain stage writes), its bytes from the exchange."""

    def __init__(self, base: Any, x: Exchange, pieces: _PieceReader) -> None:
        self._base, self._x, self._pieces = base, x, pieces
        self.name, self.size, self.identity = base.name, base.size, base.identity
        self.cached = 0.0
        self.stream = False
        self.reader_made: _ExchangeReader | None = None

    def reader(self, job: Any, hasher: Any, can_seek: bool) -> _ExchangeReader:
        self.reader_made = _ExchangeReader(self._x, self._pieces, self.size, self.name, job, hasher)
        return self.reader_made

    def direct_write_min(self, dst: Path) -> int:
        return int(self._base.direct_write_min(dst))

    def changed(self) -> bool:
        return bool(self._base.changed())


def _fan_archive(x: Exchange, req: Request) -> StageResult:
    from .archive import archive_fingerprint

    base = req.archive() if req.archive is not None else LocalArchive(Path(req.src))
    old = previous_stage(req.dst)
    fingerprint = archive_fingerprint(
        base.identity, {**req.options, "chunk": req.stripe, "checksum": req.checksum}
    )
    complete = bool(
        old is not None
        and old.get("complete")
        and not old.get("damaged")
        and old.get("fingerprint") == fingerprint
        and req.dst.is_dir()
    )
    x.sync("checked")
    sizes = x.all_gather_object((complete, base.size, base.identity))
    if len({(s, i) for _, s, i in sizes}) != 1:
        raise fanout_error(
            f"the nodes see different versions of '{req.src}' (size and time): "
            + ", ".join(f"node {k}: {s} bytes" for k, (_, s, _) in enumerate(sizes)),
            str(req.src),
        )
    if all(c for c, _, _ in sizes):
        return req.locked(source=base)
    pieces = _PieceReader(base, x.node, x.nodes)
    try:
        if complete:
            _ExchangeReader(x, pieces, base.size, base.name, None, None).pump()
            result = req.locked(source=base)
        else:
            source = _ExchangeArchive(base, x, pieces)
            result = req.locked(source=source)
            # Rounds left after the end of the tar stream (or all of them, where the
            # extraction found nothing to do).
            reader = source.reader_made or _ExchangeReader(
                x, pieces, base.size, base.name, None, None
            )
            reader.pump()
    finally:
        pieces.close()
    return dataclasses.replace(
        result,
        seconds=time.monotonic() - req.t0,
        nodes=x.nodes,
        read_bytes=pieces.store_bytes,
    )
