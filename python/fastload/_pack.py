"""Packing a path: a directory tree, a tar, or a tar of tars, into indexed shards.

1. List the source: the tree's files (parallel native walk) or the archive's members
   (native, headers only: the data is seeked over; member tars are listed in parallel).
2. Group members into samples by webdataset's key rule; ImageFolder layouts get a
   ``cls`` member (inline data) per sample.
3. Plan (``_pack_plan``): the sample order (a full permutation when shuffling), the cut
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _core
from ._archive import archive_compression
from ._engine import network_fs
from ._pack_plan import cut_shards, member_bytes, permutation, split_key, task_shards
from .errors import NotEnoughSpaceError
from .index import ShardIndex
from .writer import (
    DEFAULT_INDEX,
    PackResult,
    PathLike,
    Size,
    check_pattern,
    parse_size,
    temp_path,
)

CLS_FIELD = "cls"
TREE_MODE = "scatter"
"""How a tree is written: "scatter" (threads take files in path order, each written at
its place in its shard: as many reads in flight as threads, whatever the shard count) or
"per_shard" (each thread writes whole shards front to back)."""
_SKIPPED_EXAMPLES = 8


@dataclasses.dataclass
class Listing:
    """A source's regular files (tree) or members (archive), in source order."""

    kind: str  # "tree" | "tar"
    path: Path
    names: list[str]  # relative paths: tar member names in the shards
    offsets: npt.NDArray[np.uint64]  # of the data in the archive (zeros for a tree)
    sizes: npt.NDArray[np.uint64]
    skipped: int = 0
    skipped_examples: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Samples:
    """Members grouped into samples, sorted by sample then field."""

    keys: list[str]  # per sample
    first: npt.NDArray[np.int64]  # per sample: its first member
    count: npt.NDArray[np.int64]  # per sample: its members
    src: npt.NDArray[np.int64]  # per member: listing index, or -1 (inline)
    off: npt.NDArray[np.uint64]  # per member: data offset in the archive or in inline
    size: npt.NDArray[np.uint64]
    name_off: npt.NDArray[np.uint64]  # per member: its name in `names`
    name_len: npt.NDArray[np.uint32]
    names: bytes  # the listing's names, then the inline members' names
    src_offsets: npt.NDArray[np.uint64]  # the listing's names in `names` (tree sources)
    inline: bytes
    classes: list[str] | None
    skipped: int
    skipped_examples: list[str]


# --- listing ---------------------------------------------------------------------------


def _hidden(name: str) -> bool:
    return name.startswith(".") or "/." in name


def list_source(src: Path, out_dir: Path, threads: int) -> Listing:
    """The files of a tree or the members of an archive."""
    st = os.stat(src)  # FileNotFoundError names the path
    if os.path.isdir(src):
        return _list_tree(src, out_dir, threads)
    kind = archive_compression(src)
    if kind in ("gzip", "zstd"):
        raise ValueError(
            f"'{src}' is a {kind}-compressed archive: decompress it first (shards are "
            "read at random, so they are written uncompressed from an uncompressed tar)"
        )
    if kind is None:
        raise ValueError(f"'{src}' is neither a directory nor a tar archive")
    del st
    names, offsets, sizes, info = _core.list_archive(src, True, threads)
    return Listing(
        "tar",
        src,
        names,
        offsets,
        sizes,
        int(info["skipped"]),
        [str(x) for x in info["skipped_examples"]],
    )


def _list_tree(root: Path, out_dir: Path, threads: int) -> Listing:
    tree = _core.walk(root, [], [], True, threads)
    # The output folder inside the source (a re-run) is not part of the data.
    try:
        inside = os.path.relpath(os.path.realpath(out_dir), os.path.realpath(root))
    except ValueError:
        inside = ".."
    exclude = None if inside.startswith("..") else inside + "/"
    names: list[str] = []
    sizes: list[int] = []
    skipped = list(tree.skipped)
    for path, kind, size, _blocks, _mode, _mtime, _target in tree.entries():
        if kind == 1:  # directory
            continue
        if exclude is not None and (path + "/").startswith(exclude):
            continue
        if kind == 2:  # symlink inside the tree: packed as the file it points to
            try:
                st = os.stat(root / path)
            except OSError:
                skipped.append(path)
                continue
            if not os.path.isfile(root / path):
                skipped.append(path)
                continue
            size = st.st_size
        names.append(path)
        sizes.append(size)
    return Listing(
        "tree",
        root,
        names,
        np.zeros(len(names), dtype=np.uint64),
        np.array(sizes, dtype=np.uint64),
        len(skipped),
        skipped[:_SKIPPED_EXAMPLES],
    )


# --- samples ---------------------------------------------------------------------------


