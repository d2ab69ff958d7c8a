"""Packing benchmarks: a folder of files into shards, fastload side by side with the peers.

Data (from the page cache; each round writes a fresh output folder and ends with
syncfs(), so every tool is timed to data on disk):
  tree   an ImageNet-like tree (class folders of ~100 KB JPEG-like files; full: 40,000
         files in 400 classes, the same files as the tar of tars; small: the scale's tree)
  3kb    a class tree of 3 KB files (full: 200,000 files in 1,000 classes)
  tot    a tar of tars, ImageNet's train layout (one tar per class; full: 400 x 100 files
         of ~100 KB, the extraction benchmark's archive), packed without extracting it

Each sample is the file plus its class index. ``shuffle``: a full random permutation of
the samples (fastload computes it; the peers get the file list shuffled, which is what a
full shuffle costs them: every file read at random). ``ordered``: in key order.

Tools (a peer that is not installed is skipped; scripts/bench-peers.sh sets up a venv
with all of them):
  fastload          fastload.pack(tree, out) (native threads, default count)
  fastload-1thread  the same on one thread
  webdataset        webdataset.ShardWriter, files read in Python (a tar of tars: streamed
                    with tarfile, ordered only: a full shuffle of a stream needs it
                    extracted or held in memory first)
  litdata           litdata.optimize(fn=read one file, inputs=the file list), one worker
                    process per CPU (fork), chunks of max_size bytes; no tar of tars (it
                    maps a function over a list of inputs, not over a stream)
  mosaicml          MosaicML streaming.MDSWriter (one process, uncompressed, shards of
                    max_size), files read in Python; a tar of tars streamed like webdataset

Groups ``pack-DATA-ORDER``; report.py derives samples/s ("files/s") and MB/s from the
samples and source bytes recorded in ``extra_info``.

Group ``writer-3kb``: the Python writers alone, samples already in memory (3 KB of bytes
and a class number each, as many as the 3kb tree): fastload.ShardWriter,
webdataset.ShardWriter, streaming.MDSWriter, litdata.optimize (fn returning the sample).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

from _guard import require_module
from _harness import Rounds, Scale, Source, describe, import_fastload
from _peers import import_litdata, import_streaming, quiet
from data import imagenet_like_tree, keyed, tar_of_tars, tree_stats


@dataclasses.dataclass(frozen=True)
class Plan:
    small_files: int
    small_classes: int
    max_size: str
    tot_inner: int
    tot_per: int
    tot_kb: float
    tree_files: int | None = None  # None: the scale's tree (conftest's tree_src)
    tree_classes: int = 0


PLANS = {
    "small": Plan(2_000, 20, "1MB", 10, 30, 8),
    "full": Plan(200_000, 1_000, "100MB", 400, 100, 100, 40_000, 400),
}
TOOLS = ["fastload", "fastload-1thread", "webdataset", "litdata", "mosaicml"]
SEED = 0


def _fastload() -> ModuleType:
    return import_fastload()


@dataclasses.dataclass(frozen=True)
class Data:
    name: str
    source: Source
    files: list[tuple[str, str, int]]  # (relative path, key, class) in key order; a tar
    # of tars: empty (read as a stream)


def _data(name: str, root: Path) -> Data:
    files, nbytes = tree_stats(root)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    index = {c: i for i, c in enumerate(classes)}
    listing = []
    for c in classes:
        for f in sorted(os.listdir(root / c)):
            listing.append((f"{c}/{f}", f"{c}/{f.split('.', 1)[0]}", index[c]))
    return Data(name, Source(root, files, nbytes), listing)


def _tot(plan: Plan) -> Data:
    inner, per, kb = plan.tot_inner, plan.tot_per, plan.tot_kb
    path = tar_of_tars(keyed("xtot", inner=inner, per=per, kb=kb, s=0) / "train.tar", inner,
                       per, kb, seed=0, fmt="gnu")  # fmt: skip
    return Data("tot", Source(path, inner * per, path.stat().st_size), [])


@pytest.fixture(scope="session", params=["tree", "3kb", "tot"])
def data(request: pytest.FixtureRequest, scale: Scale, tree_src: Source) -> Data:
    plan = PLANS[scale.name]
    if request.param == "tree":
        if plan.tree_files is None:
            return _data("tree", tree_src.path)
        n, c = plan.tree_files, plan.tree_classes
        return _data("tree", imagenet_like_tree(keyed("tree", n=n, c=c, kb=100, s=0), n, c, 100))
    if request.param == "tot":
        return _tot(plan)
    n, c = plan.small_files, plan.small_classes
    root = imagenet_like_tree(keyed("tree", n=n, c=c, kb=3, s=0), n, c, 3, seed=0)
    return _data("3kb", root)


def _ordered(d: Data, shuffle: bool) -> list[tuple[str, str, int]]:
    files = list(d.files)
    if shuffle:
        random.Random(SEED).shuffle(files)
    return files


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# --- the tools ----------------------------------------------------------------------------


def _run_fastload(
    d: Data, shuffle: bool, max_size: str, threads: int | None
) -> Callable[[Path], int]:
    fl = _fastload()

    def run(dst: Path) -> int:
        r = fl.pack(d.source.path, dst, shuffle=shuffle, seed=SEED, max_size=max_size,
                    workers=threads)  # fmt: skip
        return int(r.samples)

    return run


def _run_webdataset(d: Data, shuffle: bool, max_size: str) -> Callable[[Path], int]:
    wds = require_module("webdataset")
    fl = _fastload()
    limit = fl._util.parse_size(max_size)
    if d.name == "tot":
        if shuffle:
            pytest.skip("webdataset cannot fully shuffle a stream without extracting it")
        return _webdataset_stream(wds, d, limit)

    def run(dst: Path) -> int:
        dst.mkdir()
        n = 0
        with wds.ShardWriter(str(dst / "shard-%06d.tar"), maxcount=10**9, maxsize=limit,
                             verbose=0) as w:  # fmt: skip
            for rel, key, cls in _ordered(d, shuffle):
                ext = rel.rsplit(".", 1)[1]
                w.write({"__key__": key, ext: _read(d.source.path / rel), "cls": cls})
                n += 1
        return n

    return run


def _tot_members(path: Path) -> Iterator[tuple[int, str, str, bytes]]:
    """A tar of tars read as a stream with tarfile, each member tar a class: (class
    number, the member tar's name without ``.tar``, inner member name, its bytes)."""
    with tarfile.open(path, "r|") as outer:
        for cls, m in enumerate(outer):
            f = outer.extractfile(m)
            assert f is not None
            with tarfile.open(fileobj=f, mode="r|") as inner:
                for im in inner:
                    g = inner.extractfile(im)
                    assert g is not None
                    yield cls, m.name[:-4], im.name, g.read()


def _webdataset_stream(wds: ModuleType, d: Data, limit: int) -> Callable[[Path], int]:
    """A tar of tars, read as a stream with tarfile: each member tar is a class."""

    def run(dst: Path) -> int:
        dst.mkdir()
        n = 0
        with wds.ShardWriter(
            str(dst / "shard-%06d.tar"), maxcount=10**9, maxsize=limit, verbose=0
        ) as w:
            for cls, folder, name, payload in _tot_members(d.source.path):
                key, ext = name.split(".", 1)
                w.write({"__key__": f"{folder}/{key}", ext: payload, "cls": cls})
                n += 1
        return n

    return run


def _litdata_optimize(fn: Callable[[Any], Any], inputs: list[Any], dst: Path, max_size: str) -> int:
    """litdata.optimize over ``inputs`` into ``dst``; returns the samples its index holds
    (optimize reports a failed worker but returns)."""
    ld = import_litdata()
    with quiet():
        ld.optimize(fn=fn, inputs=inputs, output_dir=str(dst), chunk_bytes=max_size,
                    num_workers=os.cpu_count() or 1, reorder_files=False,
                    start_method="fork", verbose=False)  # fmt: skip
    index = json.loads((dst / "index.json").read_text())
    return sum(int(c["chunk_size"]) for c in index["chunks"])


def _run_litdata(d: Data, shuffle: bool, max_size: str) -> Callable[[Path], int]:
    import_litdata()
    root = d.source.path

    # Forked workers (start_method="fork") inherit this closure; spawn, litdata's default,
    # would re-import the test module in each worker.
    def load(item: tuple[str, str, int]) -> dict[str, Any]:
        rel, key, cls = item
        return {"key": key, "data": _read(root / rel), "cls": cls}

    def run(dst: Path) -> int:
        return _litdata_optimize(load, _ordered(d, shuffle), dst, max_size)

    return run


def _run_mosaicml(d: Data, shuffle: bool, max_size: str) -> Callable[[Path], int]:
    streaming = import_streaming()
    fl = _fastload()
    limit = fl._util.parse_size(max_size)
    columns = {"key": "str", "data": "bytes", "cls": "int"}
    if d.name == "tot":
        if shuffle:
            pytest.skip("MDSWriter gets samples one by one: no full shuffle of a stream")
        return _mosaicml_stream(streaming, d, limit, columns)

    def run(dst: Path) -> int:
        n = 0
        with streaming.MDSWriter(out=str(dst), columns=columns, size_limit=limit) as w:
            for rel, key, cls in _ordered(d, shuffle):
                w.write({"key": key, "data": _read(d.source.path / rel), "cls": cls})
                n += 1
        return n

    return run


def _mosaicml_stream(
    streaming: ModuleType, d: Data, limit: int, columns: dict[str, str]
) -> Callable[[Path], int]:
    """A tar of tars into MDS, read as a stream with tarfile like _webdataset_stream."""

    def run(dst: Path) -> int:
        n = 0
        with streaming.MDSWriter(out=str(dst), columns=columns, size_limit=limit) as w:
            for cls, folder, name, payload in _tot_members(d.source.path):
                key = name.split(".", 1)[0]
                w.write({"key": f"{folder}/{key}", "data": payload, "cls": cls})
                n += 1
        return n

    return run


def _runner(tool: str, d: Data, shuffle: bool, max_size: str) -> Callable[[Path], int]:
    if d.name == "tot" and tool == "litdata":
        pytest.skip("litdata.optimize maps a function over a list of inputs, not a stream")
    if tool == "fastload":
        return _run_fastload(d, shuffle, max_size, None)
    if tool == "fastload-1thread":
        return _run_fastload(d, shuffle, max_size, 1)
    if tool == "webdataset":
        return _run_webdataset(d, shuffle, max_size)
    if tool == "litdata":
        return _run_litdata(d, shuffle, max_size)
    if tool == "mosaicml":
        return _run_mosaicml(d, shuffle, max_size)
    raise ValueError(tool)


@pytest.mark.parametrize("order", ["shuffle", "ordered"])
@pytest.mark.parametrize("tool", TOOLS)
def test_pack(
    benchmark: Any, fresh: Rounds, tool: str, order: str, data: Data, scale: Scale
) -> None:
    plan = PLANS[scale.name]
    run = _runner(tool, data, order == "shuffle", plan.max_size)
    describe(benchmark, group=f"pack-{data.name}-{order}", tool=tool, src=data.source,
             cache="warm", scale=scale, max_size=plan.max_size)  # fmt: skip
    n = fresh.run(run, src=data.source.path, cache="warm")
    assert n == data.source.files


# --- the Python writers, from memory ---------------------------------------------------------


def _memory_samples(n: int) -> list[dict[str, Any]]:
    rng = random.Random(SEED)
    blobs = [rng.randbytes(3000) for _ in range(1000)]
    return [
        {"__key__": f"c{i % 1000:04d}/s{i:07d}", "jpg": blobs[i % 1000], "cls": i % 1000}
        for i in range(n)
    ]


@pytest.mark.parametrize("tool", ["fastload", "webdataset", "mosaicml", "litdata"])
def test_writer(benchmark: Any, fresh: Rounds, tool: str, scale: Scale, tmp_path: Path) -> None:
    plan = PLANS[scale.name]
    samples = _memory_samples(plan.small_files)
    limit = _fastload()._util.parse_size(plan.max_size)
    if tool == "fastload":
        fl = _fastload()

        def run(dst: Path) -> int:
            with fl.ShardWriter(dst, max_size=limit) as w:
                for s in samples:
                    w.write(s)
            return int(w.samples)
    elif tool == "webdataset":
        wds = require_module("webdataset")

        def run(dst: Path) -> int:
            dst.mkdir()
            with wds.ShardWriter(str(dst / "shard-%06d.tar"), maxcount=10**9, maxsize=limit,
                                 verbose=0) as w:  # fmt: skip
                for s in samples:
                    w.write(s)
            return len(samples)
    elif tool == "litdata":
        import_litdata()

        def sample(i: int) -> dict[str, Any]:
            return samples[i]  # forked workers: the samples are already in their memory

        def run(dst: Path) -> int:
            return _litdata_optimize(sample, list(range(len(samples))), dst, plan.max_size)
    else:
        streaming = import_streaming()
        columns = {"__key__": "str", "jpg": "bytes", "cls": "int"}

        def run(dst: Path) -> int:
            with streaming.MDSWriter(out=str(dst), columns=columns, size_limit=limit) as w:
                for s in samples:
                    w.write(s)
            return len(samples)

    nbytes = sum(len(s["jpg"]) for s in samples)
    describe(benchmark, group="writer-3kb", tool=tool, src=Source(tmp_path, len(samples), nbytes),
             cache="warm", scale=scale, max_size=plan.max_size)  # fmt: skip
    assert fresh.run(run, src=tmp_path, cache="none") == len(samples)
