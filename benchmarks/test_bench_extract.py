"""Archive extraction benchmarks (issue 3): fastload.stage() on archives side by side with
what people run today, each group one parametrisation so report.py turns it into ratios.

Groups (each in a warm and a cold page-cache variant):
  extract-tar     ImageNet-like tar: fastload (uring, uring with every write buffered,
                  uring reading the archive instead of mapping it, pread), ``tar -xf``,
                  Python ``tarfile.extractall(filter="data")``
  extract-nested  the same files as a tar of class tars: fastload ``unpack="nested"``,
                  and the shell loop users write (``tar -xf`` the outer archive, then
                  ``tar -xf`` each inner tar into its directory and delete it)
  extract-gzip    the tar gzipped: fastload, ``tar -xzf``, ``pigz -dc | tar -x``
  extract-zstd    the tar as zstd: fastload, ``zstd -dc | tar -x``
  extract-tar-read  (issue 33) a tar taken out of the page cache (posix_fadvise, no
                  root needed): fastload's job reading it through the I/O engine, the
                  Python read-ahead (``FASTLOAD_NATIVE_READS=0``), on both engines, and
                  ``tar -xf``; at full scale 15,000 files, ~1.4 GiB
  extract-tar-sum-uncached  (issue 33) the same with a published sha256: hashed from
                  the job's reads or the Python read-ahead's, ``sha256sum -c && tar -xf``
  extract-tar-netsim(-dio)-none  (issue 33) the same tar on netsim, 2 ms per request,
                  with the page cache or FUSE direct_io: the job's reads (pread pool,
                  1 MiB stripes or whole blocks), the Python read-ahead, ``tar -xf``

Sizes: ``small`` (CI smoke: 300 files of ~8 KB in 10 classes) or ``full`` (40,000 files,
log-normal around 100 KB, ~3.8 GiB; the nested archive holds them in 400 inner tars).
Every round extracts into a fresh destination (``Rounds``: setup not timed, each round
ends with syncfs() of the destination when ``--bench-sync on``; at full scale on ext4
without a journal, a round starts a minute after the previous tree was deleted, see
``_harness.settle_deletions``), and every case checks
what it extracted (file count and bytes), so the smoke run is a correctness test too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Callable
from unittest import mock

import pytest

from _guard import missing
from _harness import Rounds, Scale, Source, check_cache, describe, import_fastload
from data import imagenet_like_tar, keyed, tar_of_tars, tree_stats

CACHES = ["warm", "cold"]


@dataclasses.dataclass(frozen=True)
class ExtractScale:
    files: int
    classes: int
    """Class directories of the flat archive, and inner tars of the nested one."""
    mean_kb: float


EXTRACT_SCALES = {
    "small": ExtractScale(300, 10, 8),
    "full": ExtractScale(40_000, 400, 100),
}
# Issue 33's case: an uncached tar of ~1.4 GiB at full scale (15,000 files, log-normal
# around 100 KB), read from the disk.
READ_SCALES = {
    "small": ExtractScale(300, 10, 8),
    "full": ExtractScale(15_000, 150, 100),
}


def _fastload() -> ModuleType:
    return import_fastload()


def _need(cmd: str) -> str:
    exe = shutil.which(cmd)
    if exe is None:
        missing(f"{cmd} is not installed")
    return exe


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _sh(script: str, *args: str) -> None:
    """``bash -c SCRIPT`` with positional arguments; a failing stage of a pipe fails."""
    subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script, "bash", *args],
        check=True,
        stdout=subprocess.DEVNULL,
    )


# --------------------------------------------------------------------------------------
# Data: each archive alone in its cache directory, so warming reads only it
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Archive:
    path: Path
    files: int
    """Regular files it extracts to (for the nested one: after unpacking inner tars)."""
    bytes: int

    def source(self) -> Source:
        return Source(self.path.parent, self.files, self.bytes)


def _counts_record(path: Path) -> Path:
    return path.parent / f".{path.name}.counts.json"


def _count(path: Path, nested: bool) -> tuple[int, int]:
    """(regular files, bytes) the archive extracts to, from its headers (cached beside
    it, keyed by its size and mtime)."""
    st = path.stat()
    key = [st.st_size, st.st_mtime_ns, nested]
    rec = _counts_record(path)
    try:
        saved = json.loads(rec.read_text())
        if saved["key"] == key:
            return saved["files"], saved["bytes"]
    except (OSError, ValueError, KeyError):
        pass
    files = size = 0
    with tarfile.open(path) as tf:
        for m in tf:
            if nested and m.isfile() and m.name.endswith(".tar"):
                f = tf.extractfile(m)
                assert f is not None
                with tarfile.open(fileobj=f) as inner:
                    for im in inner:
                        if im.isfile():
                            files += 1
                            size += im.size
            elif m.isfile():
                files += 1
                size += m.size
    rec.write_text(json.dumps({"key": key, "files": files, "bytes": size}))
    return files, size


def _compressed(plain: Path, kind: str) -> Path:
    """``plain`` compressed by pigz (gzip, level 6 as ``tar -czf``) or zstd (level 3, the
    zstd CLI default), in its own cache directory; rebuilt when ``plain`` changes."""
    suffix = {"gzip": ".tar.gz", "zstd": ".tar.zst"}[kind]
    st = plain.stat()
    out_dir = plain.parent.with_name(f"{plain.parent.name}-{kind}")
    out = out_dir / (plain.name.removesuffix(".tar") + suffix)
    rec = out_dir / f".{out.name}.params.json"
    want = json.dumps({"src": str(plain), "size": st.st_size, "mtime": st.st_mtime_ns})
    try:
        if out.exists() and rec.read_text() == want:
            return out
    except OSError:
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    rec.unlink(missing_ok=True)
    tmp = out_dir / f".{out.name}.tmp-{os.getpid()}"
    threads = str(os.cpu_count() or 1)
    with open(tmp, "wb") as f:
        if kind == "gzip":
            subprocess.run(
                [_need("pigz"), "-c", "-6", "-p", threads, str(plain)], stdout=f, check=True
            )
        else:
            subprocess.run(
                [_need("zstd"), "-q", "-c", "-3", f"-T{threads}", str(plain)], stdout=f, check=True
            )
    os.replace(tmp, out)
    rec.write_text(want)
    return out


@pytest.fixture(scope="session")
def xscale(scale: Scale) -> ExtractScale:
    return EXTRACT_SCALES[scale.name]


@pytest.fixture(scope="session")
def plain_tar(xscale: ExtractScale) -> Archive:
    n, c, kb = xscale.files, xscale.classes, xscale.mean_kb
    path = imagenet_like_tar(
        keyed("xtar", n=n, c=c, kb=kb, s=0) / "train.tar",
        n,
        c,
        kb,
        seed=0,
        fmt="gnu",
        tool="python",
    )
    return Archive(path, *_count(path, nested=False))


@pytest.fixture(scope="session")
def nested_tar(xscale: ExtractScale) -> Archive:
    inner, per = xscale.classes, xscale.files // xscale.classes
    kb = xscale.mean_kb
    path = tar_of_tars(
        keyed("xtot", inner=inner, per=per, kb=kb, s=0) / "train.tar",
        inner,
        per,
        kb,
        seed=0,
        fmt="gnu",
    )
    return Archive(path, *_count(path, nested=True))


@pytest.fixture(scope="session")
def gzip_tar(plain_tar: Archive) -> Archive:
    return dataclasses.replace(plain_tar, path=_compressed(plain_tar.path, "gzip"))


@pytest.fixture(scope="session")
def zstd_tar(plain_tar: Archive) -> Archive:
    return dataclasses.replace(plain_tar, path=_compressed(plain_tar.path, "zstd"))


# --------------------------------------------------------------------------------------
# Tools: fn(archive, dst) extracts into dst (which does not exist yet)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    run: Callable[[Path, Path], Any]


# Variants that turn one technique off, to show what it brings on this machine in the
# same rounds: "buffered" writes every member through the page cache (as before members
# of 64 KiB or more went O_DIRECT); "read" reads a cached archive into buffers instead of
# mapping it (as before extraction wrote members straight from the mapped archive).
_VARIANTS = {
    "": ("", {}),
    "buffered": (" (buffered writes)", {"FASTLOAD_DIRECT_WRITES": "0"}),
    "read": (" (archive read, not mapped)", {"FASTLOAD_MAPPED_READS": "0"}),
    # Issue 33: the archive read by the Python read-ahead (a preadv pool feeding the job
    # block by block), as before the job read it itself through the I/O engine.
    "pyread": (" (Python read-ahead)", {"FASTLOAD_NATIVE_READS": "0"}),
    # Issue 33: a published checksum (sha256), hashed from the job's reads on its hasher
    # thread, or from the Python read-ahead's blocks on a Python thread.
    # Issue 33: on a network file system, the job's reads in whole blocks, not stripes.
    "nostripe": (" (whole-block reads)", {"FASTLOAD_READ_STRIPE": "0"}),
    "sum": (" (sha256)", {}),
    "sum-pyread": (" (sha256, Python read-ahead)", {"FASTLOAD_NATIVE_READS": "0"}),
}
_SUMMED = {"sum", "sum-pyread"}


def _sha256_record(path: Path) -> Path:
    return path.parent / f".{path.name}.sha256.json"


def sha256_of(path: Path) -> str:
    """The archive's sha256 (cached beside it, keyed by its size and mtime), read with
    the page cache left as it was found."""
    import hashlib

    st = path.stat()
    key = [st.st_size, st.st_mtime_ns]
    rec = _sha256_record(path)
    try:
        saved = json.loads(rec.read_text())
        if saved["key"] == key:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    rec.write_text(json.dumps({"key": key, "sha256": digest}))
    return digest


def _fastload_tool(engine: str, unpack: Any, variant: str = "") -> Tool:
    fl = _fastload()
    if engine != "auto" and engine not in fl.available_engines():
        missing(f"fastload engine {engine!r} is not available here")
    label, env = _VARIANTS[variant]

    def run(archive: Path, dst: Path) -> Any:
        kwargs = {"checksum": f"sha256:{sha256_of(archive)}"} if variant in _SUMMED else {}
        with mock.patch.dict(os.environ, env):
            return fl.stage(archive, dst, engine=engine, unpack=unpack, **kwargs)

    return Tool(f"fastload-{engine}{label}", run)


def _tar_x(*flags: str) -> Callable[[Path, Path], None]:
    tar = _need("tar")

    def run(archive: Path, dst: Path) -> None:
        dst.mkdir()
        _run([tar, *flags, str(archive), "-C", str(dst)])

    return run


def _summed_tar_x() -> Callable[[Path, Path], None]:
    """What a user does with a published checksum: check it, then extract (two reads)."""
    sha, tar = _need("sha256sum"), _need("tar")

    def run(archive: Path, dst: Path) -> None:
        dst.mkdir()
        want = sha256_of(archive)
        _sh(f'echo "{want}  $1" | "{sha}" -c --quiet - && "{tar}" -xf "$1" -C "$2"',
            str(archive), str(dst))

    return run


def _pipe(decompressor: str) -> Callable[[Path, Path], None]:
    exe, tar = _need(decompressor), _need("tar")

    def run(archive: Path, dst: Path) -> None:
        dst.mkdir()
        _sh(f'"{exe}" -dc "$1" | "{tar}" -x -C "$2"', str(archive), str(dst))

    return run


# The loop users write for ImageNet's train tar (Mila and Alliance docs do the same).
_SHELL_LOOP = """
tar -xf "$1" -C "$2"
cd "$2"
for f in *.tar; do
    d="${f%.tar}"
    mkdir -p "$d"
    tar -xf "$f" -C "$d"
    rm "$f"
