"""Small objects of a prefix (issue 33): GETs awaited on one event-loop thread, the
bodies written natively in batches. One GET per non-empty object and no more in flight
than asked; an object replaced between the listing and its GET fails the stage with
SourceChangedError naming it, and what was written before is journalled (a resume
fetches the rest only); Ctrl-C stops a stage in a real process, which resumes."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from s3server import FaultProxy, S3Server, tree_of, upload

import fastload

pytestmark = pytest.mark.slow


def _objects(n: int, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"s/d{i % 5}/o{i:04d}.bin": rng.randbytes(rng.choice([0, 1, 700, 9000, 150_000]))
            for i in range(n)}  # fmt: skip


def _staged(out: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_of(out).items() if not k.rsplit("/", 1)[-1].startswith(".")}


def test_one_get_per_object_and_in_flight_bounded(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    files = _objects(300, seed=1)
    upload(s3, bucket, files)
    proxy.gate.clear()  # every GET waits at the gate: those in flight are all there
    got: list[fastload.StageResult] = []
    t = threading.Thread(target=lambda: got.append(
        fastload.stage(f"s3://{bucket}/s/", tmp_path / "o", workers=6, stats=True)))
    t.start()
    try:
        proxy.wait_in_flight(6)
        time.sleep(0.5)  # room for a seventh, were it sent
        assert proxy.in_flight == 6
    finally:
        proxy.gate.set()
        t.join(120)
    assert not t.is_alive() and got
    r = got[0]
    assert tree_of(tmp_path / "o") == {k[2:]: v for k, v in files.items()}
    assert proxy.gets() == sum(1 for v in files.values() if v)
    assert fastload.verify(tmp_path / "o").ok  # the digests written natively
    assert r.stats is not None and r.stats.read_busy_seconds > 0
    assert r.stats.write_busy_seconds > 0


def test_object_replaced_before_its_get_is_source_changed_and_resumes(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    files = {f"s/o{i:03d}.bin": random.Random(i).randbytes(2000 + i) for i in range(120)}
    upload(s3, bucket, files)
    out = tmp_path / "o"
    proxy.gate.clear()  # the GETs wait: the listing is taken, no body yet
    caught: list[BaseException] = []

    def run() -> None:
        try:
            fastload.stage(f"s3://{bucket}/s/", out, workers=4)
        except BaseException as e:
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        proxy.wait_in_flight(1)
        s3.client().put_object(Bucket=bucket, Key="s/o100.bin", Body=b"replaced")
    finally:
        proxy.gate.set()
        t.join(120)
    assert not t.is_alive()
    assert caught and isinstance(caught[0], fastload.SourceChangedError), caught
    assert f"s3://{bucket}/s/o100.bin" in str(caught[0])
    staged = _staged(out)
    assert staged and "o100.bin" not in staged
    assert all(files["s/" + k] == v for k, v in staged.items())  # whole objects only
    proxy.reset_counts()
    r = fastload.stage(f"s3://{bucket}/s/", out)
    files["s/o100.bin"] = b"replaced"
    assert tree_of(out) == {k[2:]: v for k, v in files.items()}
    # What was written before the error is journalled: not fetched again.
    assert r.copied_files == proxy.gets() == len(files) - len(staged)


_CHILD = """
import sys, fastload, faulthandler, signal
# A pytest started in the background by a script (CI's second one) ignores SIGINT, and
# a child inheriting that gets no KeyboardInterrupt: Python's own handler, explicitly.
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's hang report
fastload.stage(sys.argv[1], sys.argv[2], workers=4)
"""


def test_ctrl_c_stops_small_gets_and_the_stage_resumes(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    files = {f"s/o{i:04d}.bin": random.Random(i).randbytes(3000) for i in range(600)}
    upload(s3, bucket, files)
    # The GETs after the 60th wait at the proxy's gate: the child cannot finish the stage
    # before it is interrupted, however late this process gets to send the signal.
    proxy.hold_after_gets = 60
    out = tmp_path / "o"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, f"s3://{bucket}/s/", str(out)],
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if out.exists() and sum(1 for _ in out.iterdir()) >= 40:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the child never wrote 40 objects")
        child.send_signal(signal.SIGINT)
        try:
            _, err = child.communicate(timeout=120)  # a hang guard, not a timing
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR1)  # every thread's stack, to stderr
            time.sleep(2)
            child.kill()
            pytest.fail("the stage did not stop on SIGINT:\n" + child.communicate()[1][-8000:])
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        proxy.hold_after_gets = 0
        proxy.gate.set()
    assert child.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    staged = _staged(out)
    assert 40 <= len(staged) <= 60
    assert all(files["s/" + k] == v for k, v in staged.items())
    proxy.settle()
    proxy.reset_counts()
    r = fastload.stage(f"s3://{bucket}/s/", out)
    assert tree_of(out) == {k[2:]: v for k, v in files.items()}
    assert r.copied_files == proxy.gets() == len(files) - len(staged)
