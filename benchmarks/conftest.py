"""Shared benchmark machinery: the scale, the data sets, cache control, fresh destinations
and the simulated network mount.

Scale: ``--bench-scale small|full`` or ``FASTLOAD_BENCH_SCALE`` (default ``small``, what
CI runs as a smoke test with ``--benchmark-disable``).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from _guard import missing
from _harness import NETSIM, SCALES, Rounds, Scale, Source, netsim_unavailable, unmount_netsim
from data import imagenet_like_tree, keyed, large_files, tree_stats

# Per metadata request, per read request: 1 ms, or FASTLOAD_BENCH_NETSIM_MS (issue 33: the
# in-flight rule on a 2 ms and a 10 ms mount).
_NETSIM_US = str(round(1000 * float(os.environ.get("FASTLOAD_BENCH_NETSIM_MS", "1"))))
NETSIM_LATENCY_US = (_NETSIM_US, _NETSIM_US)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench-scale",
        choices=sorted(SCALES),
        default=os.environ.get("FASTLOAD_BENCH_SCALE", "small"),
        help="benchmark data size: small (CI smoke) or full (FASTLOAD_BENCH_SCALE)",
    )
    parser.addoption(
        "--bench-sync",
        choices=["on", "off"],
        default=os.environ.get("FASTLOAD_BENCH_SYNC", "on"),
        help="end each copy round with syncfs() of the destination: on, every tool is timed "
        "to its data on disk (default); off, to its return, which is what a job waits for "
        "(fastload, like cp and tar, returns before the disk has caught up unless "
        "sync=True) (FASTLOAD_BENCH_SYNC)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "netsim: reads through the simulated network file system (FUSE, root)"
    )


@pytest.fixture(scope="session", autouse=True)
def _peer_scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keeps the peers' scratch files out of the shared temp dir: litdata's optimize()
    stages chunks in ``$TMPDIR/chunks`` and ``$TMPDIR/data`` unless told otherwise
    (pointed at this session's temp dir here); MosaicML streaming leaves a lock file per
    dataset (``000012_barrier_filelock``, ``..._cache_filelock``), removed at the end."""
    import tempfile

    scratch = tmp_path_factory.mktemp("peer-scratch")
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("*_filelock"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DATA_OPTIMIZER_CACHE_FOLDER", str(scratch / "chunks"))
        mp.setenv("DATA_OPTIMIZER_DATA_CACHE_FOLDER", str(scratch / "data"))
        yield
    for path in set(tmp.glob("*_filelock")) - before:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def scale(pytestconfig: pytest.Config) -> Scale:
    name = pytestconfig.getoption("--bench-scale")
    if name not in SCALES:
        raise pytest.UsageError(f"unknown bench scale {name!r}; expected one of {sorted(SCALES)}")
    return SCALES[name]


# --- data sets -------------------------------------------------------------------------


def _source(path: Path) -> Source:
    files, nbytes = tree_stats(path)
    return Source(path, files, nbytes)


@pytest.fixture(scope="session")
def tree_src(scale: Scale) -> Source:
    """The ImageNet-like tree of this scale."""
    n, c, kb = scale.tree_files, scale.tree_classes, scale.tree_mean_kb
    return _source(imagenet_like_tree(keyed("tree", n=n, c=c, kb=kb, s=0), n, c, kb, seed=0))


@pytest.fixture(scope="session")
def large_src(scale: Scale) -> Source:
    """A directory of a few large files."""
    n, size = scale.large_count, scale.large_bytes
    return _source(large_files(keyed("large", n=n, size=size, s=0), n, size, seed=0))


@pytest.fixture(scope="session")
def netsim_tree_src(scale: Scale) -> Source:
    n, c, kb = scale.netsim_files, scale.netsim_classes, scale.tree_mean_kb
    return _source(imagenet_like_tree(keyed("tree", n=n, c=c, kb=kb, s=1), n, c, kb, seed=1))


# --- fresh destinations ----------------------------------------------------------------


@pytest.fixture
def fresh(
    benchmark: Any, tmp_path: Path, scale: Scale, pytestconfig: pytest.Config
) -> Iterator[Rounds]:
    sync = pytestconfig.getoption("--bench-sync") == "on"
    benchmark.extra_info["sync"] = sync
    r = Rounds(benchmark, tmp_path, scale, sync=sync)
    yield r
    r.clean()


# --- simulated network storage ---------------------------------------------------------


@pytest.fixture(scope="session")
def netsim_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[Path], Path]]:
    """``mount(src) -> mnt``: ``src`` seen through the latency-adding FUSE file system
    (1 ms per metadata and per read request, or FASTLOAD_BENCH_NETSIM_MS). Mounts once
    per source; all are unmounted at the end of the session."""
    mounts: dict[Path, Path] = {}

    def mount(src: Path) -> Path:
        why = netsim_unavailable()
        if why:
            missing(why)
        if src in mounts:
            return mounts[src]
        mnt = tmp_path_factory.mktemp("netsim")
        r = subprocess.run(
            [str(NETSIM), "mount", str(src), str(mnt), *NETSIM_LATENCY_US],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if r.returncode != 0:
            missing(f"netsim mount failed: {(r.stderr or r.stdout).strip()}")
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if time.monotonic() > deadline:
                missing("netsim mount did not appear")
            time.sleep(0.05)
        mounts[src] = mnt
        return mnt

    yield mount
    for mnt in mounts.values():
        unmount_netsim(mnt)
