"""Fetching an object prefix's objects into the destination (staging/remote.py's
transfer): small objects by :class:`SmallGets`, GETs awaited on one event-loop thread
with many in flight, their bodies handed over in batches and written natively by writer
threads, a batch per call (:func:`write_bodies`, ``_core.write_objects``: create,
write, digests, times and the rename with the GIL released); objects over
:data:`WHOLE_UP_TO` and big ones by :class:`Fetcher`, a pool of threads whose ranged
GETs are written piece by piece as they stream in.

Every GET carries ``If-Match`` with the listed ETag and goes through the store's retry
policy; a body of another size than listed is an error naming its URL. Each file gets
the object's identity (its manifest tag) as the xattr :data:`MARK` before it is linked or
renamed into place: after a kill, a file whole at its name is taken for the listed object
only with that evidence (:func:`marked`), never on its size and time alone.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import queue
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

from .. import _core
from .._util import pwrite_all
from ..errors import stage_error
from ..sources.objlist import ObjectInfo, ObjectList, compact_identity
from ..sources.objstore import ObjectStore
from .state import Record

# Ranged GETs of big objects in flight (each holds a piece of its part at a time).
PARTS_IN_FLIGHT = 8
# Objects up to this size are fetched whole into one buffer; larger ones (and every part
# of a big one) are written piece by piece as they stream in.
WHOLE_UP_TO = 1 << 20
MODE = 0o644
# Bodies handed over at most in one batch (one native call writes them).
BATCH = 32
# Threads writing the batches (at most one per usable core).
WRITERS = 8
# How long a finished body may wait for others before its batch goes (seconds).
BATCH_WAIT = 0.005
# The extended attribute a fetched file carries from before it is in place: the object's
# identity (as the manifest's tag: an MD5's ETag as its 16 bytes).
MARK = "user.fastload.object"


def mark(path: Path, tag: bytes) -> None:
    """Records ``tag`` with the file ``path`` (a temporary, before it is renamed into
    place); nothing where the file system keeps no user attributes (the file is then
    not trusted after a kill: fetched again)."""
    with contextlib.suppress(OSError):
        os.setxattr(path, MARK, tag, follow_symlinks=False)


def marked(path: Path, size: int, mtime_ns: int, tag: bytes) -> bool:
    """Whether ``path`` is a regular file of ``size`` and ``mtime_ns`` that carries the
    mark ``tag``: one fetched whole for that very object and put in place."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_mtime_ns != mtime_ns:
            return False
        return os.getxattr(path, MARK, follow_symlinks=False) == tag
    except OSError:
        return False


