"""A zip extracted into the destination as a tree (:class:`ZipSource`, a
:class:`~fastload.staging.request.Source`): its central directory is the listing, its
members are planned against the destination like a tree's files (those whole there
already are done: a kill resumes member by member), and run_plan (tree.py) does the
rest: space, folders, the journal, links and folders' times, the manifest.

Members are read by ranges, a run of neighbours in one read (a pread, a ranged GET),
decoded on a pool of threads (zlib, bz2 and lzma release the GIL) and written a batch
per native call (``_core.write_objects``: a temporary linked or renamed into place,
digests, times, the GIL released); a member over :data:`BIG` is decoded and written in
pieces through a named temporary. Nothing of a member is at its final name before its
size and CRC-32 are checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import posixpath
import threading
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from .. import _core
from .._util import selected, usable_cores
from ..errors import ChecksumMismatchError, SourceChangedError, UnsupportedFileError
from .archive import suffix_kind
from .columns import DIR, FILE, LINK, Entry, Listing
from .destination import Destination
from .done import Done
from .engine import network_fs
from .job import PROGRESS_EVERY, ProgressCallback, digest_local
from .request import StageRequest
from .result import StageResult
from .state import JournalFlusher, JournalRecord, named_os_errors, quick_same
from .tree import TreePlan, plan_against, run_plan
from .zipformat import (
    LOCAL,
    LOCAL_SLACK,
    Member,
    ZipFormatError,
    ZipLimits,
    data_span,
    is_zip_name,
    read_directory,
    zip_error,
)
from .zipio import Decoder, ZipData, check_method, decode_whole

# Bytes of neighbouring members read at once (one pread or ranged GET).
SPAN = 4 << 20
# Members per batch at most (one native write call).
BATCH = 64
# Members larger than this (compressed or not) are decoded and written in pieces.
BIG = 32 << 20
PIECE = 4 << 20


class ZipSource:
    """A zip archive (local, in an object store, behind HTTP) staged as a tree."""

    def __init__(self, data: ZipData, req: StageRequest, limits: ZipLimits) -> None:
        self.data = data
        self.name = data.name
        self.label = posixpath.basename(data.name.rstrip("/")) or data.name
        self.limits = limits
        self.options: dict[str, Any] = {
            **req.selection(), "on_special": req.on_special, "file": False,
            "unpack": "nested" if req.nested else "zip", "zip": limits.as_json(),
        }  # fmt: skip
        self.members: list[Member] = []  # the files', in the order of the plan's files
        self.implicit: set[str] = set()  # folders no member names (left as made)
        # With unpack="nested" (zipnested.py): zip and tar members are left out of the listing,
        # kept here, and staged into their folders after.
        self.skip_inner = False
        self.inner: list[Member] = []
        self.read_seconds = 0.0
        self.write_seconds = 0.0
        self.read_bytes = 0  # of members' data (the central directory's not counted)
        self._lock = threading.Lock()

    # --- planning ------------------------------------------------------------------

    def listing(self, req: StageRequest) -> tuple[Listing, Listing]:
        """The selected members: (files, folders and links), each sorted by path."""
        d = read_directory(self.name, self.data.read_at, self.data.size, self.limits)
        files: list[tuple[bytes, Member]] = []
        others: dict[str, Entry] = {}
        for m in d.members:
            if not m.path:  # "./": the root itself
                continue
            if not selected(m.path, req.include, req.exclude):
                continue
            if m.kind == FILE and self.skip_inner and (is_zip_name(m.path)
                                                       or suffix_kind(m.path) is not None):
                self.inner.append(m)
                continue
            if m.kind == FILE:
                check_method(self.name, m)
                files.append((os.fsencode(m.path), m))
            elif m.kind == DIR:
                others[m.path] = Entry(m.path, DIR, 0, 0, m.mode, m.mtime_ns, "")
            else:
                target = self._link_target(m)
                if target is None:
                    continue
                others[m.path] = Entry(m.path, LINK, 0, 0, 0o777, m.mtime_ns, target)
        if (req.include or req.exclude) and not files and not others and not req.allow_empty:
            raise req.nothing_selected(self.name)
        for path in [*(m.path for _, m in files), *others]:
            parent = posixpath.dirname(path)
            while parent and parent not in others:
                others[parent] = Entry(parent, DIR, 0, 0, 0o755, 0, "")
                self.implicit.add(parent)
                parent = posixpath.dirname(parent)
        files.sort(key=lambda pm: pm[0])
        self.members = [m for _, m in files]
        flist = Listing.of(
            (m.path, FILE, m.usize, (m.usize + 511) // 512, m.mode, m.mtime_ns, "")
            for m in self.members
        )
        rest = Listing.of(sorted(others.values(), key=lambda e: os.fsencode(e[0])))
        return flist, rest

    def _link_target(self, m: Member) -> str | None:
        """A symbolic link's target (its data), refused (or skipped, with on_special
        "skip") where it leaves the tree."""
        if m.usize > 4096:
            raise zip_error(self.name, f"a symbolic link of {m.usize} bytes", m.path)
        check_method(self.name, m)
        body = bytes(self._read_member(m))
        target = body.decode("utf-8", "surrogateescape")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(m.path), target))
        if not target or "\0" in target or target.startswith("/") or resolved == ".." or \
                resolved.startswith("../"):  # fmt: skip
            if self._skip_special:
                return None
            e = UnsupportedFileError(
                errno.EPERM,
                f"'{self.name}', member '{m.path}': a symbolic link to '{target}' leaves "
                "the destination (refused; on_special='skip' skips it)",
            )
            e.filename = self.name
            raise e
        return target

    _skip_special = False
    fan_kind = "zip"  # fanout/run.py: fanned out by fanout/zips.py

    def shared_listing(self, req: StageRequest) -> tuple[Any, ...]:
        """The listing with what planning and finishing need beside it (the members, the
        implicit folders): what node 0 of a fan-out sends, for :meth:`plan`."""
        self._skip_special = req.on_special == "skip"
        files, rest = self.listing(req)
        return files, rest, self.members, self.implicit, self.inner

    def plan(self, req: StageRequest, dest: Destination, listing: Any = None) -> TreePlan:
        """Lists the members (or takes a :meth:`shared_listing`) and plans them against
        the destination."""
        self._skip_special = req.on_special == "skip"
        with dest.timed("listing"):
            if listing is None:
                files, rest = self.listing(req)
            else:
                files, rest, self.members, self.implicit, self.inner = listing
        with dest.timed("planning"):
            h = hashlib.sha256()
            h.update(json.dumps([self.name, list(map(str, self.data.identity)), self.options,
                                 req.stripe, "zip"], sort_keys=True).encode())  # fmt: skip
            files.digest_into(h)
            rest.digest_into(h)
            plan = plan_against(dest, rest, h.hexdigest(), files=files)
            journal = dest.journal
            if not plan.complete and journal.found and journal.same_boot and plan.todo:
                # Members an interrupted run put in place but had not journalled yet.
                self._adopt(req, dest, plan)
        return plan

    def _adopt(self, req: StageRequest, dest: Destination, plan: TreePlan) -> None:
        files = plan.files
        rehash = [i for i in plan.todo
                  if quick_same(dest.root / files.path(i), files.size[i], files.mtime_ns[i])]
        if not rehash:
            return
        got = digest_local(dest.root, [files[i] for i in rehash], req.engine, req.workers,
                           req.stripe)  # fmt: skip
        for i in rehash:
            rec = got.get(files.path(i))
            if rec is not None:
                plan.done.set(i, rec)
        plan.todo = array("q", (i for i in plan.todo if not plan.done.is_done(i)))

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        checksum = req.checksum
        if checksum is not None:
            self._check_checksum(checksum)
        plan = self.plan(req, dest)
        try:
            result = run_plan(self, dataclasses.replace(req, checksum=None), dest, plan)
        finally:
            if not self.skip_inner:  # (zipnested.py reads the inner zips after)
                self.data.close()
        return result

    def _check_checksum(self, checksum: tuple[str, str]) -> None:
        """The published checksum of the whole archive, read once before extracting."""
        h = hashlib.new(checksum[0])
        for off in range(0, self.data.size, 8 << 20):
            h.update(self.data.read_at(off, 8 << 20))
        if h.hexdigest() != checksum[1]:
            exc = ChecksumMismatchError(
                errno.EIO,
                f"checksum mismatch for '{self.name}': expected {checksum[0]}:{checksum[1]}, "
                f"got {checksum[0]}:{h.hexdigest()}; nothing was extracted",
            )
            exc.filename = self.name
            raise exc

    # --- the transfer (run_plan calls it) -------------------------------------------

    def _threads(self, req: StageRequest, dest: Destination) -> int:
        if req.workers:
            return max(1, req.workers)
        if isinstance(self.data.identity[0], str) and "://" in self.data.identity[0]:
            return 32  # ranged GETs: a round trip each
        with contextlib.suppress(OSError):
            path = Path(self.name)
            if network_fs(path):
                return 32
        return max(2, 2 * usable_cores())

    def _batches(self, rows: list[int]) -> Iterator[list[int]]:
        """Rows of the plan's files in runs of neighbours in the archive (one read
        each), a big member alone."""
        members = self.members
        rows = sorted(rows, key=lambda i: members[i].offset)
        run: list[int] = []
        for i in rows:
            m = members[i]
            if max(m.csize, m.usize) > BIG:
                yield [i]
                continue
            if run:
                first, last = members[run[0]], members[run[-1]]
                if (last.end != m.offset or len(run) >= BATCH
                        or m.end - first.offset > SPAN):  # fmt: skip
                    yield run
                    run = []
            run.append(i)
        if run:
            yield run

    def transfer(
        self,
        req: StageRequest,
        dest: Destination,
        plan: TreePlan,
        done: Done,
        flusher: JournalFlusher,
        on_progress: ProgressCallback | None,
    ) -> tuple[str, int, int]:
        files, todo = plan.files, plan.todo
        total_bytes, nfiles = plan.total_bytes, len(files)
        base_bytes, base_files = done.total_bytes, len(done)
        copied = [0, 0]
        if not todo:
            if on_progress is not None:
                on_progress(total_bytes, total_bytes, nfiles, nfiles)
            return "none", 0, 0
        threads = self._threads(req, dest)
        pool = ThreadPoolExecutor(threads, thread_name_prefix="fastload-unzip")
        batches = self._batches(list(todo))
        pending: set[Future[list[tuple[int, bytes]]]] = set()
        umask = _umask()
        failed: BaseException | None = None

        def collect(got: list[tuple[int, bytes]]) -> None:
            """Journals a finished batch (a partly failed one's whole members, then its
            error)."""
            records: list[JournalRecord] = []
            for i, digests in got:
                m = self.members[i]
                records.append((os.fsencode(m.path), m.usize, m.mtime_ns, m.mode, digests))
                copied[1] += m.usize
            done.set_listed([i for i, _ in got], [d for _, d in got])
            copied[0] += len(got)
            flusher.add(records)
            if isinstance(got, _PartialBatch):
                raise got.error

        try:
            while True:
                while failed is None and len(pending) < 2 * threads:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    pending.add(pool.submit(self._extract, dest.root, batch, req.stripe, umask))
                if not pending:
                    break
                finished, pending = wait(pending, timeout=PROGRESS_EVERY,
                                         return_when=FIRST_COMPLETED)  # fmt: skip
                for fut in finished:
                    try:
                        collect(fut.result())
                    except BaseException as e:
                        failed = failed or e
                if failed is not None:
                    for fut in pending:
                        fut.cancel()
                if on_progress is not None:
                    on_progress(base_bytes + copied[1], total_bytes, base_files + copied[0],
                                nfiles)  # fmt: skip
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            dest.add_time("reading", self.read_seconds)
            dest.add_time("writing", self.write_seconds)
        if failed is not None:
            # A member that does not match its entry in a zip modified since it was
            # listed: the source changed (stage again), not a broken archive.
            changed = False
            if isinstance(failed, ZipFormatError):
                with contextlib.suppress(OSError):  # (unreachable: the member's error)
                    changed = self.data.changed()
            if changed:
                raise self._changed() from failed
            raise failed
        if self.data.changed():
            raise self._changed()
        return "zip", copied[0], copied[1]

    def _changed(self) -> SourceChangedError:
        e = SourceChangedError(
            errno.EIO,
            f"source file changed: '{self.name}' was modified while it was being "
            "extracted; stage again to pick up the new content",
        )
        e.filename = self.name
        return e

    def _timed(self, read: float, write: float, nbytes: int = 0) -> None:
        with self._lock:
            self.read_seconds += read
            self.write_seconds += write
            self.read_bytes += nbytes

    def _read_member(self, m: Member) -> Any:
        """One member's data decoded and checked (a link's target)."""
        head = self.data.read_at(m.offset, LOCAL.size + len(m.raw_name) + LOCAL_SLACK + m.csize)
        start, end = data_span(self.name, m, head)
        if len(head) < end:
            head = self.data.read_at(m.offset, end)
        if len(head) < end:
            raise zip_error(self.name, "truncated data", m.path)
        return decode_whole(self.name, m, memoryview(head)[start:end])

    def _extract(self, root: Path, rows: list[int], stripe: int, umask: int
                 ) -> list[tuple[int, bytes]]:  # fmt: skip
        """On a pool thread: the members of ``rows`` (neighbours) read in one go,
        decoded, checked and written; returns each one's row and digests."""
        members = self.members
        if len(rows) == 1 and max(members[rows[0]].csize, members[rows[0]].usize) > BIG:
            return [(rows[0], self._extract_big(root, members[rows[0]], stripe, umask))]
        first, last = members[rows[0]], members[rows[-1]]
        t0 = time.monotonic()
        want = min(last.end, last.offset + LOCAL.size + len(last.raw_name) + LOCAL_SLACK
                   + last.csize) - first.offset  # fmt: skip
        span = memoryview(self.data.read_at(first.offset, want))
        t1 = time.monotonic()
        nread = len(span)
        bodies: dict[int, list[tuple[bytes, Any, int, int]]] = {}
        for i in rows:
            m = members[i]
            at = m.offset - first.offset
            start, end = data_span(self.name, m, span[at : at + LOCAL.size + len(m.raw_name)
                                                      + LOCAL_SLACK])  # fmt: skip
            if at + end <= len(span):
                data: Any = span[at + start : at + end]
            else:
                data = memoryview(self.data.read_at(m.offset + start, m.csize))
                nread += len(data)
                if len(data) != m.csize:
                    raise zip_error(self.name, f"truncated: {len(data)} of its {m.csize} "
                                    "bytes of data", m.path)  # fmt: skip
            body = decode_whole(self.name, m, data)
            bodies.setdefault(m.mode, []).append((os.fsencode(m.path), body, m.mtime_ns, i))
        out: list[tuple[int, bytes]] = []
        failed: OSError | None = None
        for mode, items in bodies.items():
            got = _core.write_objects(str(root), [it[:3] for it in items], mode, stripe)
            for it, res in zip(items, got, strict=True):
                if isinstance(res, OSError):
                    failed = failed or res
                    continue
                if mode & umask:
                    os.chmod(os.path.join(root, os.fsdecode(it[0])), mode)
                out.append((it[3], res))
        self._timed(t1 - t0, time.monotonic() - t1, nread)
        if failed is not None:
            if out:  # the others are whole: journal them, then fail
                return _PartialBatch(out, failed)
            raise failed
        return out

    def _extract_big(self, root: Path, m: Member, stripe: int, umask: int) -> bytes:
        """A big member decoded and written in pieces through a named temporary,
        renamed into place once whole and checked."""
        head = self.data.read_at(m.offset, LOCAL.size + len(m.raw_name) + LOCAL_SLACK)
        start, _end = data_span(self.name, m, head)
        final = root / m.path
        tmp = final.with_name(_core.temp_name(final.name))
        dec = Decoder(self.name, m)
        digests: list[int] = []
        stream, in_stripe = _core.Fl64Stream(), 0
        with named_os_errors():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            pos, off = m.offset + start, 0
            left = m.csize
            while left > 0 or off == 0:
                piece = self.data.read_at(pos, min(PIECE, left)) if left else b""
                if left and not len(piece):
                    raise zip_error(self.name, "truncated data", m.path)
                pos, left = pos + len(piece), left - len(piece)
                self._timed(0.0, 0.0, len(piece))
                out = memoryview(dec.feed(piece))
                while len(out):
                    n = min(len(out), stripe - in_stripe)
                    stream.update(out[:n])
                    os.pwrite(fd, out[:n], off)
                    off, in_stripe, out = off + n, in_stripe + n, out[n:]
                    if in_stripe == stripe:
                        digests.append(stream.digest())
                        stream, in_stripe = _core.Fl64Stream(), 0
                if not left:
                    break
            dec.end()
            if in_stripe or not digests:
                digests.append(stream.digest())
            os.fchmod(fd, m.mode)
            os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        with named_os_errors():
            os.rename(tmp, final)
        del umask
        return b"".join(d.to_bytes(8, "little") for d in digests)

    def finish(self, plan: TreePlan, dest: Destination) -> None:
        """Links, then the named folders' modes and times, deepest first."""
        from .tree import _place_link

        with named_os_errors("cannot finish staging: "):
            for i in sorted(plan.entries.targets):
                _place_link(dest.root / plan.entries.path(i), plan.entries[i])
            dirs = sorted((e for e in plan.entries.of_kind(DIR) if e.path not in self.implicit),
                          key=lambda e: e.path.count("/"), reverse=True)  # fmt: skip
            for e in dirs:
                d = dest.root / e.path
                os.chmod(d, e.mode)
                os.utime(d, ns=(e.mtime_ns, e.mtime_ns))

    def extra(self, plan: TreePlan) -> dict[str, Any]:
        return {"archive": {"compression": "zip", "nested": False, "size": self.data.size,
                            "identity": str(self.data.identity[2]), "checksum": None}}


class _PartialBatch(list):  # type: ignore[type-arg]
    """A batch some of whose members were written and one failed."""

    def __init__(self, done: list[tuple[int, bytes]], error: OSError) -> None:
        super().__init__(done)
        self.error = error


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
