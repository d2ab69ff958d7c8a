"""stage(): copy a file or a tree to node-local disk, fast, resumably, once per node.

The flow (see DESIGN.md): take the node lock beside the destination; list the source in
parallel; return at once if a complete manifest matches it; work out what a previous,
interrupted run already finished (the journal); check free space; run the native copier
(many files in flight, big files in stripes, digests on the way), journalling completed
files; then set directory metadata, create symlinks and write the manifest, atomically.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Union, overload

from .. import _core
from ..errors import stage_error
from ..sources import is_store_url
from ..sources.base import scheme_of
from ..sources.retry import process_retries
from .columns import FileTable
from .destination import Destination, stage_into
from .job import Patterns, Progress, ProgressCallback, copy_options, progress_callback, run_job
from .request import Source, StageRequest, is_stream
from .result import StageResult, VerifyResult
from .state import mark_damaged, mkdir_parent, named_os_errors, read_manifest, state_dir
from .tree import LocalTree

if TYPE_CHECKING:
    from .background import Staging

__all__ = ["StageResult", "VerifyResult", "available_engines", "stage", "verify"]

PathLike = Union[str, "os.PathLike[str]"]


def available_engines() -> list[str]:
    """The I/O backends that work here, best first."""
    return ["uring", "pread"] if _core.uring_available() else ["pread"]


@overload
def stage(
    src: PathLike | BinaryIO | int, dst: PathLike, *, wait: Literal[True] = ..., **options: Any
) -> StageResult: ...
@overload
def stage(
    src: PathLike | BinaryIO | int, dst: PathLike, *, wait: Literal[False], **options: Any
) -> Staging: ...
@overload
def stage(
    src: PathLike | BinaryIO | int, dst: PathLike, *, wait: bool, **options: Any
) -> StageResult | Staging: ...


# The overloads say what comes back (a handle with wait=False); the options are the
# implementation's keywords, checked by StageRequest.make.
def stage(  # type: ignore[misc]
    src: PathLike | BinaryIO | int,
    dst: PathLike,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    engine: str = "auto",
    progress: Progress = None,
    workers: int | None = None,
    stripe_size: int | None = None,
    on_special: Literal["error", "skip"] = "error",
    check_source: bool | Literal["strict"] = True,
    unpack: bool | Literal["auto", "nested"] = "auto",
    checksum: str | None = None,
    sync: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    repair: bool = False,
    fanout: bool | Any = False,
    allow_empty: bool = False,
    stats: bool = False,
    zip_options: Mapping[str, Any] | None = None,
    wait: bool = True,
) -> StageResult | Staging:
    """Copies a file or a directory tree to ``dst`` (node-local disk), fast and resumably,
    or extracts a tar archive (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.zst``) or a zip
    (``.zip``, also an ``s3://`` or ``http(s)://`` one, read by ranges: docs/zip.md) into
    ``dst``.

    A directory's contents land in ``dst`` (like ``cp -r src/. dst``). A file lands at
    ``dst``, or inside it if ``dst`` is an existing directory. An archive's members land
    in the directory ``dst``. ``src`` may also be a tar stream, plain, gzip or zstd (told
    by its first bytes): ``"-"`` (stdin, as ``fastload stage - DST``), a binary file
    object (``sys.stdin.buffer``) or a pipe's file descriptor, read once, in order; a
    stream is read again on every call, members already staged are not rewritten.

    Args:
        unpack: for a tar archive, ``"auto"``/``True`` extracts it in one streaming pass
            (``True`` also insists that ``src`` is one), ``"nested"`` also extracts
            members that are tars (``n01440764.tar`` -> ``dst/n01440764/...``) from the
            same stream, ``False`` copies the archive file as it is.
        checksum: ``"sha256:<hex>"`` or ``"md5:<hex>"`` of the archive (or file), checked
            in the same pass; a mismatch raises :class:`ChecksumMismatchError` and the
            output is not marked complete.
        include: glob patterns on paths relative to ``src`` (``*`` also matches ``/``; a
            pattern without ``/`` also matches the base name): only the paths matching.
        exclude: glob patterns as ``include``: the paths left out.
        engine: ``"auto"`` (a pool of pread threads for a source on a network or FUSE
            file system, else io_uring where it can be set up, else the pool), ``"uring"``
            or ``"pread"``; ``FASTLOAD_ENGINE`` overrides ``"auto"``.
        progress: ``True`` for a progress bar, or ``cb(bytes_done, bytes_total,
            files_done, files_total)`` called a few times a second.
        workers: files (or objects) in flight at once (default: by the storage, as
            ``fastload probe`` reports it: 16 per core on a local disk, more on a
            network file system by its latency, 64 objects from a store).
        stripe_size: bytes per stripe of a big file, and per digest chunk (default 16 MiB).
        on_special: what to do with devices, FIFOs, sockets and symlinks leaving the
            tree: ``"error"`` (default) or ``"skip"``.
        check_source: list the source again to see whether it changed since the last
            complete stage (default); where an object store cannot be reached, a complete
            copy staged before is used as it is, with a one-line warning. ``False`` trusts
            a complete manifest for this source; ``"strict"`` fails where the source
            cannot be checked.
        allow_empty: stage nothing without an error where the source holds nothing to
            stage (a prefix with no objects, include patterns that match nothing);
            by default that is a FileNotFoundError naming the URL or the patterns.
        stats: say where the time went: ``result.stats`` (a
            :class:`~fastload.staging.result.StageStats`) holds the time waiting for
            the node lock, before the first byte (listing, planning), copying, the CPU
            time, and bytes and files done a few times a second (``stats.rates()``).
        zip_options: for a zip: ``max_size`` (uncompressed bytes at most), ``max_ratio``
            (a member's expansion at most, default 10000) and ``encoding`` (of names not
            flagged UTF-8; default unzip's rule: CP437 for zips made on DOS or Windows,
            the bytes as stored for others); see docs/zip.md. ``unpack="nested"`` on a
            directory extracts each zip in it into a folder of its name without ``.zip``.
        repair: read back what an earlier stage put in ``dst`` first (:func:`verify`),
            and re-copy whatever differs or is missing (a stage after a failed verify
            does that too).
        storage_options: for object store URLs: ``endpoint_url``, ``profile``,
            ``anonymous``, ``region``, credentials (overriding ``AWS_*`` variables and
            ``~/.aws``); see :mod:`fastload.sources.objstore`.
        sync: flush the staged data to disk before returning. By default ``stage()``
            returns once every file is whole in the page cache, as ``cp``, ``tar`` and
            ``rsync`` do, and the disk catches up while the job starts (a node's
            ``$SLURM_TMPDIR`` does not outlive the job anyway). The manifest records the
            boot: after a reboot (a power loss may have cut the writeback), the next
            ``stage()`` reads the files back and checks their digests before trusting
            them, and redoes only those that differ.
        fanout: on a job that spans several nodes, stage once per node while the source
            is read about once in total: the nodes' first processes (their leaders)
            each read a share (balanced by bytes; big files and archives cut in pieces, a
            zip's members dealt whole: docs/zip.md)
            and exchange it over ``torch.distributed`` (a gloo group: TCP, no GPU or MPI
            needed) or MPI, so every node writes the whole dataset to its own ``dst``.
            Every process of the job calls stage() alike; the job's torch process group
            is used if initialised (or pass one as ``fanout=``), else MPI's world where an
            MPI launcher (mpiexec, srun --mpi=pmi2) started the job and mpi4py is installed
            (or pass a communicator), else a gloo group made from torchrun's or SLURM's
            variables; ``fanout="torch"`` or ``"mpi"`` forces a transport. A node's other
            processes wait on its lock. A single node or process stages as without it. A
            node that fails or stops answering stops the others within
            ``FASTLOAD_FANOUT_TIMEOUT`` seconds (default 300) with an error naming it; a
            rerun fetches only what each node lacks.

        wait: ``False`` returns at once a :class:`~fastload.staging.background.Staging`
            handle on the stage, run in the background by the node's first caller (the
            others' handles share it); files are read through it while it stages
            (``handle.open(relpath)``), see docs/read-while-staging.md.

    Returns:
        A :class:`StageResult`; ``skipped`` is True when nothing had to be copied
        (``wait=False``: the handle).

    Raises:
        FileNotFoundError: the source is missing (also a :class:`StageError`).
        NotEnoughSpaceError: the destination cannot hold the data (checked first).
        SourceChangedError: a file changed while it was copied.
        UnsupportedFileError: a special file or an escaping symlink, unless skipped.
        StageError: any other failure, naming the path; the destination stays resumable.
    """
    req = StageRequest.make(
        include=include, exclude=exclude, checksum=checksum, stripe_size=stripe_size,
        engine=engine, progress=progress, workers=workers, on_special=on_special,
        check_source=check_source, unpack=unpack, sync=sync,
        storage_options=storage_options, fanout=fanout, allow_empty=allow_empty,
        stats=stats, zip_options=zip_options,
    )  # fmt: skip
    if not wait:
        if repair or fanout is not False:
            raise ValueError("stage(wait=False) stages on one node: no repair= or fanout=")
        from .background import stage_in_background

        return stage_in_background(src, dst, dict(
            include=include, exclude=exclude, checksum=checksum, stripe_size=stripe_size,
            engine=engine, progress=progress, workers=workers, on_special=on_special,
            check_source=check_source, unpack=unpack, sync=sync,
            storage_options=storage_options, allow_empty=allow_empty, stats=stats,
            zip_options=zip_options,
        ), open_source)  # fmt: skip
    if repair and read_manifest(Path(os.path.abspath(os.fspath(dst)))) is not None:
        verify(dst, engine=engine, workers=workers, progress=progress)
    retried = process_retries().snapshot()  # the source's listing retries count too
    with named_os_errors():
        source, dest = open_source(src, dst, req)
        # (dest.req: the request as the source took it: a zip's may drop fanout)
        return stage_into(dest, source, retried, _fanned(dest.req))


def _fanned(req: StageRequest) -> Callable[[Any, Destination], StageResult] | None:
    """The runner of a stage fanned out over the job's nodes (``fanout=``), else None:
    fanout/ is imported here, where such a stage is asked for, never by Destination."""
    if req.fanout is False:
        return None
    from .fanout import stage_fanout

    group = None if req.fanout is True else req.fanout
    return lambda source, dest: stage_fanout(source, dest, group)


def open_source(
    src: PathLike | BinaryIO | int, dst: PathLike, req: StageRequest
) -> tuple[Source, Destination]:
    """stage()'s source (a local tree or file, a local archive, a stream, an object store
    URL) and its destination, both checked before anything is written."""
    # The archive and stream pipelines, and the object stores', are imported where a
    # source is one (a local tree needs none of them: tests/test_imports.py).
    if not isinstance(src, (str, os.PathLike)) or is_stream(src):
        from .stream import open_stream

        archive = open_stream(src, dst, req)
        return _with_inner_zips(archive, req), _directory(Path(os.fspath(dst)), req)
    if isinstance(src, str) and "://" in src and req.unpack is not False:
        from .zipopen import is_zip_url, open_zip

        if is_zip_url(src):  # read by ranges: by name, no request to look at its head
            dest = _directory(Path(os.fspath(dst)), req)
            return open_zip(src, req, state_dir(dest.path)), dest
    if isinstance(src, str) and is_store_url(src):
        from .remote import open_remote

        source, dest = open_remote(src, dst, req)
        return _with_inner_zips(source, req), dest
    if isinstance(src, str) and scheme_of(src) in ("http", "https"):
        from .web import open_web

        return open_web(src, dst, req, _open_local)
    if isinstance(src, str) and not os.path.lexists(src) and (url := _meant_url(src)):
        raise stage_error(
            errno.ENOENT, f"source '{src}' does not exist; did you mean {url}?", src
        )
    return _open_local(Path(os.fspath(src)), Path(os.fspath(dst)), req)


def _meant_url(src: str) -> str | None:
    """The object store URL a missing local path was probably meant to be: ``s3:/b/k``,
    ``S3://b/k``, ``s3:b/k`` -> ``s3://b/k``."""
    m = re.match(r"^(s3|gs|az):/*(.+)$", src, re.IGNORECASE)
    if m is None:
        return None
    return f"{m.group(1).lower()}://{m.group(2)}"


def _directory(dst: Path, req: StageRequest) -> Destination:
    """A destination that is a directory (a tree, an archive's members)."""
    if dst.exists() and not dst.is_dir():
        raise stage_error(
            errno.ENOTDIR, f"destination '{dst}' exists and is not a directory", str(dst)
        )
    dest = Destination(Path(os.path.abspath(dst)), req)
    mkdir_parent(dest.path.parent)
    return dest


def _open_local(src_path: Path, dst_path: Path, req: StageRequest) -> tuple[Source, Destination]:
    if not os.path.lexists(src_path):
        raise stage_error(errno.ENOENT, f"source '{src_path}' does not exist", str(src_path))
    src_abs = Path(os.path.realpath(src_path))
    is_file = src_abs.is_file()
    if not is_file and not src_abs.is_dir():
        raise stage_error(
            errno.EINVAL, f"source '{src_path}' is not a regular file or a directory", str(src_path)
        )
    unpack = req.unpack
    compression = None
    if is_file and unpack is not False:
        from .archive import archive_compression, not_an_archive, suffix_kind

        compression = archive_compression(src_abs)
        if compression is None and suffix_kind(src_abs):
            with open(src_abs, "rb") as f:
                raise not_an_archive(str(src_path), src_abs.name, f.read(512))
    if compression is None and is_file and unpack is not False:
        from .zipformat import is_zip_file

        if is_zip_file(src_abs):
            from .zipopen import open_zip

            return open_zip(src_abs, req, Path()), _directory(dst_path, req)
    if (unpack is True or (unpack == "nested" and is_file)) and compression is None:
        raise stage_error(
            errno.EINVAL,
            f"'{src_path}' is not a tar archive (.tar, .tar.gz, .tgz, .tar.zst); "
            "pass unpack=False to copy it as a file",
            str(src_path),
        )
    if not is_file and req.checksum is not None:
        raise ValueError("checksum= applies to a file or an archive, not to a directory")
    single = is_file and compression is None
    if single and dst_path.is_dir():
        dst_path = dst_path / src_abs.name
    dst_abs = Path(os.path.abspath(dst_path))
    dst_real = Path(os.path.realpath(dst_abs.parent)) / dst_abs.name
    if dst_real == src_abs or src_abs in dst_real.parents:
        raise stage_error(
            errno.EINVAL,
            f"destination '{dst_path}' is inside the source '{src_path}'",
            str(dst_path),
        )
    if single:
        mkdir_parent(dst_abs.parent)
        return LocalTree(src_abs, req, single=True), Destination(dst_abs, req, single=True)
    if compression is None and unpack == "nested":  # a tree whose zips are extracted
        from .zipnested import NestedZips

        return NestedZips(LocalTree(src_abs, req, single=False), req), _directory(dst_path, req)
    dest = _directory(dst_path, req)
    if compression is None:
        return LocalTree(src_abs, req, single=False), dest
    from .archive import Archive
    from .readers import LocalArchive

    options = {
        **req.selection(), "on_special": req.on_special, "file": True,
        "unpack": req.unpack_option,
    }  # fmt: skip
    return _with_inner_zips(Archive(LocalArchive(src_abs), compression, options), req), dest


def _with_inner_zips(source: Any, req: StageRequest) -> Any:
    """With unpack="nested", a tar (local, remote, a stream) or an object prefix whose
    zips are extracted too, each into its folder (zipnested.py; with fanout, a tar's
    on each node from its own copy of the tar's zips once the tar is fanned out:
    fanout/run.py)."""
    if not req.nested:
        return source
    from .archive import Archive

    prefix = getattr(source, "store", None) is not None and not getattr(source, "single", True)
    if not isinstance(source, Archive) and not prefix:
        return source
    from .zipnested import NestedZips

    return NestedZips(source, req)


def verify(
    dst: PathLike, *, engine: str = "auto", workers: int | None = None, progress: Progress = None
) -> VerifyResult:
    """Re-reads a staged file or tree and compares every chunk with its manifest.

    Returns a :class:`VerifyResult` naming every file that differs or is missing.
    Raises ``FileNotFoundError`` (a :class:`StageError`) when ``dst`` was never staged.
    """
    dst_abs = Path(os.path.abspath(os.fspath(dst)))
    manifest = read_manifest(dst_abs)
    if manifest is None or not manifest.get("complete"):
        raise stage_error(
            errno.ENOENT,
            f"'{dst}' has no fastload manifest: it was not staged "
            "by fastload, or its staging did not finish",
            str(dst),
        )
    root = dst_abs.parent if manifest["kind"] == "file" else dst_abs
    stripe = int(manifest["chunk_size"])
    files: FileTable = manifest["files"]
    mismatched: list[str] = []
    missing: list[str] = []
    for p, target in manifest.get("symlinks", {}).items():
        link = root / p
        if not os.path.lexists(link):
            missing.append(p)
        elif not os.path.islink(link) or os.readlink(link) != target:
            mismatched.append(p)
    total = files.total_bytes
    on_progress, bar = progress_callback(progress, f"verify {dst_abs.name}", total, 0)
    base = [0, 0]  # bytes and files read by the batches before

    def batch_progress(bytes_done: int, _bt: int, files_done: int, _ft: int) -> None:
        if on_progress is not None:
            on_progress(base[0] + bytes_done, total, base[1] + files_done, len(files))

    try:
        # A batch of files at a time: memory stays bounded whatever the tree's size.
        for start in range(0, len(files), VERIFY_BATCH):
            rows = range(start, min(len(files), start + VERIFY_BATCH))
            read = _verify_batch(root, files, rows, (mismatched, missing),
                                 copy_options(engine, workers, stripe), batch_progress)  # fmt: skip
            base[0] += read[0]
            base[1] += read[1]
    finally:
        if bar is not None:
            bar.close()
    result = VerifyResult(
        dst_abs, len(files), int(manifest["bytes"]), sorted(mismatched), sorted(missing)
    )
    if not result.ok:
        # The next stage() re-copies exactly these (it would otherwise find the source
        # unchanged and return at once).
        mark_damaged(dst_abs, manifest, result.mismatched + result.missing)
    if manifest.get("nested_zips"):
        return _with_inner(result, root, manifest["nested_zips"], engine, workers)
    return result


def _with_inner(result: VerifyResult, root: Path, inner: list[str], engine: str,
                workers: int | None) -> VerifyResult:  # fmt: skip
    """``result`` with each inner archive's folder verified (unpack="nested": each a
    stage of its own, with its manifest; a damaged one is marked so in it, and the next
    stage() repairs it)."""
    from .zipnested import folder_of

    files, nbytes = result.files, result.bytes
    mismatched, missing = list(result.mismatched), list(result.missing)
    for folder in sorted({folder_of(rel) for rel in inner}):
        try:
            sub = verify(root / folder, engine=engine, workers=workers)
        except FileNotFoundError:  # its folder gone, or its stage never finished
            missing.append(folder)
            continue
        files, nbytes = files + sub.files, nbytes + sub.bytes
        mismatched += [f"{folder}/{p}" for p in sub.mismatched]
        missing += [f"{folder}/{p}" for p in sub.missing]
    return VerifyResult(result.path, files, nbytes, sorted(mismatched), sorted(missing))



VERIFY_BATCH = 65536  # files per read-back job of verify()


def _verify_batch(
    root: Path,
    files: FileTable,
    rows: range,
    found: tuple[list[str], list[str]],
    options: _core.CopyOptions,
    on_progress: ProgressCallback,
) -> tuple[int, int]:
    """Reads back the files of ``rows``; adds the paths that differ and those missing to
    ``found``; returns the bytes and files read."""
    mismatched, missing = found
    prefix = os.fsencode(root) + b"/"
    names: list[bytes] = []
    at: list[int] = []
    sizes: list[int] = []
    for i in rows:
        rel = bytes(files.paths[files.offsets[i] : files.offsets[i + 1]])
        size = files.size[i]
        try:
            st = os.lstat(prefix + rel)
        except FileNotFoundError:
            missing.append(os.fsdecode(rel))
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            mismatched.append(os.fsdecode(rel))
            continue
        names.append(rel)
        at.append(i)
        sizes.append(size)
    if not names:
        return 0, 0
    listed = _core.CopyFiles(
        names, None, sizes, [(s + 511) // 512 for s in sizes], [0o644] * len(names),
        [0] * len(names),
    )  # fmt: skip
    job = _core.CopyJob(str(root), "", listed, options)

    def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
        for idx, digests in batch:
            if digests != files.digest(at[idx]):
                mismatched.append(os.fsdecode(names[idx]))

    job.start()
    run_job(job, on_progress=on_progress, base_bytes=0, base_files=0, total_bytes=0,
            total_files=0, on_done=on_done)  # fmt: skip
    return sum(sizes), len(names)
