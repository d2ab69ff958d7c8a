"""What staging keeps beside a destination: the node lock, the journal, the manifest.

For a destination ``/tmp/x/imagenet`` they are ``/tmp/x/.imagenet.fastload.lock`` and the
directory ``/tmp/x/.imagenet.fastload/`` (``manifest.json``, ``journal.bin``), so the
dataset directory itself holds nothing but the data (an ``ImageFolder`` would take a
hidden directory inside it for a class).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Union

from .. import _core
from .._util import check_space as _check_space
from .._util import node_lock, write_json_atomic
from ..errors import StageError, stage_error
from .columns import FileTable
from .columns import Record as Record  # re-exported: the journal's and manifest's records
from .columns import Records as Records

MANIFEST_VERSION = 2  # manifest.json a header, the files in a table beside it (issue 38)
READABLE_VERSIONS = (1, 2)  # 1: every file's record in manifest.json itself


def state_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.fastload"


def read_manifest(dst: Path) -> dict[str, Any] | None:
    """The manifest's header with its files (``"files"``: a :class:`FileTable`, mapped
    from the table file it names; a version 1 manifest's are converted), or None where
    there is none, or it is torn or of an unknown version."""
    d = state_dir(dst)
    try:
        with open(d / "manifest.json", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # unreadable or torn: treated as absent, the stage redoes what it must
    if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
        return None
    try:
        if data["version"] == 1:
            files = FileTable.of_rows((p, *r) for p, r in data.get("files", {}).items())
        else:
            files = FileTable.read(d / str(data["table"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {**data, "files": files}


def write_manifest(dst: Path, header: dict[str, Any], files: FileTable) -> None:
    """Writes the file table under a new name, then the header naming it (both fsynced and
    renamed into place), then drops older tables: a crash leaves one whole pair."""
    d = state_dir(dst)
    d.mkdir(exist_ok=True)
    name = f"files-{os.getpid()}-{time.time_ns()}.bin"
    files.write(d / name)
    head = {k: v for k, v in header.items() if k != "files"}
    write_json_atomic(d / "manifest.json", {**head, "version": MANIFEST_VERSION, "table": name})
    for old in d.glob("files-*.bin"):
        if old.name != name:
            with contextlib.suppress(OSError):
                old.unlink()


def write_header(dst: Path, manifest: dict[str, Any]) -> None:
    """Rewrites the header of a manifest read by :func:`read_manifest` (its table kept;
    a version 1 manifest's files are written into a table first)."""
    if manifest.get("version") != MANIFEST_VERSION or "table" not in manifest:
        write_manifest(dst, manifest, manifest["files"])
        return
    head = {k: v for k, v in manifest.items() if k != "files"}
    write_json_atomic(state_dir(dst) / "manifest.json", head)


def previous_stage(dst: Path) -> dict[str, Any] | None:
    """The manifest as a new stage() may use it. Files that :func:`verify` found changed
    or missing (``damaged``) are dropped from it, and it no longer matches any source, so
    the stage re-copies exactly those files."""
    m = read_manifest(dst)
    if m is None or not m.get("damaged"):
        return m
    return {**m, "files": m["files"].without(m["damaged"]), "fingerprint": None}


def mark_damaged(dst: Path, manifest: dict[str, Any], paths: list[str]) -> bool:
    """Records in the manifest (if it is still the one ``manifest`` was read from) the
    paths :func:`verify` found changed or missing, so the next stage() repairs them.
    False where the manifest cannot be written (a read-only destination)."""
    try:
        with node_lock(dst):
            current = read_manifest(dst)
            if current is None or current.get("created") != manifest.get("created"):
                return False
            write_header(dst, {**current, "damaged": sorted(set(paths))})
    except OSError:
        return False
    return True


def boot_id() -> str:
    """Changes at every boot: tells a crash of the process (page cache intact) from a
    power loss or reboot (data not yet flushed may be lost)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def trusted(record: dict[str, Any]) -> bool:
    """Whether the files a manifest (or journal header) describes can be taken as whole
    without reading them back: they were flushed to disk before it was written
    (``durable``), or it was written since the last boot, so whatever was not flushed
    yet is still in the page cache. Manifests of versions that always flushed have no
    ``durable`` key."""
    if record.get("durable", "boot_id" not in record):
        return True
    return bool(record.get("boot_id")) and record.get("boot_id") == boot_id()


def reread(
    root: Path,
    dst: Path,
    manifest: dict[str, Any] | None,
    fingerprint: str,
    prove: Callable[[Records], Records],
) -> tuple[dict[str, Any] | None, bool]:
    """The previous manifest as far as it can be trusted, and whether all of it can.

    A complete manifest written on an earlier boot without a flush keeps only the files
    of ``root`` read back whole (``prove``) and is marked durable (they came from the
    disk); when every file and link was, and it is for this ``fingerprint``, it is
    rewritten so (``dst``'s state). Any other manifest is returned as it is."""
    if manifest is None or not manifest.get("complete") or trusted(manifest):
        return manifest, True
    files = dict(manifest["files"].items())
    proven = prove(files)
    whole = len(proven) == len(files) and all(
        os.path.islink(root / p) and os.readlink(root / p) == t
        for p, t in manifest.get("symlinks", {}).items()
    )
    table = FileTable.of(proven)
    del proven
    manifest = {**manifest, "files": table, "durable": True, "boot_id": boot_id()}
    if whole and manifest.get("fingerprint") == fingerprint:
        write_manifest(dst, manifest, table)
    return manifest, whole


JOURNAL = "journal.bin"
OLD_JOURNAL = "journal.jsonl"  # one JSON line per file: an older version's, still read
JOURNAL_MAGIC = b"FLJOURN1"
_LEN = struct.Struct("<I")
_FRAME = struct.Struct("<II")  # the body's bytes, its CRC-32
_REC = struct.Struct("<qqIII")  # size, mtime_ns, mode, path bytes, digest bytes
_FRAME_RECORDS = 4096  # records per frame when a journal is opened with many
# A journal record: path, size, mtime_ns, mode, digests (the path as str or its bytes,
# the digests as hex or raw: the tree copy hands both over raw, as the copier made them).
JournalRecord = tuple[Union[str, bytes], int, int, int, Union[str, bytes]]


def _frame(records: Iterable[JournalRecord]) -> bytes:
    """Records as one frame: its length and CRC, then each record's fixed part, path and
    raw digests."""
    body = bytearray()
    for p, size, mtime, mode, digests in records:
        path = p if isinstance(p, bytes) else os.fsencode(p)
        dig = bytes.fromhex(digests) if isinstance(digests, str) else digests
        body += _REC.pack(size, mtime, mode, len(path), len(dig))
        body += path
        body += dig
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


class Journal:
    """Files known to be complete at their final path, appended as they finish.

    ``journal.bin``: a header (magic, then its JSON: chunk size, boot, durable), then
    frames, one per batch of records (each flush of the flusher): a frame's length and
    CRC-32, then per file a fixed record (size, time, mode, path and digest lengths), its
    path and its raw digests: about 36 bytes besides the path, where a JSON line took
    about 60. A frame torn by a kill (short, or failing its CRC) ends the journal:
    everything before it is good. An older version's ``journal.jsonl`` is still read.

    With ``durable``, a record is written only after the data it describes was flushed
    to disk (syncfs), so after a power loss every journalled file is whole. Without it
    (the default: staging does not wait for the disk), the records are ``trusted`` only
    on the boot that wrote them; after a reboot the caller reads the files back and
    compares their digests. Files renamed into place but not yet journalled are trusted
    only if the machine has not rebooted since (``same_boot``): a killed process loses
    nothing of what it wrote.
    """

    def __init__(self, dst: Path, chunk_size: int, durable: bool = False) -> None:
        self.path = state_dir(dst) / JOURNAL
        self.chunk_size = chunk_size
        self.durable = durable
        self.found = False  # a journal of an interrupted run was there
        self.same_boot = False  # ... and was written since the last boot
        self.trusted = False  # ... and its records need not be read back
        self._f: Any | None = None

    def load(self) -> Records:
        """path -> (size, mtime_ns, mode, digests_hex) of the previous, interrupted run."""
        return {os.fsdecode(p): Record(s, m, md, d.hex()) for p, s, m, md, d in self._raw()}

    def has_records(self) -> bool:
        """Whether the interrupted run's journal holds a record."""
        return next(self._raw(), None) is not None

    def table(self) -> FileTable:
        """:meth:`load` as a table (a few tens of bytes per record)."""
        return FileTable.of_rows(self._raw())

    def rows(self) -> Iterator[tuple[str, int, int, int, str]]:
        """The records of the previous, interrupted run, read a frame at a time: (path,
        size, mtime_ns, mode, digests_hex); a path recorded twice, last wins."""
        for p, s, m, md, d in self._raw():
            yield os.fsdecode(p), s, m, md, d.hex()

    def _header(self, header: Any) -> bool:
        if not isinstance(header, dict) or header.get("chunk_size") != self.chunk_size:
            return False
        self.found = True
        self.same_boot = bool(header.get("boot_id")) and header.get("boot_id") == boot_id()
        self.trusted = trusted(header)
        return True

    def _raw(self) -> Iterator[tuple[bytes, int, int, int, bytes]]:
        """The records as (path, size, mtime_ns, mode, digests), encoded and raw."""
        try:
            f = open(self.path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            yield from self._old_rows()
            return
        with f:
            head = f.read(len(JOURNAL_MAGIC) + _LEN.size)
            if len(head) < len(JOURNAL_MAGIC) + _LEN.size or not head.startswith(JOURNAL_MAGIC):
                return
            (n,) = _LEN.unpack_from(head, len(JOURNAL_MAGIC))
            try:
                header = json.loads(f.read(n))
            except ValueError:
                return
            if not self._header(header):
                return
            while len(fixed := f.read(_FRAME.size)) == _FRAME.size:
                size, crc = _FRAME.unpack(fixed)
                body = f.read(size)
                if len(body) != size or zlib.crc32(body) != crc:
                    return  # a torn last frame: everything before it is good
                pos = 0
                while pos < size:
                    fsize, mtime, mode, np, nd = _REC.unpack_from(body, pos)
                    pos += _REC.size
                    yield body[pos : pos + np], fsize, mtime, mode, body[pos + np : pos + np + nd]
                    pos += np + nd

    def _old_rows(self) -> Iterator[tuple[bytes, int, int, int, bytes]]:
        """An older version's journal (one JSON line per file), a line at a time."""
        try:
            f = open(self.path.with_name(OLD_JOURNAL), encoding="utf-8",  # noqa: SIM115
                     errors="surrogateescape")  # fmt: skip
        except FileNotFoundError:
            return
        with f:
            try:
                header = json.loads(f.readline() or "null")
            except ValueError:
                return
            if not self._header(header):
                return
            for line in f:
                try:
                    p, size, mtime, mode, digests = json.loads(line)
                except ValueError:
                    return  # a torn last line: everything before it is good
                yield os.fsencode(p), size, mtime, mode, bytes.fromhex(digests)

    def open(self, keep: Mapping[str, Record]) -> None:
        """Starts a fresh journal holding ``keep`` (what is already known to be done)."""
        self.path.parent.mkdir(exist_ok=True)
        tmp = self.path.with_name(JOURNAL + ".tmp")
        table = keep.table() if hasattr(keep, "table") else FileTable.of(keep)
        with open(tmp, "wb") as f:
            header = {"chunk_size": self.chunk_size, "boot_id": boot_id(), "durable": self.durable}
            text = json.dumps(header).encode()
            f.write(JOURNAL_MAGIC + _LEN.pack(len(text)) + text)
            for start in range(0, len(table), _FRAME_RECORDS):
                rows = range(start, min(start + _FRAME_RECORDS, len(table)))
                f.write(_frame((table._key(i), table.size[i], table.mtime_ns[i], table.mode[i],
                                table.digest(i)) for i in rows))  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        with contextlib.suppress(FileNotFoundError):
            self.path.with_name(OLD_JOURNAL).unlink()
        self._f = open(self.path, "ab")  # noqa: SIM115 (closed by close())

    def append(self, records: Sequence[JournalRecord]) -> None:
        """One frame of ``records``, written with one write."""
        assert self._f is not None
        if records:
            try:
                self._f.write(_frame(records))
                self._f.flush()
            except OSError as e:  # (a full disk: its error names the journal)
                e.filename = e.filename or str(self.path)
                raise

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()  # (closed even where its last flush fails)
            except OSError as e:
                e.filename = e.filename or str(self.path)
                raise

    def remove(self) -> None:
        self.close()
        for name in (JOURNAL, OLD_JOURNAL):
            with contextlib.suppress(FileNotFoundError):
                self.path.with_name(name).unlink()


def known_records(
    journal: Journal,
    old: dict[str, Any] | None,
    chunk_size: int,
    prove: Callable[[Records], Records],
) -> Records:
    """What is already in place: the interrupted run's journal, then the previous
    complete manifest's files (a re-stage after the source changed redoes only the
    changes). Records written on an earlier boot without a flush are read back first
    (``prove`` keeps those whose files are whole)."""
    known = journal.load()
    if known and not journal.trusted:
        known = prove(known)
    if old is not None and old.get("chunk_size") == chunk_size:
        previous = dict(old["files"].items())
        if not trusted(old):
            previous = prove({p: r for p, r in previous.items() if p not in known})
        for p, r in previous.items():
            known.setdefault(p, r)
    return known


def known_table(
    journal: Journal,
    old: dict[str, Any] | None,
    chunk_size: int,
    prove: Callable[[Records], Records],
) -> FileTable:
    """:func:`known_records` as a table: what a tree stage plans against, a few tens of
    bytes per file (records read back first are the rare case of an earlier boot)."""
    known = journal.table()
    if len(known) and not journal.trusted:
        known = FileTable.of(prove(dict(known.items())))
    if old is not None and old.get("chunk_size") == chunk_size:
        previous: FileTable = old["files"]
        if not trusted(old):
            previous = FileTable.of(prove(dict(previous.without(known).items())))
        known = known.union(previous) if len(known) else previous
    return known


class JournalFlusher:
    """Appends finished files to a journal from a background thread; for a durable
    journal, each batch only after a syncfs of the destination made its data durable.

    syncfs waits for the file system's writeback, which can take seconds on a busy disk;
    done on the thread that feeds the copy or the extraction, it would stall it.
    """

    def __init__(self, journal: Journal, sync_path: str, every: float = 1.0) -> None:
        self._journal = journal
        self._sync_path = sync_path
        self._syncfs = _core.syncfs
        self._every = every
        self._pending: list[JournalRecord] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fastload-journal", daemon=True)
        self._thread.start()

    def add(self, records: Sequence[JournalRecord]) -> None:
        if records:
            with self._lock:
                self._pending.extend(records)

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            if self._journal.durable:
                self._syncfs(self._sync_path)  # every file of the batch is on disk after this
            self._journal.append(batch)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._every)
            self._wake.clear()
            try:
                self._flush()
            except BaseException as e:  # reported by close()
                self._error = e
                return
            if self._stop:
                return

    def close(self) -> None:
        """Flushes what is pending and stops the thread; raises a flush error."""
        self._stop = True
        self._wake.set()
        self._thread.join()
        if self._error is None:
            self._flush()
        if self._error is not None:
            raise self._error


# --- the destination itself -----------------------------------------------------


@contextlib.contextmanager
def named_os_errors(what: str = "") -> Iterator[None]:
    """Turns an OSError that the native core did not already name into a StageError that
    keeps errno and names the path (``what`` says what was being done)."""
    try:
        yield
    except StageError:
        raise
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO, f"{what}{e.strerror or e}: '{e.filename}'", e.filename
        ) from e


def mkdir_parent(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO,
            f"cannot create destination directory '{path}': {e.strerror}",
            str(path),
        ) from None


def check_space(dst_parent: Path, needed: int, target: Path) -> None:
    _check_space(dst_parent, needed, f"to stage into '{target}'", target)


def ensure_writable(d: Path) -> None:
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise stage_error(errno.ENOTDIR, f"'{d}' exists and is not a directory", str(d))
    if st.st_mode & 0o700 != 0o700:
        os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)


def quick_same(path: Path, size: int, mtime_ns: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_mtime_ns == mtime_ns


def make_durable(dst: Path, manifest: dict[str, Any], sync: bool) -> None:
    """With ``sync``, flushes a complete stage that was not, and says so in its manifest."""
    if sync and not manifest.get("durable", True):
        root = dst.parent if manifest.get("kind") == "file" else dst
        _core.syncfs(str(root))
        write_header(dst, {**manifest, "durable": True})

