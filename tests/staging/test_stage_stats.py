"""stage(..., stats=True) and ``fastload stage --stats`` (issue 36): the time waiting for
the node lock, before the first byte, copying, the CPU time, and bytes and files done
over time, from a real stage of a real tree."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import cli
from fastload._util import node_lock
from kit import procs, trees


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stats") / "src"
    trees.build_small_files(root / "small", 300, seed=36)
    trees.write_patterned(root / "big.bin", 48 * trees.MiB, seed=36)
    return root


def test_stats_of_a_stage(src: Path, tmp_path: Path, stage: Any) -> None:
    calls: list[tuple[int, int, int, int]] = []
    r = stage(src, tmp_path / "dst", stats=True, progress=lambda *a: calls.append(a))
    st = r.stats
    assert st is not None
    # The progress callback still gets every report the samples were taken from.
    assert [(b, f) for _, b, f in st.samples] == [(c[0], c[2]) for c in calls]
    assert st.samples, "a stage that copies reports its progress at least at its end"
    assert st.samples[-1][1:] == (r.bytes, r.files) == (r.copied_bytes, r.copied_files)
    times = [t for t, _, _ in st.samples]
    assert times == sorted(times) and times[-1] <= st.seconds
    done = [b for _, b, _ in st.samples]
    assert done == sorted(done)
    assert st.lock_wait_seconds >= 0 and st.setup_seconds >= 0 and st.copy_seconds >= 0
    assert st.lock_wait_seconds + st.setup_seconds + st.copy_seconds <= st.seconds
    assert st.cpu_user_seconds + st.cpu_system_seconds > 0
    assert all(bps >= 0 and fps >= 0 for _, bps, fps in st.rates())
    # Listing and planning happen between the lock and the first byte.
    assert st.listing_seconds > 0 and st.planning_seconds > 0
    assert st.listing_seconds + st.planning_seconds <= st.setup_seconds + st.copy_seconds
    # The copier's reads, writes and opens each had time in flight; summed over its
    # threads, each is at most the wall time times the threads.
    threads = max(1, len(os.sched_getaffinity(0)))
    for busy in (st.read_busy_seconds, st.write_busy_seconds, st.meta_busy_seconds):
        assert 0 < busy <= st.seconds * min(8, threads)
    d = st.to_dict()
    assert d["stage/seconds"] == st.seconds and "stage/lock_wait_s" in d
    assert d["stage/read_busy_s"] == st.read_busy_seconds
    # Without stats: none.
    assert fastload.stage(src, tmp_path / "dst2").stats is None


def test_skipped_stage_stats(src: Path, tmp_path: Path) -> None:
    fastload.stage(src, tmp_path / "dst")
    r = fastload.stage(src, tmp_path / "dst", stats=True)
    assert r.skipped and r.stats is not None
    assert r.stats.samples == [] and r.stats.copy_seconds == 0
    # Listed and compared, nothing read or written.
    assert r.stats.listing_seconds > 0 and r.stats.planning_seconds > 0
    assert r.stats.read_busy_seconds == r.stats.write_busy_seconds == 0


def test_lock_wait_is_counted(src: Path, tmp_path: Path) -> None:
    """Another holder of the node lock: the stage's lock wait covers at least the time
    from when the kernel showed it blocked on the lock (/proc/locks) to the release (a
    lower bound on the same clock, whatever the machine's load)."""
    dst = tmp_path / "dst"
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with node_lock(Path(dst).absolute()):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(60)
    out: list[Any] = []
    stager = threading.Thread(target=lambda: out.append(fastload.stage(src, dst, stats=True)))
    stager.start()
    procs.wait_blocked_on_lock(os.getpid())  # the stager's flock, beside the holder's
    blocked = time.monotonic()
    procs.wait_blocked_on_lock(os.getpid())  # still blocked: the interval is not empty
    released = time.monotonic()  # before the release: the stager's wait ends after it
    release.set()
    stager.join(120)
    holder.join()
    (r,) = out
    assert released > blocked
    assert r.stats.lock_wait_seconds >= released - blocked
    assert r.stats.lock_wait_seconds < r.stats.seconds


def test_cli_stats(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["stage", "--stats", str(src), str(tmp_path / "dst")]) == 0
    out = capsys.readouterr().out
    assert "lock wait" in out and "before the first progress" in out and "cpu " in out
    assert "(listing " in out and "in flight: reads " in out
    assert cli.main(["stage", str(src), str(tmp_path / "dst3")]) == 0
    assert "lock wait" not in capsys.readouterr().out


@pytest.mark.parametrize("mapped", ["0", "1"])
def test_archive_stats_split_reads_and_writes(src: Path, tmp_path: Path, mapped: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An archive's stats: the time in reads of the archive (summed over the reading
    threads; none when it is mapped) and the feeding thread's time in the extractor,
    each within the wall time times the threads that spend it."""
    import tarfile

    archive = tmp_path / "src.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(src, arcname=".")
    monkeypatch.setenv("FASTLOAD_MAPPED_READS", mapped)
    r = fastload.stage(archive, tmp_path / "dst", stats=True)
    st = r.stats
    assert st is not None and not r.skipped
    assert r.bytes == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert st.samples[-1][1] == archive.stat().st_size  # progress: the archive's bytes
    from fastload.staging.readers import _PREFETCH

    if mapped == "1":
        assert st.read_busy_seconds == 0
    else:
        assert 0 < st.read_busy_seconds <= st.seconds * _PREFETCH
    assert 0 < st.write_busy_seconds <= st.seconds  # one feeding thread
    assert st.meta_busy_seconds == 0 and st.retries == 0
