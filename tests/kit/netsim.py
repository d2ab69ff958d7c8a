"""netsim (tests/kit/netsim.c): a FUSE mount that adds a fixed latency to every request,
like NFS or Lustre; read-only, or with ``write`` a destination that passes writes through
and has no O_TMPFILE (the kernel refuses one: EOPNOTSUPP); with ``direct``, no page cache
is shared between the processes reading it (like separate nodes), and ``stats`` counts
what it served (read when it is unmounted). Built on first use into build/netsim/ (``cc``
and libfuse3); the benchmarks load this module by path and use the same build."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().with_name("netsim.c")
BUILD = SOURCE.parents[2] / "build" / "netsim"
BINARY = BUILD / "netsim"
_PACKAGES = "apt-get install fuse3 libfuse3-dev pkg-config gcc"
_built: dict[str, str | None] = {}


def _build() -> str | None:
    """Compiles netsim.c when the binary is missing or older; why it cannot, or None."""
    if BINARY.exists() and BINARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("pkg-config") is None:
        return f"netsim needs a C compiler and pkg-config ({_PACKAGES})"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"],
                           capture_output=True, text=True, check=False)
    if flags.returncode != 0:
        return f"netsim needs libfuse3 ({_PACKAGES}): {flags.stderr.strip()}"
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = BUILD / f"netsim.{os.getpid()}"
    r = subprocess.run(
        [cc, "-O2", "-Wall", "-Wextra", "-Werror", str(SOURCE), "-o", str(tmp),
         *flags.stdout.split()],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"netsim did not compile: {r.stderr.strip()[-2000:]}"
    tmp.replace(BINARY)  # atomic: a concurrent session sees the old binary or this one
    return None


def netsim_unavailable() -> str | None:
    """Why netsim cannot run here, or None (building it on first use)."""
    if os.geteuid() != 0:
        return "netsim needs root"
    if not Path("/dev/fuse").exists():
        return "netsim needs /dev/fuse"
    if "why" not in _built:
        _built["why"] = _build()
    return _built["why"]


def binary() -> Path:
    """The built netsim; skips the test where it cannot be built (fails under CI)."""
    from kit.tools import missing

    why = netsim_unavailable()
    if why:
        missing(why)
    return BINARY


FUSECTL = Path("/sys/fs/fuse/connections")


def unmount(path: Path) -> bool:
    """Unmounts ``path``; returns whether it was busy (then it is detached, lazily)."""
    r = subprocess.run([str(BINARY), "umount", str(path)], capture_output=True, check=False)
    if r.returncode == 0 or not os.path.ismount(path):
        return False
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
    return True


def abort_connection(conn: int) -> bool:
    """Aborts FUSE connection ``conn`` (fusectl, as root: mounted here where it is not):
    its server sees the file system gone and exits. Returns whether it could."""
    if not (FUSECTL / str(conn)).exists():
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)],
                       capture_output=True, check=False)
    try:
        (FUSECTL / str(conn) / "abort").write_text("1")
    except OSError:
        return False
    return True


class Mount:
    """``src`` served at ``path``; :meth:`unmount` returns what was served."""

    def __init__(self, src: Path, path: Path, meta_us: int, read_us: int, direct: bool,
                 write: bool = False) -> None:
        from kit.tools import missing

        self.path = path
        self._stats = path.with_name(path.name + ".stats")
        self._stats.unlink(missing_ok=True)
        env = dict(os.environ, NETSIM_STATS=str(self._stats))
        if direct:
            env["NETSIM_DIRECT"] = "1"
        if write:
            env["NETSIM_WRITE"] = "1"
        r = subprocess.run(
            [str(binary()), "mount", str(src), str(path), str(meta_us), str(read_us)],
            capture_output=True, text=True, timeout=300, check=False, env=env,
        )  # fmt: skip
        if r.returncode != 0:
            missing(f"netsim mount failed: {(r.stderr or r.stdout).strip()}")
        # netsim returns once the kernel has the mount.
        assert os.path.ismount(path), f"netsim returned without a mount at {path}"
        self.mounted = True
        self.connection = os.minor(os.stat(path).st_dev)  # its number in fusectl

    def unmount(self) -> dict[str, int]:
        """Unmounts; the counts netsim wrote (``opens``, ``reads``, ``read_bytes``,
        ``meta``)."""
        busy = False
        if self.mounted:
            self.mounted = False
            busy = unmount(self.path)
        # The server writes the file whole (by rename) as it exits: once the kernel drops
        # the file system. Detached while busy, that is when the last user lets go. Now
        # and then (after a failed extraction, on a busy machine) the kernel keeps it for
        # over a minute while no process holds anything in it (no descriptor, mapping,
        # working directory or thread: seen in /proc), so after a grace period the
        # connection is aborted.
        start = time.monotonic()
        aborted = False
        while not self._stats.exists():
            waited = time.monotonic() - start
            if busy and not aborted and waited > 5:
                aborted = abort_connection(self.connection)
            assert waited < 60, f"netsim wrote no counts for {self.path} (busy: {busy})"
            time.sleep(0.02)
        out = {}
        for line in self._stats.read_text().splitlines():
            key, value = line.split()
            out[key] = int(value)
        assert set(out) == {"opens", "reads", "read_bytes", "meta"}, out
        return out


@contextlib.contextmanager
def mounts(tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """For a fixture: gives ``mount(src, meta_us, read_us, direct=False, write=False) ->
    Mount``;
    unmounts what is left at the end (skips the test where netsim cannot run, fails it
    under CI)."""
    binary()
    made: list[Mount] = []

    def mount(src: Path, meta_us: int, read_us: int, direct: bool = False,
              write: bool = False) -> Mount:
        m = Mount(src, tmp_path / f"mnt{len(made)}-{meta_us}-{read_us}", meta_us, read_us,
                  direct, write)
        made.append(m)
        return m

    try:
        yield mount
    finally:
        for m in made:
            m.unmount()


@contextlib.contextmanager
def staging_behind(tmp_path: Path, src: Path) -> Iterator[tuple[Mount, Path, Any]]:
    """The read-while-staging tests' start (issue 49): ``src`` behind netsim at 2 ms per
    request, staged in the background into ``tmp_path / "dst"`` with 2 files in flight
    (its own order takes seconds); gives the mount, the destination and the handle."""
    import fastload

    with mounts(tmp_path) as mount:
        m = mount(src, 2000, 2000)
        dst = tmp_path / "dst"
        yield m, dst, fastload.stage(m.path, dst, wait=False, workers=2)


def hold_the_listing(monkeypatch: Any) -> threading.Event:
    """The stager's plan of a tree (its listing: a walk stat'ing every file, or, on a
    fresh destination, the names walked before) is made only once the event returned
    is set: what a reader gets meanwhile comes before the plan."""
    from fastload.staging.tree import LocalTree

    go, plan = threading.Event(), LocalTree.plan

    def held(self: LocalTree, req: Any, dest: Any, listing: Any = None) -> Any:
        go.wait(120)
        return plan(self, req, dest, listing)

    monkeypatch.setattr(LocalTree, "plan", held)
    return go


def listed(h: Any, timeout: float = 120.0) -> None:
    """Until the stager's listing is made (its plan holds the source's sizes); fails,
    naming the stage's state, where it is not within ``timeout`` (a bound, not a timing
    figure)."""
    deadline = time.monotonic() + timeout
    while (p := h.progress()).files_total is None:
        assert time.monotonic() < deadline, f"no listing after {timeout:g} s: {p}"
        time.sleep(0.01)

