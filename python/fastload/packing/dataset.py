"""Packing Python samples: an iterable (one ShardWriter, in order) and a map-style
dataset (worker processes, each loading and writing whole groups of samples).

A map-style dataset is cut into groups of consecutive samples of the (shuffled) order;
a worker writes a group into shards of its own (parts, under hidden names), so loading,
encoding and writing all run in parallel. Once every group is done the parts are
renamed, in group order, to the shard pattern. The groups depend on the dataset,
``seed``, ``max_count`` and ``max_size``, not on the number of workers: the same call
with 1 or 16 workers writes the same shards.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import numpy as np
import numpy.typing as npt

from ..index import ShardIndex
from .options import PackOptions
from .plan import END_BYTES, permutation
from .writer import (
    PackResult,
    PathLike,
    ShardWriter,
    encode_sample,
    sample_bytes,
)

_PROBE = 16  # samples loaded to estimate a group's count from max_size
_POLL_S = 0.25


def pack_iterable(
    samples: Iterable[Mapping[str, Any]], out_dir: PathLike, opts: PackOptions
) -> PackResult:
    t0 = time.monotonic()
    bar = None
    if opts.progress:
        from tqdm.auto import tqdm

        bar = tqdm(unit=" samples", unit_scale=True, desc="pack", dynamic_ncols=True)
    w = ShardWriter(
        out_dir, pattern=opts.pattern, max_size=opts.max_size, max_count=opts.max_count,
        index=opts.index, sync=opts.sync,
    )  # fmt: skip
    with w:
        for s in samples:
            w.write(s)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return PackResult(
        out_dir=Path(os.path.abspath(out_dir)),
        shards=tuple(w.shards),
        samples=w.samples,
        bytes=w.bytes,
        seconds=time.monotonic() - t0,
        index=w.index.path if w.index is not None else None,
        total_shards=len(w.shards),
        total_samples=w.samples,
    )


class ToSample:
    """Dataset item -> sample dict: ``to_sample(i, item)``, a dict as it is, or a tuple
    with its parts named by ``fields``; the key defaults to ``i``, zero-padded."""

    def __init__(
        self,
        to_sample: Callable[[int, Any], Mapping[str, Any]] | None,
        fields: Sequence[str] | None,
        width: int,
    ) -> None:
        self.to_sample = to_sample
        self.fields = tuple(fields) if fields is not None else None
        self.width = width

    @classmethod
    def of(
        cls,
        to_sample: Callable[[int, Any], Mapping[str, Any]] | None,
        fields: Sequence[str] | None,
        n: int,
    ) -> ToSample:
        """For a dataset of ``n`` items: keys zero-padded to at least 6 digits."""
        return cls(to_sample, fields, max(6, len(str(max(n - 1, 0)))))

    def __call__(self, i: int, item: Any) -> dict[str, Any]:
        if self.to_sample is not None:
            s = dict(self.to_sample(i, item))
        elif isinstance(item, Mapping):
            s = dict(item)
        elif isinstance(item, (tuple, list)) and self.fields is not None:
            if len(item) != len(self.fields):
                raise ValueError(
                    f"dataset item {i} has {len(item)} parts, fields names {len(self.fields)}"
                )
            s = dict(zip(self.fields, item, strict=True))
        else:
            raise TypeError(
                f"dataset item {i} is a {type(item).__name__}: name the parts of tuple items "
                "with fields=('jpg', 'cls'), or pass to_sample=fn(index, item) -> dict"
            )
        s.setdefault("__key__", f"{i:0{self.width}d}")
        return s


# Per worker process: set by _init (inherited on fork, pickled once on spawn).
_worker: dict[str, Any] = {}


def _init(dataset: Any, convert: ToSample, samples: Any, nbytes: Any) -> None:
    _worker.update(dataset=dataset, convert=convert, samples=samples, nbytes=nbytes)


def _part_name(token: str, group: int) -> Callable[[int], str]:
    def name(part: int) -> str:
        return f".pack-{token}-{group:06d}-{part:04d}.tar"

    return name


def write_group(
    group: int,
    indices: npt.NDArray[np.int64],
    out_dir: str,
    token: str,
    max_size: int,
    max_count: int | None,
    sync: bool,
) -> list[tuple[str, int, int]]:
    """Writes the samples ``indices`` of the dataset into parts; returns (path, samples,
    bytes) per part. Runs in a worker (or in the caller, with one worker)."""
    ds, convert = _worker["dataset"], _worker["convert"]
    counter_s, counter_b = _worker["samples"], _worker["nbytes"]
    w = ShardWriter(
        out_dir,
        max_size=max_size,
        max_count=max_count,
        index=None,
        sync=sync,
        _name=_part_name(token, group),
    )
    out: list[tuple[str, int, int]] = []
    with w:
        done = 0
        for i in indices.tolist():
            sample = convert(i, ds[i])
            w.write(sample)
            done += 1
            if counter_s is not None and (done & 15) == 0:
                with counter_s.get_lock():
                    counter_s.value += 16
        if counter_s is not None and done & 15:
            with counter_s.get_lock():
                counter_s.value += done & 15
    for path, n in zip(w.shards, w.shard_samples, strict=True):
        out.append((os.fspath(path), n, os.path.getsize(path)))
    if counter_b is not None:
        with counter_b.get_lock():
            counter_b.value += w.bytes
    return out


def _group_size(
    dataset: Any, order: npt.NDArray[np.int64], convert: ToSample, limit: int, max_count: int | None
) -> int:
    if max_count is not None:
        return max_count
    k = min(len(order), _PROBE)
    total = 0
    for i in order[:k].tolist():
        key, fields = encode_sample(convert(i, dataset[i]))
        total += sample_bytes(key, fields)
    mean = max(1.0, total / max(k, 1))
    return max(1, int((limit - END_BYTES) // mean))


def pack_map_dataset(
    dataset: Any,
    out_dir: PathLike,
    opts: PackOptions,
    convert: ToSample,
    start_method: str | None = None,
) -> PackResult:
    t0 = time.monotonic()
    limit, max_count, index = opts.limit, opts.max_count, opts.index
    n = len(dataset)
    out = Path(os.path.abspath(out_dir))
    out.mkdir(parents=True, exist_ok=True)
    order = permutation(n, opts.seed) if opts.shuffle else np.arange(n, dtype=np.int64)
    _init(dataset, convert, None, None)
    g = _group_size(dataset, order, convert, limit, max_count) if n else 1
    groups = [order[a : a + g] for a in range(0, n, g)]
    workers = opts.workers if opts.workers is not None else (os.cpu_count() or 1)
    nworkers = min(workers, len(groups))
    token = f"{os.getpid()}-{time.time_ns() & 0xFFFFFFFF:08x}"
    args = (os.fspath(out), token, limit, max_count, opts.sync)
    parts: list[list[tuple[str, int, int]]] = [[] for _ in groups]
    try:
        if nworkers <= 1:
            bar = _bar(n) if opts.progress else None
            _init(dataset, convert, None, None)
            for gi, idx in enumerate(groups):
                parts[gi] = write_group(gi, idx, *args)
                if bar is not None:
                    bar.update(len(idx))
            if bar is not None:
                bar.close()
        else:
            _run_pool(dataset, convert, groups, args, nworkers, parts, opts.progress,
                      start_method)
        shards = _rename_parts(out, opts.pattern, parts)
    except BaseException:
        for leftover in out.glob(f".pack-{token}-*"):
            leftover.unlink(missing_ok=True)
        raise
    index_path = ShardIndex.build(shards, out / index).path if index and shards else None
    nbytes = sum(b for ps in parts for _, _, b in ps)
    return PackResult(
        out_dir=out,
        shards=tuple(shards),
        samples=n,
        bytes=nbytes,
        seconds=time.monotonic() - t0,
        index=index_path,
        total_shards=len(shards),
        total_samples=n,
    )


def _bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=" samples", unit_scale=True, desc="pack", dynamic_ncols=True)


def _run_pool(
    dataset: Any,
    convert: ToSample,
    groups: list[npt.NDArray[np.int64]],
    args: tuple[Any, ...],
    nworkers: int,
    parts: list[list[tuple[str, int, int]]],
    progress: bool,
    start_method: str | None,
) -> None:
    n = sum(len(g) for g in groups)
    method = start_method or ("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    ctx = multiprocessing.get_context(method)
    samples = ctx.Value("q", 0)
    nbytes = ctx.Value("q", 0)
    with ProcessPoolExecutor(
        nworkers, mp_context=ctx, initializer=_init, initargs=(dataset, convert, samples, nbytes)
    ) as pool:
        futures: dict[Future[list[tuple[str, int, int]]], int] = {
            pool.submit(write_group, gi, idx, *args): gi for gi, idx in enumerate(groups)
        }
        bar = _bar(n) if progress else None  # after the workers forked (tqdm has a thread)
        t0 = time.monotonic()
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
                for f in done:
                    parts[futures[f]] = f.result()  # raises a worker's error
                if bar is not None:
                    bar.n = samples.value
                    dt = max(time.monotonic() - t0, 1e-9)
                    bar.set_postfix_str(f"{nbytes.value / dt / 1e6:,.0f} MB/s", refresh=False)
                    bar.refresh()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        finally:
            if bar is not None:
                bar.n = samples.value
                bar.close()


def _rename_parts(out: Path, pattern: str, parts: list[list[tuple[str, int, int]]]) -> list[Path]:
    shards: list[Path] = []
    for group_parts in parts:
        for path, _n, _b in group_parts:
            final = out / pattern.format(len(shards))
            os.replace(path, final)
            shards.append(final)
    if shards:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return shards