done
"""


def _shell_loop(archive: Path, dst: Path) -> None:
    dst.mkdir()
    _sh(_SHELL_LOOP, str(archive), str(dst))


def _tarfile_extractall(archive: Path, dst: Path) -> None:
    with tarfile.open(archive) as tf:
        tf.extractall(dst, filter="data")


def make_tool(name: str) -> Tool:
    if name.startswith("fastload-"):
        engine, _, mode = name.removeprefix("fastload-").partition("/")
        if mode == "nested":
            return _fastload_tool(engine, "nested")
        return _fastload_tool(engine, "auto", mode)
    if name == "tar":
        return Tool("tar -xf", _tar_x("-xf"))
    if name == "sha256sum+tar":
        return Tool("sha256sum && tar -xf", _summed_tar_x())
    if name == "tar-z":
        return Tool("tar -xzf", _tar_x("-xzf"))
    if name == "tarfile":
        if not hasattr(tarfile, "data_filter"):
            missing("this Python's tarfile has no extraction filters")
        return Tool("tarfile.extractall", _tarfile_extractall)
    if name == "shell-loop":
        _need("tar")
        return Tool("tar -xf + shell loop over inner tars", _shell_loop)
    if name == "pigz":
        return Tool("pigz -dc \\| tar -x", _pipe("pigz"))
    if name == "zstd":
        return Tool("zstd -dc \\| tar -x", _pipe("zstd"))
    raise ValueError(f"unknown tool {name!r}")


# --------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------


def _check(tool: Tool, archive: Archive, dst: Path, result: Any, nested: bool) -> None:
    assert tree_stats(dst) == (archive.files, archive.bytes), (
        f"{tool.name}: extracted {tree_stats(dst)}, expected {(archive.files, archive.bytes)}"
    )
    if nested:
        left = list(dst.rglob("*.tar"))
        assert not left, f"{tool.name}: inner tars left: {left[:3]}"
    if tool.name.startswith("fastload"):
        assert not result.skipped
        assert (result.files, result.bytes) == (archive.files, archive.bytes)


def _extract_case(
    benchmark: Any,
    fresh: Rounds,
    scale: Scale,
    archive: Archive,
    tool_name: str,
    cache: str,
    group: str,
    *,
    nested: bool = False,
) -> None:
    check_cache(cache)
    tool = make_tool(tool_name)
    src = archive.source()
    describe(
        benchmark,
        group=f"{group}-{cache}",
        tool=tool.name,
        src=src,
        cache=cache,
        scale=scale,
        archive_bytes=archive.path.stat().st_size,
    )
    result = fresh.run(lambda dst: tool.run(archive.path, dst), src=src.path, cache=cache)
    if tool.name.startswith("fastload"):
        benchmark.extra_info["engine"] = result.engine
    assert fresh.last is not None
    _check(tool, archive, fresh.last, result, nested)


@pytest.mark.parametrize(
    "tool",
    [
        "fastload-uring",
        "fastload-uring/buffered",
        "fastload-uring/read",
        "fastload-pread",
        "tar",
        "tarfile",
    ],
)
@pytest.mark.parametrize("cache", CACHES)
def test_extract_tar(
    benchmark: Any, fresh: Rounds, scale: Scale, plain_tar: Archive, tool: str, cache: str
) -> None:
    _extract_case(benchmark, fresh, scale, plain_tar, tool, cache, "extract-tar")


@pytest.mark.parametrize("tool", ["fastload-uring/nested", "fastload-pread/nested", "shell-loop"])
@pytest.mark.parametrize("cache", CACHES)
def test_extract_nested(
    benchmark: Any, fresh: Rounds, scale: Scale, nested_tar: Archive, tool: str, cache: str
) -> None:
    _extract_case(benchmark, fresh, scale, nested_tar, tool, cache, "extract-nested", nested=True)


@pytest.mark.parametrize("tool", ["fastload-uring", "fastload-pread", "tar-z", "pigz"])
@pytest.mark.parametrize("cache", CACHES)
def test_extract_gzip(
    benchmark: Any,
    fresh: Rounds,
    scale: Scale,
    tool: str,
    cache: str,
    request: pytest.FixtureRequest,
) -> None:
    _need("pigz")  # makes the archive
    archive = request.getfixturevalue("gzip_tar")
    _extract_case(benchmark, fresh, scale, archive, tool, cache, "extract-gzip")


@pytest.mark.parametrize("tool", ["fastload-uring", "fastload-pread", "zstd"])
@pytest.mark.parametrize("cache", CACHES)
def test_extract_zstd(
    benchmark: Any,
    fresh: Rounds,
    scale: Scale,
    tool: str,
    cache: str,
    request: pytest.FixtureRequest,
) -> None:
    _need("zstd")  # makes the archive
    archive = request.getfixturevalue("zstd_tar")
    _extract_case(benchmark, fresh, scale, archive, tool, cache, "extract-zstd")


@pytest.fixture(scope="session")
def read_tar(scale: Scale) -> Archive:
    x = READ_SCALES[scale.name]
    path = imagenet_like_tar(
        keyed("xread", n=x.files, c=x.classes, kb=x.mean_kb, s=1) / "train.tar",
        x.files,
        x.classes,
        x.mean_kb,
        seed=1,
        fmt="gnu",
        tool="python",
    )
    return Archive(path, *_count(path, nested=False))


@pytest.mark.parametrize(
    "tool",
    ["fastload-uring", "fastload-uring/pyread", "fastload-pread", "fastload-pread/pyread", "tar"],
)
def test_extract_tar_uncached(
    benchmark: Any, fresh: Rounds, scale: Scale, read_tar: Archive, tool: str
) -> None:
    """Issue 33: the archive out of the page cache (posix_fadvise, no root needed), read
    from the disk by the job itself through the I/O engine (O_DIRECT) or by the Python
    read-ahead, beside GNU tar; CPU per GB and the busiest thread in extra_info."""
    _extract_case(benchmark, fresh, scale, read_tar, tool, "uncached", "extract-tar-read")


@pytest.mark.parametrize(
    "tool", ["fastload-uring/sum", "fastload-uring/sum-pyread", "sha256sum+tar"]
)
def test_extract_tar_checksum(
    benchmark: Any, fresh: Rounds, scale: Scale, read_tar: Archive, tool: str
) -> None:
    """Issue 33: the uncached tar with a published sha256: hashed from the job's own
    reads on its hasher thread, or from the Python read-ahead's blocks, beside
    ``sha256sum -c && tar -xf``."""
    sha256_of(read_tar.path)  # before the rounds (each then drops the archive's pages)
    _extract_case(benchmark, fresh, scale, read_tar, tool, "uncached", "extract-tar-sum")


# Issue 33: the read tar through netsim, 2 ms per request (as the network
# file system), mounted on the archive's folder: with the page cache ("cached": the
# kernel's read-ahead sends the requests, at most max_background of them at a time) or
# without (NETSIM_DIRECT=1, FUSE direct_io: each read is its own requests, so the reads
# in flight are what covers the latency).
# FASTLOAD_BENCH_NETSIM_US: another latency (microseconds per request).
_NETSIM_US = os.environ.get("FASTLOAD_BENCH_NETSIM_US", "2000")


@pytest.fixture(scope="module")
def netsim_read_tar(
    read_tar: Archive, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Archive]]:
    """``mount(mode) -> Archive``: the read tar on its netsim mount of that mode
    ("cached" or "direct"), mounted once; unmounted at the end of the module."""
    from _harness import NETSIM, netsim_unavailable, unmount_netsim

    mounts: dict[str, Path] = {}

    def mount(mode: str) -> Archive:
        why = netsim_unavailable()
        if why:
            missing(why)
        if mode not in mounts:
            mnt = tmp_path_factory.mktemp(f"netsim-read-{mode}")
            env = dict(os.environ, NETSIM_DIRECT="1") if mode == "direct" else None
            r = subprocess.run(
                [str(NETSIM), "mount", str(read_tar.path.parent), str(mnt), _NETSIM_US, _NETSIM_US],
                capture_output=True, text=True, timeout=600, check=False, env=env,
            )  # fmt: skip
            if r.returncode != 0:
                missing(f"netsim mount failed: {(r.stderr or r.stdout).strip()}")
            mounts[mode] = mnt
        return dataclasses.replace(read_tar, path=mounts[mode] / read_tar.path.name)

    try:
        yield mount
    finally:
        for mnt in mounts.values():
            unmount_netsim(mnt)


# GNU tar reads 10 KiB at a time: through direct_io, one 2 ms request each (minutes at
# full scale); it runs on the cached mount only.
_NETSIM_CASES = [
    (mode, tool)
    for mode in ("cached", "direct")
    for tool in ("fastload-auto", "fastload-auto/nostripe", "fastload-auto/pyread", "tar")
    if not (mode == "direct" and tool == "tar")
]


@pytest.mark.netsim
@pytest.mark.parametrize(("mode", "tool"), _NETSIM_CASES)
def test_extract_tar_netsim(
    benchmark: Any,
    fresh: Rounds,
    scale: Scale,
    netsim_read_tar: Callable[[str], Archive],
    mode: str,
    tool: str,
) -> None:
    """Issue 33: the tar on a FUSE mount adding 2 ms per request: read by the job
    itself (the pread pool, the engine rule's choice there; in 1 MiB stripes, or whole
    8 MiB blocks) or by the Python read-ahead, beside GNU tar. The mount drops its page
    cache at every open."""
    archive = netsim_read_tar(mode)
    group = "extract-tar-netsim" if mode == "cached" else "extract-tar-netsim-dio"
    _extract_case(benchmark, fresh, scale, archive, tool, "none", group)
