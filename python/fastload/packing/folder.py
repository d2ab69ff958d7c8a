"""Packing a path: a directory tree, a tar, or a tar of tars, into indexed shards.

1. List the source (``listing``): the tree's files (parallel native walk) or the archive's members
   (native, headers only: the data is seeked over; member tars are listed in parallel).
2. Group members into samples by webdataset's key rule; ImageFolder layouts get a
   ``cls`` member (inline data) per sample.
3. Plan (``plan``): the sample order (a full permutation when shuffling), the cut
   into shards by size and count, this task's shards, and for every member where it
   comes from and where it goes. The plan is the same in every task.
4. Execute natively: a tree shard by shard, each thread writing whole shards; an archive
   in large ordered reads whose members are written at their precomputed offsets in
   their shards (so a shuffled pack still reads the source front to back, once).
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .. import _core
from .._util import check_space, usable_cores
from ..index import ShardIndex
from ..staging import archive_compression
from ..staging.engine import network_fs
from .listing import group, list_source
from .options import PackOptions
from .plan import cut_shards, member_bytes, permutation, task_shards
from .upload import is_store_url, pack_to_bucket
from .writer import (
    PackResult,
    PathLike,
    check_pattern,
    temp_path,
)

TREE_MODE = "scatter"
"""How a tree is written: "scatter" (threads take files in path order, each written at
its place in its shard: as many reads in flight as threads, whatever the shard count) or
"per_shard" (each thread writes whole shards front to back)."""






# --- listing ---------------------------------------------------------------------------








# --- samples ---------------------------------------------------------------------------






# --- the plan --------------------------------------------------------------------------


def _ranges(starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The concatenation of range(starts[i], starts[i] + counts[i])."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts - starts, counts)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    prefix, suffix = check_pattern(pattern)
    return re.compile(re.escape(prefix) + r"[0-9]+" + re.escape(suffix))


def _check_stale(out_dir: Path, pattern: str, planned: set[str]) -> None:
    """Shards matching the pattern that this pack would not write were left by another
    pack: ``fastload index OUT`` would join them in."""
    rx = _pattern_regex(pattern)
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return
    stale = sorted(n for n in names if rx.fullmatch(n) and n not in planned)
    if stale:
        raise FileExistsError(
            errno.EEXIST,
            f"'{out_dir}' holds {len(stale)} shard(s) this pack would not write, left by "
            f"another pack (e.g. '{stale[0]}'): remove them or choose another folder",
            str(out_dir / stale[0]),
        )


def _open_files_for(shards: int) -> int:
    """How many shards may be open at once (scatter mode), raising the soft limit on open
    files toward the hard one when the shards need it."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = shards + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    limit = 1 << 16 if soft == resource.RLIM_INFINITY else soft
    return max(16, min(shards, limit - 64))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_classes(out_dir: Path, classes: list[str]) -> None:
    _write_atomic(out_dir / "classes.txt", "".join(c + "\n" for c in classes))
    doc = {"classes": classes, "class_to_idx": {c: i for i, c in enumerate(classes)}}
    _write_atomic(out_dir / "classes.json", json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


class _Progress:
    """tqdm bar over samples, with MB/s of source data."""

    def __init__(self, total: int, desc: str) -> None:
        from tqdm.auto import tqdm

        self._t0 = time.monotonic()
        self._bar = tqdm(
            total=total, unit=" samples", unit_scale=True, desc=desc, dynamic_ncols=True,
            smoothing=0.1,
        )  # fmt: skip

    def __call__(self, samples: int, nbytes: int) -> None:
        dt = max(time.monotonic() - self._t0, 1e-9)
        self._bar.n = samples
        self._bar.set_postfix_str(f"{nbytes / dt / 1e6:,.0f} MB/s", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def default_workers(src: Path) -> int:
    """Threads for a pack: one per CPU this process may use; on a network file system,
    where reads wait on round trips, four per CPU (at most 32), to keep more in flight."""
    cpus = usable_cores()
    return min(32, 4 * cpus) if network_fs(src) else cpus


def pack_path(src: PathLike, out_dir: PathLike, opts: PackOptions,
              classes: bool | None = None) -> PackResult:
    """Packs the tree, tar or tar of tars at ``src`` into ``out_dir`` (a folder, or a
    bucket URL: packed into a temporary folder and uploaded, index last)."""
    if is_store_url(out_dir):
        into = dataclasses.replace(opts, sync=False)
        packed: PackResult = pack_to_bucket(
            lambda local: pack_path(src, local, into, classes), os.fspath(out_dir), opts.index
        )
        return packed
    if opts.workers == 0:
        raise ValueError("workers must be at least 1, not 0 (threads reading the source)")
    t0 = time.monotonic()
    pattern, index = opts.pattern, opts.index
    task_index, num_tasks = opts.task_index, opts.num_tasks
    source = Path(os.path.abspath(src))
    out = Path(os.path.abspath(out_dir))
    threads = opts.workers or default_workers(source)

    # A compressed tar cannot be read at random: it is decompressed next to the shards
    # first (the shards are uncompressed anyway), and the copy removed at the end.
    plain: Path | None = None
    if source.is_file() and archive_compression(source) in ("gzip", "zstd"):
        plain = source = _decompressed(source, out)
    try:
        listing = list_source(source, out, threads)
        smp = group(listing, classes)
        n = len(smp.keys)
        if n == 0:
            raise ValueError(
                f"'{source}' has no samples (files named KEY.FIELD; "
                f"{smp.skipped} left out, e.g. {smp.skipped_examples[:3]})"
            )
        mbytes = member_bytes(smp.name_len.astype(np.uint64), smp.size)
        per_sample = np.add.reduceat(mbytes.astype(np.int64), smp.first)
        order = permutation(n, opts.seed) if opts.shuffle else np.arange(n, dtype=np.int64)
        cuts = cut_shards(per_sample[order], opts.limit, opts.max_count)
        n_shards = len(cuts) - 1
        names = [pattern.format(s) for s in range(n_shards)]
        mine = task_shards(n_shards, task_index, num_tasks)

        out.mkdir(parents=True, exist_ok=True)
        _check_stale(out, pattern, set(names))
        for s in mine:  # temporaries a killed run of this task left
            for leftover in out.glob(f".{glob.escape(names[s])}.tmp-*"):
                leftover.unlink(missing_ok=True)

        # This task's members in output order.
        mine_arr = np.array(mine, dtype=np.int64)
        shard_samples = cuts[mine_arr + 1] - cuts[mine_arr]
        samples_out = order[_ranges(cuts[mine_arr], shard_samples)]
        counts = smp.count[samples_out]
        members = _ranges(smp.first[samples_out], counts)
        m_first = np.zeros(len(members), dtype=np.uint8)
        if len(members):
            m_first[np.cumsum(counts) - counts] = 1
        per_shard_members = np.add.reduceat(counts, _starts(shard_samples)) if len(mine) else counts
        shard_first = np.zeros(len(mine) + 1, dtype=np.uint64)
        np.cumsum(per_shard_members[: len(mine)], out=shard_first[1:])
        finals = [out / names[s] for s in mine]
        tmps = [temp_path(p) for p in finals]
        check_space(out, int(per_sample[samples_out].sum()) + 1024 * len(mine),
                    f"to pack into '{out}'", out)  # fmt: skip

        if listing.kind == "tree":
            root: str | None = os.fspath(source)
            sources, src_offsets, mode = smp.names, smp.src_offsets, TREE_MODE
        else:
            root = None
            sources = os.fsencode(source)
            src_offsets = np.array([0, len(sources)], dtype=np.uint64)
            mode = "scatter"
        bar = _Progress(len(samples_out), f"pack {source.name}") if opts.progress else None
        try:
            plan = _core.PackPlan(
                root=root,
                sources=sources,
                src_offsets=src_offsets,
                m_src=smp.src[members],
                m_off=smp.off[members],
                m_size=smp.size[members],
                m_name=smp.name_off[members],
                m_name_len=smp.name_len[members],
                m_first=m_first,
                names=smp.names,
                inline_data=smp.inline,
                whole_files=listing.kind == "tree",
                shard_first=shard_first,
                final_paths=finals,
                tmp_paths=tmps,
            )
            options = _core.PackOptions(
                mode=mode,
                threads=threads,
                sync=opts.sync,
                max_open=_open_files_for(len(mine)) if mode == "scatter" else 256,
            )
            res = _core.pack_run(plan, options, bar)
        finally:
            if bar is not None:
                bar.close()

        _fsync_dir(out)  # the renames
        if smp.classes is not None:
            _save_classes(out, smp.classes)
        index_path = None
        if index and num_tasks == 1:
            index_path = ShardIndex.build(finals, out / index).path
        return PackResult(
            out_dir=out,
            shards=tuple(finals),
            samples=int(res["samples"]),
            bytes=int(res["bytes"]),
            seconds=time.monotonic() - t0,
            index=index_path,
            total_shards=n_shards,
            total_samples=n,
            classes=tuple(smp.classes) if smp.classes is not None else None,
            skipped=smp.skipped,
            skipped_examples=tuple(smp.skipped_examples),
        )
    finally:
        if plain is not None:
            plain.unlink(missing_ok=True)


def _starts(counts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    s = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=s[1:])
    return s


def _decompressed(src: Path, out: Path) -> Path:
    """``src`` (a gzip- or zstd-compressed tar) decompressed into a hidden tar in ``out``."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    plain = out / f".{src.name}.fastload-decompressed.tar"
    kind = archive_compression(src)
    try:
        with open(plain, "wb") as dst:
            if kind == "gzip":
                try:
                    from isal import igzip as gzip  # type: ignore[import-not-found,unused-ignore]
                except ImportError:
                    import gzip
                with gzip.open(src, "rb") as f:
                    shutil.copyfileobj(f, dst, 8 << 20)
            else:
                zstd = shutil.which("zstd")
                if zstd is None:
                    try:
                        import zstandard  # type: ignore[import-not-found,unused-ignore]
                    except ImportError:
                        raise ValueError(
                            f"'{src}' is zstd-compressed: packing it needs the zstd command "
                            "or the 'zstandard' package"
                        ) from None
                    with open(src, "rb") as f:
                        zstandard.ZstdDecompressor().copy_stream(f, dst)
                else:
                    import subprocess

                    subprocess.run([zstd, "-dc", "--", str(src)], stdout=dst, check=True)
    except BaseException:
        plain.unlink(missing_ok=True)
        raise
    return plain