def _blob(names: Sequence[str]) -> tuple[bytes, npt.NDArray[np.uint64]]:
    """The names' bytes joined, and offsets (len + 1) into them."""
    joined = "".join(names)
    blob = os.fsencode(joined)
    if len(blob) == len(joined):  # ASCII: byte lengths are character lengths
        lens = np.fromiter(map(len, names), dtype=np.uint64, count=len(names))
    else:
        parts = [os.fsencode(n) for n in names]
        lens = np.fromiter(map(len, parts), dtype=np.uint64, count=len(parts))
    offsets = np.zeros(len(names) + 1, dtype=np.uint64)
    np.cumsum(lens, out=offsets[1:])
    return blob, offsets


def group(listing: Listing, classes: bool | None) -> Samples:
    """Groups members into samples: key and field by webdataset's rule, samples in key
    order (a tree) or archive order (an archive), fields sorted within a sample."""
    keys: dict[str, int] = {}
    m_listed: list[int] = []
    m_sample: list[int] = []
    m_field: list[str] = []
    skipped = listing.skipped
    examples = list(listing.skipped_examples)
    for i, name in enumerate(listing.names):
        kf = None if _hidden(name) else split_key(name)
        if kf is None:
            skipped += 1
            if len(examples) < _SKIPPED_EXAMPLES:
                examples.append(name)
            continue
        s = keys.get(kf[0])
        if s is None:
            s = keys[kf[0]] = len(keys)
        m_listed.append(i)
        m_sample.append(s)
        m_field.append(kf[1])
    key_list = list(keys)
    n = len(key_list)
    if listing.kind == "tree":
        by_key = sorted(range(n), key=key_list.__getitem__)
        rank = np.empty(n, dtype=np.int64)
        rank[np.array(by_key, dtype=np.int64)] = np.arange(n, dtype=np.int64)
        key_list = [key_list[i] for i in by_key]
    else:
        rank = np.arange(n, dtype=np.int64)

    # Classes: every key inside a top-level folder, two folders or more.
    class_names: list[str] | None = None
    if classes is not False:
        tops = {k.split("/", 1)[0] for k in key_list if "/" in k}
        flat = any("/" not in k for k in key_list)
        has_cls = CLS_FIELD in set(m_field)
        if not flat and len(tops) >= 2 and not has_cls:
            class_names = sorted(tops)
        elif classes:
            why = (
                f"samples already have a '{CLS_FIELD}' field"
                if has_cls
                else "keys must all lie in two or more top-level folders (ImageFolder)"
            )
            raise ValueError(f"cannot add classes to '{listing.path}': {why}")

    blob, src_offsets = _blob(listing.names)
    listed = np.array(m_listed, dtype=np.int64)
    sample = rank[np.array(m_sample, dtype=np.int64)] if m_sample else np.zeros(0, np.int64)
    src = listed if listing.kind == "tree" else np.zeros(len(listed), dtype=np.int64)
    off = listing.offsets[listed] if len(listed) else np.zeros(0, np.uint64)
    size = listing.sizes[listed] if len(listed) else np.zeros(0, np.uint64)
    name_off = src_offsets[listed] if len(listed) else np.zeros(0, np.uint64)
    name_len = (src_offsets[listed + 1] - src_offsets[listed]) if len(listed) else name_off
    fields = list(m_field)
    inline = b""
    if class_names is not None:
        # One inline member KEY.cls per sample, its data the class position as text.
        text = [str(i) for i in range(len(class_names))]
        inline = "".join(text).encode("ascii")
        cls_off = np.zeros(len(text) + 1, dtype=np.uint64)
        np.cumsum([len(t) for t in text], out=cls_off[1:])
        cls_of = {c: i for i, c in enumerate(class_names)}
        sample_cls = np.array([cls_of[k.split("/", 1)[0]] for k in key_list], dtype=np.int64)
        cls_names = [f"{k}.{CLS_FIELD}" for k in key_list]
        cblob, coffs = _blob(cls_names)
        base = len(blob)
        blob += cblob
        sample = np.concatenate([sample, np.arange(n, dtype=np.int64)])
        src = np.concatenate([src, np.full(n, -1, dtype=np.int64)])
        off = np.concatenate([off, cls_off[sample_cls]])
        size = np.concatenate([size, (cls_off[sample_cls + 1] - cls_off[sample_cls])])
        name_off = np.concatenate([name_off, coffs[:-1] + np.uint64(base)])
        name_len = np.concatenate([name_len, coffs[1:] - coffs[:-1]])
        fields += [CLS_FIELD] * n

    # Members sorted by sample, then field (byte order, as sorted() of str sorts).
    if len(fields) == n:
        order = np.argsort(sample, kind="stable")
    else:
        uniq = sorted(set(fields))
        code = {f: i for i, f in enumerate(uniq)}
        fcode = np.fromiter((code[f] for f in fields), dtype=np.int64, count=len(fields))
        order = np.lexsort((fcode, sample))
        dup = (sample[order][1:] == sample[order][:-1]) & (fcode[order][1:] == fcode[order][:-1])
        if dup.any():
            j = int(order[int(np.argmax(dup)) + 1])
            raise ValueError(
                f"'{listing.path}': two members named "
                f"'{key_list[int(sample[j])]}.{fields[j]}'"
            )
    sample = sample[order]
    count = np.bincount(sample, minlength=n).astype(np.int64)
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(count[:-1], out=first[1:])
    return Samples(
        keys=key_list,
        first=first,
        count=count,
        src=src[order],
        off=np.asarray(off, dtype=np.uint64)[order],
        size=np.asarray(size, dtype=np.uint64)[order],
        name_off=np.asarray(name_off, dtype=np.uint64)[order],
        name_len=np.asarray(name_len, dtype=np.uint32)[order],
        names=blob,
        src_offsets=src_offsets,
        inline=inline,
        classes=class_names,
        skipped=skipped,
        skipped_examples=examples,
    )


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


