"""Shared memory for packed batches: the blocks a DataLoader worker allocates a batch's
payloads in and reuses once the main process has dropped them (``_core.ShmBlock``, memfd),
the main process's mappings of them, how a batch's tensors travel between processes
(every storage once: a pool block by reference, its descriptor the first time only; a
small one inline), and the entry points of copies to CUDA (``pin``, ``copy_to``: blocks
page-locked in place; the CUDA side, and the hold that keeps a block until every copy
from it has completed, is :mod:`._gpu`). Used by :mod:`.collate` and :mod:`._field`,
which own the packed types.
"""

from __future__ import annotations

import bisect
import multiprocessing.reduction as _reduction
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from .. import _core
from .._util import pid_alive
from . import _gpu
from ._gpu import FENCES, Fences, poll

__all__ = ["FENCES", "Fences", "copy_to", "mapped_of", "pin", "poll", "register_host",
           "registered", "release_host"]

_ALIGN = 64  # each field's payload block starts on a cache line (and an int64 boundary)


# --- allocation ------------------------------------------------------------------------


class _BlockPool:
    """A DataLoader worker's shared-memory blocks (``_core.ShmBlock``, memfd), reused
    from batch to batch. A fresh segment per batch (what torch allocates for a tensor
    in a worker) pays a page fault, a zeroed page and a page-cache insertion for every
    4 KiB, and a truncation when freed: most of the cost of a large batch. A block is
    reused once the main process has dropped every tensor over the batch last written
    into it (its lease count, kept in the block, is zero); the pool grows while the
    main process holds more batches.

    A free block is let go of when it has not been written for ``idle_takes`` batches,
    or when more than ``max_idle`` are free (the smallest first). Not sooner: a block
    let go of and made again costs the main process a descriptor and a new mapping (a
    connection to this worker and a millisecond or more), and the number of blocks a
    loader keeps in flight swings from batch to batch (prefetching, a loop that
    pauses).

    Before making a block, a worker forked from the main process claims one of earlier
    workers' blocks the main process kept (``_inherited``; mapped and registered there:
    free) by its owner word (``ShmBlock.claim``: one of the workers forked from one
    state gets it), written once its lease count is zero, as any other."""

    _GRAIN = 1 << 20

    def __init__(self, max_idle: int = 8, idle_takes: int = 64) -> None:
        self.pid = os.getpid()
        self.max_idle = max_idle
        self.idle_takes = idle_takes
        self.takes = 0
        self.blocks: dict[int, _core.ShmBlock] = {}  # payload address -> block
        self.last: dict[int, int] = {}  # payload address -> the take that last wrote it
        self.sent: set[int] = set()  # inodes of blocks handed over (the receiver maps them)
        self.retired: list[int] = []  # of those, let go of since the last hand-over
        # sent and retired: batches are pickled in the result queue's feeder thread
        self.lock = threading.Lock()
        self.claimable = list(_inherited)  # (fd, length) of blocks the parent kept

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` in a free block (not initialised)."""
        self.takes += 1
        free = sorted(
            (b for b in self.blocks.values() if b.users == 0), key=lambda b: b.capacity
        )
        block = next((b for b in free if b.capacity >= nbytes), None)
        if block is None:
            block = self._claim(nbytes)
        if block is None:
            # an eighth of headroom, so batches of varying size fit the same block
            want = -(-(nbytes + nbytes // 8) // self._GRAIN) * self._GRAIN
            block = _core.ShmBlock(want)
            self.blocks[block.address] = block
        self.last[block.address] = self.takes
        spare = [b for b in free if b is not block]
        extra = max(0, len(spare) - self.max_idle)  # the smallest go first
        for i, b in enumerate(spare):
            if i < extra or self.takes - self.last[b.address] > self.idle_takes:
                self._let_go(b)
        lease = block.lease()
        return torch.frombuffer(lease, dtype=torch.uint8)[:nbytes]

    def _claim(self, nbytes: int) -> _core.ShmBlock | None:
        """A free block of an earlier worker that holds ``nbytes``, now this worker's
        (the main process maps it: never sent); None if none is left. Claimed blocks
        still read there join the pool, for later."""
        for fd, length in [c for c in self.claimable if c[1] - _HEADER >= nbytes]:
            self.claimable.remove((fd, length))
            try:
                b = _core.ShmBlock.claim(fd)
            except OSError:
                b = None
            finally:
                os.close(fd)
            if b is None:
                continue  # another worker's now
            self.blocks[b.address] = b
            self.last[b.address] = self.takes
            with self.lock:
                self.sent.add(b.inode)
            if b.users == 0:
                return b
        return None

    def _let_go(self, b: _core.ShmBlock) -> None:
        del self.blocks[b.address], self.last[b.address]
        with self.lock:
            if b.inode in self.sent:
                self.sent.discard(b.inode)
                self.retired.append(b.inode)

    def block_of(self, storage: torch.UntypedStorage) -> _core.ShmBlock | None:
        return self.blocks.get(storage.data_ptr())


_pool: _BlockPool | None = None


def _worker_pool() -> _BlockPool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():  # a forked child starts its own
        _pool = _BlockPool()
    return _pool


class _BlockHandover:
    """Pickles as a reference to a pool block, retaining a lease for the receiving
    process to take over. The block's descriptor travels only the first time the block
    is handed over (through multiprocessing's resource sharer: a connection to this
    process per descriptor, the cost torch pays per batch); after that the receiver
    already maps it and finds it by (pid, inode). A receiver that has let go of its
    mapping opens the block again through ``/proc/PID/fd/N``."""

    __slots__ = ("block", "pool")

    def __init__(self, block: _core.ShmBlock, pool: _BlockPool) -> None:
        self.block = block
        self.pool = pool

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _attach_block, self.args()

    def args(self) -> tuple[Any, int, int, int, int, tuple[int, ...]]:
        """``_attach_block``'s arguments, a count retained for the receiver: call once
        per hand-over."""
        b, pool = self.block, self.pool
        b.retain()  # before this process's own lease can go
        with pool.lock:
            first = b.inode not in pool.sent
            pool.sent.add(b.inode)
            gone, pool.retired = tuple(pool.retired), []
        handle = _reduction.DupFd(b.fd) if first else None
        return handle, b.fd, b.length, os.getpid(), b.inode, gone


class _Mapped:
    """The main process's mapping of one worker block: the view, where its mapping starts
    (for page-locking it) and its registration with CUDA (:mod:`._gpu`): ``registered``,
    ``pending`` (queued on the registrar or running), ``failed`` (tried once, failed:
    never tried again), ``device`` (registered for), ``dropped`` (let go of here)."""

    __slots__ = ("base", "device", "dropped", "failed", "fd", "key", "length", "pending",
                 "registered", "spared", "view")

    def __init__(self, view: _core.ShmView, base: int, key: tuple[int, int] = (0, 0),
                 fd: int = -1) -> None:
        self.view = view
        self.base = base
        self.length = view.length
        self.key = key
        self.fd = fd  # a descriptor of the block, for workers forked later (-1: none)
        self.spared = 0  # the generation it was kept at, once its worker let it go
        self.registered = False
        self.pending = False
        self.failed = False
        self.dropped = False
        self.device = 0


# The main process's mappings of the workers' blocks, by (worker pid, block inode): kept
# from batch to batch, so a block written again costs no descriptor, no new mapping and
# no page faults here. Those the worker's pool let go of are named by its next hand-over
# and dropped then; those of a worker that has exited, when another block arrives; a
# registered one is unregistered first, once the copies from it have completed
# (release_host). _index: the mappings by address (starts sorted), replaced whole on
# each change, so mapped_of reads it without the lock.
#
# Blocks outlive their workers: the mappings of a worker that exited, or of blocks a
# worker let go of, are kept (_spare, by inode; freed for a claim: ShmView.disown) with a
# descriptor of the block, which workers forked later inherit (_inherited) and claim
# before making blocks of their own; a claimed block arrives under its new worker's key
# and is found by inode. A spare no worker of the next two generations (workers seen
# exiting: _generation) claimed, or beyond _MAX_SPARE, is let go of (unregistered
# first). Workers started otherwise than by fork inherit nothing: they make their own.
_views: dict[tuple[int, int], _Mapped] = {}
_spare: dict[int, _Mapped] = {}
_index: tuple[list[int], list[_Mapped]] = ([], [])
_inherited: list[tuple[int, int]] = []  # in a forked child: (fd, length) to claim
_MAX_SPARE = 64
_MAX_KEPT_FDS = 256  # descriptors kept for forked workers (each mapping's one)
_generation = 0
_lock = threading.RLock()  # batches may arrive in DataLoader's pin thread
_MAX_VIEWS_PER_WORKER = 64  # a bound only: a worker names the blocks it let go of
_HEADER = 64  # shm::kHeaderBytes: the payload starts this far into the mapping


def _reindex() -> None:
    global _index
    ms = sorted([*_views.values(), *_spare.values()], key=lambda m: m.base)
    _index = ([m.base for m in ms], ms)


def forget_views() -> None:
    """Drops every mapping, spares too (registered ones once their copies completed)."""
    with _lock:
        for key in list(_views):
            _drop(key)
        while _spare:
            _release(_spare.popitem()[1])
        _reindex()


def _before_fork() -> None:
    """The blocks of workers that have exited are kept as spares before a fork, so the
    child (a DataLoader worker of the next epoch) inherits them to claim."""
    if _views and _lock.acquire(timeout=1):
        try:
            _forget_exited(0)
            _reindex()
        finally:
            _lock.release()


def _forget_in_child() -> None:
    """A forked child drops its copies of the parent's mappings, with no CUDA call, and
    keeps the descriptors of the spare blocks, to claim."""
    global _index, _lock, _inherited
    _inherited = [(m.fd, m.length) for m in _spare.values() if m.fd >= 0]
    for fd in [m.fd for m in _views.values() if m.fd >= 0]:
        os.close(fd)
    _views.clear()
    _spare.clear()
    _index = ([], [])
    _lock = threading.RLock()


os.register_at_fork(before=_before_fork, after_in_child=_forget_in_child)


def _open_peer(pid: int, fd: int, inode: int) -> int:
    """A descriptor of worker ``pid``'s block (its descriptor ``fd``), opened through
    /proc: the block is alive there while this batch's count is on it."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        new = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"cannot open the batch block of worker {pid} ({e.strerror})",
                      path) from None
    if os.fstat(new).st_ino != inode:
        os.close(new)
        raise OSError(f"{path} is no longer the batch block (inode {inode}) it was sent as")
    return new


def _attach_block(
    handle: Any, fdno: int, length: int, pid: int, inode: int, gone: tuple[int, ...] = ()
) -> _core.ShmLease:
    """The received block's payload: a lease (a buffer; ``_land`` makes it a uint8
    tensor) holding the count the sender retained, so dropping it, unlooked at, gives
    the block back; ``gone``: the inodes of blocks the sender's pool let go of since its
    last hand-over (their mappings here are dropped)."""
    _gpu.poll()  # leases kept for finished copies go back first
    key = (pid, inode)
    with _lock:
        for g in gone:
            if (pid, g) in _views:
                _keep((pid, g))  # its worker let it go: a later worker may claim it
        m = _views.get(key)
        moved = m is None and _claimed(key, length) is not None
        if moved:
            m = _views[key]
        if m is not None and m.length == length:
            if gone or moved:
                _reindex()
            if handle is not None:
                os.close(handle.detach())
            return m.view.adopt()
        fd = handle.detach() if handle is not None else _open_peer(pid, fdno, inode)
        keep = _keep_fd(fd)
        try:
            view = _core.ShmView(fd, length)
        except BaseException:
            if keep >= 0:
                os.close(keep)
            raise
        lease = view.adopt()
        if m is not None:
            _drop(key)
        _forget_views(pid)
        m = _views[key] = _Mapped(view, _address(lease) - _HEADER, key, keep)
        _reindex()
    _gpu.mapped(m)  # registered now on the registrar thread, where this process registers
    return lease


def _keep_fd(fd: int) -> int:
    """A descriptor of the block for workers forked later (-1: none kept)."""
    kept = sum(m.fd >= 0 for m in [*_views.values(), *_spare.values()])
    try:
        return os.dup(fd) if kept < _MAX_KEPT_FDS else -1
    except OSError:
        return -1


def _claimed(key: tuple[int, int], length: int) -> _Mapped | None:
    """The mapping of a block a worker claimed, a spare or under its earlier owner's key,
    now under ``key`` (the caller reindexes); None if there is none."""
    inode = key[1]
    m = _spare.pop(inode, None)
    if m is None:
        old = next((k for k in _views if k[1] == inode), None)
        if old is None:
            return None
        m = _views.pop(old)
    if m.length != length:
        _release(m)
        return None
    m.key = key
    _views[key] = m
    return m


def _keep(key: tuple[int, int]) -> None:
    """Keeps the mapping of a block whose worker exited or let it go as a spare, freed
    for a claim (the caller reindexes), or lets go of it."""
    m = _views.pop(key)
    if m.fd < 0 or m.view.owner not in (0, key[0]):
        _release(m)
        return
    m.view.disown()
    m.spared = _generation
    _spare[key[1]] = m
    while len(_spare) > _MAX_SPARE:
        _release(_spare.pop(next(iter(_spare))))  # the oldest


def _release(m: _Mapped) -> None:
    """Lets go of a mapping: its descriptor now, its registration (release_host) later."""
    if m.fd >= 0:
        os.close(m.fd)
        m.fd = -1
    release_host(m)


def _address(buffer: Any) -> int:
    return int(torch.frombuffer(buffer, dtype=torch.uint8).data_ptr())


def _drop(key: tuple[int, int]) -> None:
    """Forgets a mapping (the caller reindexes); a registered one is unregistered once
    the copies that may read it have completed, and stays mapped until then."""
    _release(_views.pop(key))


def _exited(pids: set[int]) -> list[int]:
    return [p for p in pids if not pid_alive(p)]


def _forget_exited(pid: int) -> None:
    """Keeps the mappings of exited workers (other than ``pid``) as spares, a new
    generation: the spares no worker claimed for two generations are let go of, and
    those a worker claimed but died with are freed again."""
    global _generation
    dead = _exited({p for p, _ in _views} - {pid})
    if not dead:
        return
    _generation += 1
    lost = _exited({m.view.owner for m in _spare.values()} - {0})
    for inode, m in list(_spare.items()):
        if m.view.owner in lost:
            m.view.disown()
            m.spared = _generation
        elif m.view.owner == 0 and m.spared < _generation - 1:
            _release(_spare.pop(inode))
    for p in dead:
        for key in [k for k in _views if k[0] == p]:
            _keep(key)


def _forget_views(pid: int) -> None:
    """Keeps the mappings of exited workers as spares, and drops the oldest of
    ``pid``'s beyond ``_MAX_VIEWS_PER_WORKER`` (a bound: a worker names the blocks it
    let go of)."""
    _forget_exited(pid)
    mine = [k for k in _views if k[0] == pid]
    for key in mine[: max(0, len(mine) + 1 - _MAX_VIEWS_PER_WORKER)]:
        _drop(key)


def mapped_of(t: torch.Tensor) -> _Mapped | None:
    """The worker block mapped here that holds ``t``'s data, if any (a binary search;
    no lock)."""
    starts, maps = _index
    if not starts or t.device.type != "cpu":
        return None
    p = t.data_ptr()
    i = bisect.bisect_right(starts, p) - 1
    if i >= 0:
        m = maps[i]
        if p < m.base + m.length:
            return m
    return None


# --- the host side of copies to CUDA (data/_gpu.py) ------------------------------------
#
# A worker block the main process maps is page-locked in place (cudaHostRegister, once
# per block), so copies read it at the link's speed with no pinned copy first. The first
# pin_memory() or .to("cuda") of a batch asks for it; from then on each block is
# registered on _gpu's registrar thread as soon as it is mapped. pin() waits for its
# block's registration (DataLoader's pin thread); a copy never does: a block whose
# registration has not completed is copied as an unregistered block is. The lease rule:
# a block goes back to its worker's pool when the last lease on it is gone
# (cpp/shm/block.hpp); on a registered block a lease's count is retired instead, and
# given back once every copy issued before on the streams in use has completed
# (_gpu.poll, run as batches arrive, are pinned or moved).


def register_host(m: _Mapped, device: Any = None) -> bool:
    """Page-locks a mapped worker block for CUDA on ``device`` (once), so copies from it
    run at the link's speed and ``is_pinned()`` holds for tensors over it. False where
    CUDA is not available or registration failed (the block is then copied through
    ordinary pinning)."""
    return _gpu.register(m, device)


def release_host(m: _Mapped) -> None:
    """Unregisters a block whose mapping this process lets go of (registered, or its
    registration pending), after every copy that may read it (a mapping is never
    unmapped while registered)."""
    _gpu.unregister_later(m)


def registered(t: torch.Tensor, device: Any = None, wait: bool = True) -> bool:
    """Whether ``t`` lies in a worker block page-locked here (registering it for
    ``device`` if CUDA is available and it is not yet; with ``wait=False`` the
    registration is queued on the registrar thread and this says False until it is
    done)."""
    m = mapped_of(t)
    return m is not None and (m.registered or _gpu.register(m, device, wait))


def pin(t: torch.Tensor, device: Any = None) -> torch.Tensor:
    """``t`` in page-locked memory: itself when it lies in a registered worker block (no
    copy), else ``t.pin_memory()``."""
    if registered(t, device):
        return t
    return t.pin_memory() if device is None else t.pin_memory(device)


def before_copies(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    """The host side of copies of ``tensors`` to CUDA ``device``, before they are issued:
    their worker blocks' registration asked for, never waited for (a block not
    registered yet is copied from pageable memory: torch's copy has read it when it
    returns); the current stream noted as in use, so the blocks' leases, once dropped,
    are given back only after the copies have completed."""
    for t in tensors:
        registered(t, device, wait=False)
    if _gpu.STATE.active:
        _gpu.note_streams()


def copy_to(tensors: Sequence[torch.Tensor], device: Any, non_blocking: bool) -> list[torch.Tensor]:
    """The tensors moved to ``device``. To CUDA, from worker blocks registered here (a
    copy from page-locked memory runs at the link's speed, blocking or not), a block
    going back to its worker only once the copies have completed (before_copies)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return [t.to(dev, non_blocking=non_blocking) for t in tensors]
    before_copies(tensors, dev)
    out = [t.to(dev, non_blocking=non_blocking) for t in tensors]
    _gpu.poll()
    return out


class _Arena:
    """The ``alloc`` callback of the native packers: one block (shared memory in a
    DataLoader worker, ordinary memory elsewhere) cut into the requested pieces, each
    aligned; ``pieces`` keeps the tensors, ``views`` is what the native side fills."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.pieces: list[torch.Tensor] = []

    def __call__(self, sizes: list[int]) -> list[memoryview]:
        starts = []
        at = 0
        for n in sizes:
            starts.append(at)
            at += -(-n // _ALIGN) * _ALIGN
        block = _worker_pool().take(at) if self.shared else torch.empty(at, dtype=torch.uint8)
        self.pieces = [block[a : a + n] for a, n in zip(starts, sizes, strict=True)]
        return [p.numpy().data for p in self.pieces]


def _in_worker() -> bool:
    return get_worker_info() is not None


# --- pickling ------------------------------------------------------------------------
#
# A batch's tensors are views of a few storages (usually one: the block collate
# allocated). Pickled naively, each view would carry its whole storage again, and through
# torch's multiprocessing pickler each would be one more file descriptor handed over. So
# every distinct storage travels once, as one uint8 tensor (a shared-memory handle
# through the DataLoader), and each tensor as its place in one of them. Small private
# storages (labels, masks) travel inline as bytes: cheaper than a descriptor.

_INLINE = 64 << 10

_Spec = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _ship(tensors: Sequence[torch.Tensor]) -> tuple[list[Any], list[_Spec]]:
    """(storages, per tensor (storage number, offset, shape, stride, dtype))."""
    bases: list[Any] = []
    seen: dict[tuple[str, int], int] = {}
    pool = _pool if _pool is not None and _pool.pid == os.getpid() else None
    specs: list[_Spec] = []
    for t in tensors:
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        k = seen.get(key)
        if k is None:
            k = seen[key] = len(bases)
            bases.append(_base(st, t.device, pool))
        specs.append((k, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype))
    return bases, specs


def _base(st: torch.UntypedStorage, device: torch.device, pool: _BlockPool | None) -> Any:
    """How one storage travels: a pool block by its descriptor, a small private one
    inline as bytes, anything else as a tensor (torch's own sharing)."""
    block = pool.block_of(st) if pool is not None else None
    if block is not None and pool is not None:
        return _BlockHandover(block, pool)
    base = torch.empty(0, dtype=torch.uint8, device=device).set_(st)
    if base.device.type == "cpu" and st.nbytes() <= _INLINE and not st.is_shared():
        return base.numpy().tobytes()
    return base


def _land(bases: Sequence[Any], specs: Sequence[_Spec]) -> list[torch.Tensor]:
    """The tensors of a received batch, over its storages: a pool block's lease
    (``_attach_block``), inline bytes, or a tensor torch shared."""
    flat = [
        b if isinstance(b, torch.Tensor)
        else torch.frombuffer(bytearray(b), dtype=torch.uint8) if isinstance(b, bytes) and b
        else torch.empty(0, dtype=torch.uint8) if isinstance(b, bytes)
        else torch.frombuffer(b, dtype=torch.uint8)
        for b in bases
    ]  # each a 1-D uint8 tensor over its whole storage
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    out = []
    for k, offset, shape, stride, dtype in specs:
        base = typed.get((k, dtype))
        if base is None:
            base = flat[k]
            if dtype != torch.uint8:
                try:
                    base = base.view(dtype)
                except RuntimeError:  # a storage of a size no dtype element divides
                    st = base.untyped_storage()
                    out.append(torch.empty(0, dtype=dtype, device=st.device).set_(
                        st, offset, shape, stride))
                    continue
            typed[(k, dtype)] = base
        out.append(base.as_strided(shape, stride, offset))
    return out
