"""netsim (../shared/tools/netsim): a read-only FUSE mount that adds a fixed latency to
every request, like NFS or Lustre; with ``direct``, no page cache is shared between the
processes reading it (like separate nodes), and ``stats`` counts what it served (read
when it is unmounted)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

NETSIM = Path(os.environ.get("FASTLOAD_NETSIM", "/work/shared/tools/netsim/netsim"))


def netsim_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "netsim needs root"
    if not Path("/dev/fuse").exists():
        return "netsim needs /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "netsim needs fusermount3 (apt-get install fuse3)"
    if not NETSIM.exists():
        return f"netsim not found at {NETSIM}"
    return None


class Mount:
    """``src`` served at ``path``; :meth:`unmount` returns what was served."""

    def __init__(self, src: Path, path: Path, meta_us: int, read_us: int, direct: bool) -> None:
        self.path = path
        self._stats = path.with_name(path.name + ".stats")
        self._stats.unlink(missing_ok=True)
        env = dict(os.environ, NETSIM_STATS=str(self._stats))
        if direct:
            env["NETSIM_DIRECT"] = "1"
        r = subprocess.run(
            [str(NETSIM), "mount", str(src), str(path), str(meta_us), str(read_us)],
            capture_output=True, text=True, timeout=300, check=False, env=env,
        )  # fmt: skip
        if r.returncode != 0:
            pytest.skip(f"netsim mount failed: {(r.stderr or r.stdout).strip()}")
        deadline = time.monotonic() + 10
        while not os.path.ismount(path):
            assert time.monotonic() < deadline, "netsim mount did not appear"
            time.sleep(0.05)
        self.mounted = True

    def unmount(self) -> dict[str, int]:
        """Unmounts; the counts netsim wrote (``read_bytes``, ``reads``, ``opens``,
        ``meta``)."""
        if self.mounted:
            self.mounted = False
            r = subprocess.run([str(NETSIM), "umount", str(self.path)], capture_output=True)
            if r.returncode != 0 and os.path.ismount(self.path):
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        # netsim writes the file as it exits: wait for its last line ("meta").
        deadline = time.monotonic() + 30
        while True:
            text = self._stats.read_text() if self._stats.exists() else ""
            if "meta" in text or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "meta" in text, f"netsim wrote no counts for {self.path}"
        out = {}
        for line in text.splitlines():
            key, value = line.split()
            out[key] = int(value)
        return out


@contextlib.contextmanager
def mounts(tmp_path: Path) -> Iterator[Callable[..., Mount]]:
    """For a fixture: gives ``mount(src, meta_us, read_us, direct=False) -> Mount``;
    unmounts what is left at the end (skips the test where netsim cannot run)."""
    why = netsim_unavailable()
    if why:
        pytest.skip(why)
    made: list[Mount] = []

    def mount(src: Path, meta_us: int, read_us: int, direct: bool = False) -> Mount:
        m = Mount(src, tmp_path / f"mnt{len(made)}-{meta_us}-{read_us}", meta_us, read_us, direct)
        made.append(m)
        return m

    try:
        yield mount
    finally:
        for m in made:
            m.unmount()
