"""What the cache tests share: shards written locally and uploaded to a bucket, samples
as comparable values, the bytes in a cache folder."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import random
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kit.shards import Sample, make_samples, write_tarfile
from sources.s3server import S3Server, upload


def write_shards(root: Path, sizes: Sequence[int], fmt: str = "pax") -> list[Path]:
    """Shards ``train-000000.tar``... of ``sizes[i]`` samples each."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, n in enumerate(sizes):
        part: list[Sample] = make_samples(n, seed=10 + s, prefix=f"s{s}/")
        paths.append(write_tarfile(root / f"train-{s:06d}.tar", part, fmt))
    return paths


def put_shards(s3: S3Server, bucket: str, paths: Sequence[Path], prefix: str = "data/") -> str:
    """Uploads the shards under ``prefix``; returns their brace pattern's URL."""
    upload(s3, bucket, {f"{prefix}{p.name}": p.read_bytes() for p in paths})
    return f"s3://{bucket}/{prefix}train-{{000000..{len(paths) - 1:06d}}}.tar"


def issue_shards(root: Path, seed: int, shards: int = 12, per_shard: int = 310) -> list[Path]:
    """The cache issues' shape (32, 55): ``shards`` tar shards of ``per_shard`` samples,
    ``bin`` of 5-11 KB of seeded random bytes and ``cls`` the sample's number."""
    rng = random.Random(seed)
    paths = []
    for s in range(shards):
        samples = [(f"s{s}/k{i:05d}", {"bin": rng.randbytes(rng.randrange(5000, 11000)),
                                        "cls": str(i).encode()}) for i in range(per_shard)]
        paths.append(write_tarfile(root / f"train-{s:06d}.tar", samples))
    return paths


def last_modified(s3: S3Server, bucket: str, prefix: str) -> datetime.datetime:
    """The newest Last-Modified under ``prefix`` (S3 states it to the second)."""
    objs = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    return max(o["LastModified"] for o in objs)


def after_last_modified(s3: S3Server, bucket: str, prefix: str) -> datetime.datetime:
    """Returns once the server's clock (this machine's) is in a later second than every
    object under ``prefix`` was last modified in: what is uploaded next is newer by
    Last-Modified. Returns that newest time."""
    newest = last_modified(s3, bucket, prefix)
    while datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) <= newest:
        time.sleep(0.05)
    return newest


def plain(sample: Any) -> Any:
    """A sample (dict of payloads, bytes or a list of such dicts) as comparable values:
    the key and a digest of each field."""
    if isinstance(sample, list):
        return [plain(s) for s in sample]
    return {k: v if k == "__key__" else hashlib.sha256(bytes(v)).hexdigest()[:16]
            for k, v in sample.items()}


def cache_bytes(cache_dir: Path) -> int:
    """The bytes of objects in a cache (entries and downloads in progress); each inode
    once (a finished download's rename, during the listing, keeps its inode). Not under
    the cache's lock: a DataLoader worker forked while the lock is held would keep it."""
    total = 0
    try:
        names = os.listdir(cache_dir / "shards")
    except FileNotFoundError:
        return 0
    seen: set[int] = set()
    for n in names:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(cache_dir / "shards" / n)
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def folder_bytes(cache_dir: Path) -> int:
    """The bytes of every regular file under ``cache_dir`` (shards, downloads, views with
    their indexes and any partial files, listings, state), each inode once."""
    total = 0
    seen: set[int] = set()
    for folder, _, names in os.walk(cache_dir):
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(folder, n))
                if stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
    return total


def with_index_only(url: str, cache_dir: Path) -> int:
    """Builds the index of ``url`` in ``cache_dir`` and leaves no shard there; returns
    the bytes of the cache's own files (index, listing, log), the room it keeps free
    beside a download, and 4 KiB for the log to grow by: what a limit needs beside the
    shards it is to hold."""
    import fastload
    from fastload.cache import ShardCache, _space

    ds = fastload.ShardIndexDataset(url, cache_dir=cache_dir)
    assert ds._remote is not None
    cache = ShardCache(cache_dir)
    for u in ds._remote.shards.urls:
        cache.drop(u)
    return _space.overhead(cache_dir) + _space.SLACK + 4096


def keep(batch: list[Any]) -> list[Any]:
    return batch


def epoch_keys(ds: Any, workers: int = 0) -> list[Any]:
    """One epoch of ``ds`` through a DataLoader (forked workers), as comparable values."""
    import multiprocessing

    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=keep,
                        multiprocessing_context=multiprocessing.get_context("fork")
                        if workers else None)
    return [plain(s) for s in loader]


@contextlib.contextmanager
def cache_peak(cache_dir: Path, measure: Callable[[Path], int] = cache_bytes
               ) -> Iterator[list[int]]:
    """The most bytes ``cache_dir`` held while the block ran (``peak[0]``), sampled every
    2 ms by a thread: by ``measure`` (the objects in ``shards/``, or
    :func:`folder_bytes`: every file)."""
    import threading

    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], measure(cache_dir))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()


def downloads_since(cache_dir: Path, before: int) -> tuple[list[str], list[Any]]:
    """The shards the cache in ``cache_dir`` logged as downloaded after its first
    ``before`` events (an epoch's, where ``before`` was counted at its start), and those
    events (whose pid and order a failure shows)."""
    from fastload.cache import ShardCache

    events = ShardCache(cache_dir).events()[before:]
    return [n for _, op, n, _ in events if op == "download"], events