def _check_space(out: Path, needed: int) -> None:
    st = os.statvfs(out)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        from .stage import _human

        raise NotEnoughSpaceError(
            f"not enough space to pack into '{out}': the shards need {_human(needed)}, "
            f"{_human(free)} free on its file system",
            path=str(out),
            needed=needed,
            free=free,
        )


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
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return min(32, 4 * cpus) if network_fs(src) else cpus


def pack_path(
    src: PathLike,
    out_dir: PathLike,
    *,
    shuffle: bool,
    seed: int,
    pattern: str,
    max_size: Size,
    max_count: int | None,
    workers: int | None,
    task_index: int,
    num_tasks: int,
    classes: bool | None,
    index: str | None,
    progress: bool,
    sync: bool,
) -> PackResult:
    t0 = time.monotonic()
    check_pattern(pattern)
    limit = parse_size(max_size)
    if max_count is not None and max_count < 1:
        raise ValueError(f"max_count must be at least 1, not {max_count}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    task_shards(0, task_index, num_tasks)  # checks the task arguments
    source = Path(os.path.abspath(src))
    out = Path(os.path.abspath(out_dir))
    threads = workers or default_workers(source)

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
    order = permutation(n, seed) if shuffle else np.arange(n, dtype=np.int64)
    cuts = cut_shards(per_sample[order], limit, max_count)
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
    _check_space(out, int(per_sample[samples_out].sum()) + 1024 * len(mine))

    if listing.kind == "tree":
        root: str | None = os.fspath(source)
        sources, src_offsets, mode = smp.names, smp.src_offsets, TREE_MODE
    else:
        root = None
        sources = os.fsencode(source)
        src_offsets = np.array([0, len(sources)], dtype=np.uint64)
        mode = "scatter"
    bar = _Progress(len(samples_out), f"pack {source.name}") if progress else None
    try:
        res = _core.pack_run(
            root,
            sources,
            src_offsets,
            smp.src[members],
            smp.off[members],
            smp.size[members],
            smp.name_off[members],
            smp.name_len[members],
            m_first,
            smp.names,
            smp.inline,
            listing.kind == "tree",
            shard_first,
            finals,
            tmps,
            mode,
            threads,
            sync,
            _open_files_for(len(mine)) if mode == "scatter" else 256,
            bar,
        )
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


def _starts(counts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    s = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=s[1:])
    return s


# --- the command line ------------------------------------------------------------------


def pack_command(args: Any, progress: bool) -> int:
    """``fastload pack SRC OUT ...``."""
    from .stage import _human

    r = pack_path(
        args.src,
        args.out,
        shuffle=args.shuffle,
        seed=args.seed,
        pattern=args.pattern,
        max_size=args.max_size,
        max_count=args.max_count,
        workers=args.workers,
        task_index=args.task_index,
        num_tasks=args.num_tasks,
        classes=args.classes,
        index=DEFAULT_INDEX,
        progress=progress,
        sync=True,
    )
    rate = r.samples / r.seconds if r.seconds > 0 else 0.0
    mbs = r.bytes / r.seconds / 1e6 if r.seconds > 0 else 0.0
    who = f"task {args.task_index} of {args.num_tasks}: " if args.num_tasks > 1 else ""
    print(
        f"{r.out_dir}: {who}{r.samples} samples in {len(r.shards)} of {r.total_shards} shards "
        f"({_human(r.bytes)}) in {r.seconds:.2f} s ({rate:,.0f} samples/s, {mbs:,.0f} MB/s)"
    )
    if r.classes is not None:
        print(f"  {len(r.classes)} classes (field '{CLS_FIELD}'), saved in classes.txt and .json")
    if r.skipped:
        print(f"  left out {r.skipped} files without KEY.FIELD names, e.g. {r.skipped_examples[0]}")
    if r.index is not None:
        print(f"  index {r.index}")
    elif args.num_tasks > 1:
        print(f"  when every task is done: fastload index {r.out_dir}")
    return 0
