"""Retries of object-store requests are counted (issue 36): the count a stage reports
(``stats.retries``, ``fastload stage --stats``) equals the faults the proxy injected in
front of the real server (503 SlowDown, resets, bodies cut short), by reason; a ranged
read cut short resumes at the byte it stopped at; what is not transient (404, a changed
object's 412, 416) is one request, not retried. And an object prefix's stats split the
fetchers' time between waiting for the store and writing."""

from __future__ import annotations

import errno
import random
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import cli
from fastload.errors import SourceChangedError
from fastload.sources.objstore import ObjectStore
from fastload.sources.retry import process_retries
from kit.tools import require_module
from sources.s3server import FaultProxy, S3Server, tree_of, upload


def _tree(n: int, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"d{i % 4}/f{i:03d}.bin": rng.randbytes(rng.randrange(1, 40_000))
             for i in range(n)}  # fmt: skip
    # Over a MiB (streamed in pieces) and over the 1 MiB stripe (ranged parts).
    files["mid.bin"] = rng.randbytes((1 << 20) + 300_000)
    files["big.bin"] = rng.randbytes(3 << 20)
    return files


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("fail_every", "throttled"), ("reset_every", "connection"),
     ("truncate_every", "short_body")],
)  # fmt: skip
def test_stage_counts_each_fault_as_one_retry(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path, fault: str, reason: str
) -> None:
    files = _tree(60, seed=36)
    upload(s3, bucket, files)
    setattr(proxy, fault, 4)
    proxy.truncate_at = 1000  # a body cut after its first kB (the smallest are not cut)
    r = fastload.stage(f"s3://{bucket}/", tmp_path / "out", stripe_size=1 << 20, stats=True)
    assert tree_of(tmp_path / "out") == files and fastload.verify(tmp_path / "out").ok
    st = r.stats
    assert st is not None
    assert proxy.faults >= 3
    assert st.retries == proxy.faults
    assert st.retry_reasons == {reason: proxy.faults}
    assert st.to_dict()["stage/retries"] == proxy.faults