class SmallGets:
    """Whole GETs of the objects ``rows`` of ``objs`` (each at most :data:`WHOLE_UP_TO`;
    an empty one needs no GET), ``in_flight`` at a time on one event-loop thread (no
    thread per request: a finished GET costs its coroutine a step, not a thread a GIL
    round trip). Finished bodies go to ``out`` as ``("bodies", [(row, body), ...])``
    batches; then ``("end", None)``, or ``("error", exc)`` after the batches finished
    before it. At most ``2 * in_flight`` bodies are fetched and not yet :meth:`taken`
    (memory bounded). Its event loop (and asyncio) is made where there is a small object
    to fetch: a prefix of big objects, or an archive, imports no asyncio."""

    def __init__(self, store: ObjectStore, objs: ObjectList, rows: Iterator[int],
                 in_flight: int, out: queue.SimpleQueue[Any]) -> None:  # fmt: skip
        self.store, self.objs, self.rows, self.out = store, objs, rows, out
        self.in_flight = max(1, in_flight)
        self.read_seconds = 0.0  # the GETs' waits, summed over those in flight
        self._ready: list[tuple[int, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room: asyncio.Semaphore | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        first = next(self.rows, None)
        if first is None:  # nothing to fetch: no loop, no thread
            self.out.put(("end", None))
            return
        self.rows = itertools.chain((first,), self.rows)
        import asyncio

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="fastload-gets", daemon=True)
        self._thread.start()

    def taken(self, n: int) -> None:
        """``n`` bodies handed over were written: room for as many more (any thread)."""
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
            self._loop.call_soon_threadsafe(self._free, n)

    def cancel(self) -> None:
        """Stops the GETs (any thread) and waits for the loop thread to end."""
        if self._loop is None or self._thread is None:  # never started, or nothing to get
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: it has ended
            self._loop.call_soon_threadsafe(self._stop)
        self._thread.join()

    def _free(self, n: int) -> None:
        assert self._room is not None
        for _ in range(n):
            self._room.release()

    def _stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    def _main(self) -> None:
        assert self._loop is not None
        try:
            self._loop.run_until_complete(self._run())
        finally:
            self._loop.close()

    async def _run(self) -> None:
        import asyncio  # (start() imported it)

        self._room = asyncio.Semaphore(2 * self.in_flight)
        self._task = asyncio.current_task()
        if self._stopped:  # cancelled before it began
            return
        flusher = asyncio.ensure_future(self._flush_every())
        workers = [asyncio.ensure_future(self._worker()) for _ in range(self.in_flight)]
        failed: BaseException | None = None
        try:
            await asyncio.gather(*workers)
        except asyncio.CancelledError:
            return
        except BaseException as e:  # the first error
            failed = e
        finally:
            for w in (*workers, flusher):
                w.cancel()
            await asyncio.gather(*workers, flusher, return_exceptions=True)
        self._flush()  # what finished before an error goes first
        self.out.put(("end", None) if failed is None else ("error", failed))

    async def _flush_every(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(BATCH_WAIT)
            self._flush()

    def _flush(self) -> None:
        if self._ready:
            self.out.put(("bodies", self._ready))
            self._ready = []

    async def _worker(self) -> None:
        objs, room = self.objs, self._room
        assert room is not None
        loop = self._loop
        assert loop is not None
        for i in self.rows:  # shared by the workers: one thread, no lock
            await room.acquire()
            size = objs.size[i]
            if size == 0:
                body: Any = b""
            else:
                t0 = loop.time()
                body = await self.store.get_async(objs.key_str(i), objs.etag(i))
                self.read_seconds += loop.time() - t0
                if len(body) != size:
                    key = objs.key_str(i)
                    url = f"{self.store.url.rstrip('/')}/{key}"
                    raise stage_error(errno.EIO, f"'{url}': got {len(body)} bytes, the "
                                      f"listing said {size}", key)  # fmt: skip
            self._ready.append((i, body))
            if len(self._ready) >= BATCH:
                self._flush()


def write_bodies(root: Path, items: list[tuple[str | bytes, Any, int, bytes]], stripe: int
                 ) -> list[bytes | OSError]:  # fmt: skip
    """``_core.write_objects`` of ``items`` (name under ``root``, body, mtime_ns, the
    mark recorded with the file before it is in place): per item its raw chunk digests,
    or the OSError naming its file."""
    out: list[bytes | OSError] = _core.write_objects(str(root), items, MODE, stripe)
    return out


def digests_hex(chunks: list[int]) -> str:
    return b"".join(d.to_bytes(8, "little") for d in chunks).hex()


class Fetcher:
    """Fetches objects into ``root`` with bounded memory; thread-safe counters: bytes
    done, and the seconds its threads waited for the store's bytes (``read_seconds``:
    GETs, their retries and backoff) and wrote them (``write_seconds``: the pwrites),
    each summed over the threads."""

    def __init__(self, store: ObjectStore, root: Path, stripe: int, workers: int) -> None:
        self.store, self.root, self.stripe = store, root, stripe
        self.small = ThreadPoolExecutor(workers, thread_name_prefix="fastload-get")
        self.parts = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="fastload-part")
        self.bytes_done = 0
        self.read_seconds = 0.0
        self.write_seconds = 0.0
        self.lock = threading.Lock()
        self.cancelled = False

    def count(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n

    def add_times(self, read: float, write: float) -> None:
        with self.lock:
            self.read_seconds += read
            self.write_seconds += write

    def _place(self, tmp: Path, final: Path, obj: ObjectInfo) -> None:
        os.utime(tmp, ns=(obj.mtime_ns, obj.mtime_ns))
        mark(tmp, compact_identity(obj.identity))
        os.replace(tmp, final)

    def _eio(self, obj: ObjectInfo, what: str) -> OSError:
        return stage_error(errno.EIO, f"'{self.store.url.rstrip('/')}/{obj.key}': {what}", obj.key)

    def fetch_mid(self, obj: ObjectInfo, final: Path) -> Record:
        """An object over :data:`WHOLE_UP_TO` and within a part: one GET, written as it
        streams in (as the parts of a big one are), renamed into place once whole."""
        if self.cancelled:
            raise InterruptedError
        return self._fetch_parts(obj, final, resumable=False)

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
            # The native writers' temporary name (".NAME.fl-tmp", hashed where too long)
            tmp = final.with_name(_core.temp_name(final.name))
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        streams: dict[int, Any] = {}
        got: dict[int, int] = {}
        # Per thread, of the part it fetches (its GET, then on_get, on that thread): the
        # seconds in the part's write callbacks (pwrite, digesting), and in its pwrites.
        inside: dict[int, list[float]] = {}
        lock = threading.Lock()
        fd = os.open(tmp, flags | os.O_CLOEXEC, MODE)

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
            self.add_times(time.monotonic() - t0 - callbacks, written)

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
            self.count(want)

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
        return Record(obj.size, obj.mtime_ns, MODE, digests_hex([have[k] for k in range(n_parts)]))

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
                    self.count(n)
        finally:
            os.close(fd)
        return good

    def close(self) -> None:
        self.small.shutdown(wait=True, cancel_futures=True)
        self.parts.shutdown(wait=True, cancel_futures=True)