def test_stage_stats_of_an_object_prefix_split_reads_and_writes(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Mixed faults: one retry per fault. The fetchers' time waiting for the store and
    writing is each there, and summed over the threads within the wall time times them."""
    files = _tree(120, seed=37)
    upload(s3, bucket, files)
    proxy.fail_every, proxy.reset_every, proxy.truncate_every = 7, 11, 5
    proxy.truncate_at = 1000
    workers = 8
    r = fastload.stage(f"s3://{bucket}/", tmp_path / "out", stripe_size=1 << 20, stats=True,
                       workers=workers)  # fmt: skip
    assert tree_of(tmp_path / "out") == files
    st = r.stats
    assert st is not None
    assert r.bytes == r.copied_bytes == sum(map(len, files.values()))
    assert st.retries == proxy.faults >= 10
    assert sum(st.retry_reasons.values()) == st.retries
    assert set(st.retry_reasons) <= {"throttled", "connection", "short_body"}
    # Small objects on ``workers`` threads, big ones' parts on 4 more.
    threads = workers + 4
    assert 0 < st.read_busy_seconds <= st.seconds * threads
    assert 0 < st.write_busy_seconds <= st.seconds * threads
    assert st.read_busy_seconds + st.write_busy_seconds <= st.seconds * threads
    assert st.meta_busy_seconds == 0
    # Without faults: no retries.
    proxy.fail_every = proxy.reset_every = proxy.truncate_every = 0
    again = fastload.stage(f"s3://{bucket}/", tmp_path / "again", stats=True)
    assert again.stats is not None and again.stats.retries == 0
    assert again.stats.retry_reasons == {}


def test_cli_stats_says_the_retries(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    files = _tree(30, seed=38)
    upload(s3, bucket, files)
    proxy.fail_every = 5
    assert cli.main(["stage", "--stats", f"s3://{bucket}/", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert proxy.faults >= 3
    assert f"  retries {proxy.faults} ({proxy.faults} throttled)" in out
    assert "in flight: reads " in out and "opens and closes" not in out


def test_a_part_cut_short_resumes_where_it_stopped(
    s3: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """The second request (a GET) is cut after 300 kB; the retry asks for the rest only:
    the proxy relays less than the object once, and the bytes are whole."""
    data = random.Random(39).randbytes(2 << 20)
    upload(s3, bucket, {"o.bin": data})
    store = ObjectStore(f"s3://{bucket}/")
    info = store.head("o.bin")  # request 1
    proxy.reset_counts()
    proxy.truncate_every, proxy.truncate_at = 2, 300_000  # request 2: cut
    view = memoryview(bytearray(len(data)))
    assert store.read_into("o.bin", 0, view, info.etag) == len(data)
    assert bytes(view) == data
    assert proxy.faults == 1 and store.retries.snapshot() == {"short_body": 1}
    assert proxy.gets() == 2
    # The resumed GET relayed what the cut one had not delivered, not the whole object.
    assert proxy.bytes_out < len(data)


def test_a_stream_cut_short_resumes(s3: S3Server, bucket: str, proxy: FaultProxy) -> None:
    """An object read as a stream (the sources registry's opener), every other GET cut:
    asked again from the last byte handed out (here none: its 8 MiB pieces), under the
    ETag of its first reply; whole, each cut one retry."""
    data = random.Random(42).randbytes(3 << 20)
    upload(s3, bucket, {"s.bin": data})
    store = ObjectStore(f"s3://{bucket}/")
    proxy.faults = 0
    proxy.truncate_every, proxy.truncate_at = 2, 500_000
    for _ in range(3):
        assert b"".join(store.stream("s.bin")) == data
    assert proxy.faults >= 1
    assert store.retries.snapshot() == {"short_body": proxy.faults}


def _fails_once(proxy: FaultProxy, fn: Any) -> BaseException:
    proxy.reset_counts()
    before = process_retries().total()
    with pytest.raises(OSError) as e:
        fn()
    assert proxy.gets() == 1, "asked once, not retried"
    assert process_retries().total() == before
    return e.value


def test_what_is_not_transient_is_not_retried(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    data = random.Random(40).randbytes(1 << 20)
    upload(s3, bucket, {"o.bin": data})
    store = ObjectStore(f"s3://{bucket}/")
    etag = store.head("o.bin").etag
    # 404: a missing key.
    e = _fails_once(proxy, lambda: store.get("missing.bin"))
    assert isinstance(e, FileNotFoundError) and "missing.bin" in str(e)
    # 412: the object changed (its ETag is not the one listed).
    e = _fails_once(proxy, lambda: store.get_range("o.bin", 0, 10, '"not-its-etag"'))
    assert isinstance(e, SourceChangedError)
    e = _fails_once(proxy, lambda: list(store.stream_range("o.bin", 0, len(data), '"x"')))
    assert isinstance(e, SourceChangedError)
    # 416: a range past the end.
    e = _fails_once(proxy, lambda: store.get_range("o.bin", 5 << 20, 6 << 20, etag))
    assert e.errno == errno.EIO and "o.bin" in str(e)
    assert store.retries.total() == 0
    # A changed object mid-stage: SourceChangedError, no retry (its GETs carry If-Match).
    upload(s3, bucket, {"p/a.bin": data})
    listed = ObjectStore(f"s3://{bucket}/p/").list()
    upload(s3, bucket, {"p/a.bin": data[::-1]})
    e = _fails_once(proxy, lambda: ObjectStore(f"s3://{bucket}/p/").get("a.bin", listed[0].etag))
    assert isinstance(e, SourceChangedError)


def test_an_unreachable_store_is_retried_then_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connection refused is transient: retried (8 times, counted), then one line."""
    require_module("obstore", "the s3 extra (obstore) is not installed")
    proxy = FaultProxy("http://127.0.0.1:9")
    port = proxy.endpoint
    proxy.close()  # nothing listens there now
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                 "AWS_ENDPOINT_URL": port, "AWS_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    store = ObjectStore("s3://nowhere/")
    with pytest.raises(OSError, match=r"connection refused \(after 8 retries\)") as e:
        store.head("k")
    assert e.value.errno == errno.EHOSTUNREACH and "\n" not in str(e.value)
    assert store.retries.snapshot() == {"connection": 8}


def test_remote_archive_stats(s3: S3Server, bucket: str, proxy: FaultProxy,
                              tmp_path: Path) -> None:  # fmt: skip
    """An archive object extracted as it streams in, through bodies cut short: each cut
    one retry (the block's GET resumed), the time in its ranged GETs and in the
    extractor both there."""
    import tarfile

    files = _tree(40, seed=41)
    src = tmp_path / "src"
    for k, v in files.items():
        (src / k).parent.mkdir(parents=True, exist_ok=True)
        (src / k).write_bytes(v)
    with tarfile.open(tmp_path / "a.tar", "w") as tf:
        tf.add(src, arcname=".")
    upload(s3, bucket, {"a.tar": (tmp_path / "a.tar").read_bytes()})
    # Every GET's body cut after 2 MB: the archive's (5 MB, one ranged read) resumes
    # a few times, each time from where it stopped (a whole refetch would never end).
    proxy.truncate_every, proxy.truncate_at = 1, 2_000_000
    r = fastload.stage(f"s3://{bucket}/a.tar", tmp_path / "out", stats=True)
    assert tree_of(tmp_path / "out") == files
    st = r.stats
    assert st is not None
    assert st.retries == proxy.faults >= 2 and st.retry_reasons == {"short_body": proxy.faults}
    from fastload.staging.readers import _PREFETCH

    assert 0 < st.read_busy_seconds <= st.seconds * _PREFETCH
    assert 0 < st.write_busy_seconds <= st.seconds
