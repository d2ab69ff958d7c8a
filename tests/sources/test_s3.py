"""stage() and resolve() from an S3 bucket: a real S3 server (SeaweedFS) on loopback,
behind a proxy that counts requests and injects faults."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import KEY_ID, SECRET, FaultProxy, S3Server, tree_of, upload, upload_file

import fastload
from kit.tools import require_module, require_tool

pytestmark = pytest.mark.slow


def _random_tree(n: int, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {
        f"d{i % 7}/sub{i % 3}/f{i:05d}.bin": rng.randbytes(rng.choice([0, 10, 3000, 20000]))
        for i in range(n)
    }
    files["top.txt"] = b"at the top"
    return files


def test_tree_unchanged_changed_removed(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    files = _random_tree(1200)
    upload(s3, bucket, files)
    out = tmp_path / "out"
    r = fastload.stage(f"s3://{bucket}/", out)
    assert (r.files, r.copied_files, r.skipped) == (len(files), len(files), False)
    assert r.bytes == sum(len(v) for v in files.values())
    assert tree_of(out) == files
    assert fastload.verify(out).ok
    # One GET per object; an empty one needs none (its bytes are known from the listing).
    assert proxy.gets() == sum(1 for v in files.values() if v)

    proxy.reset_counts()
    again = fastload.stage(f"s3://{bucket}/", out)
    assert again.skipped
    assert proxy.gets() == 0 and proxy.requests["LIST"] >= 1  # one listing, no GET

    client = s3.client()
    files["d1/sub1/f00001.bin"] = b"changed content"
    client.put_object(Bucket=bucket, Key="d1/sub1/f00001.bin", Body=files["d1/sub1/f00001.bin"])
    client.delete_object(Bucket=bucket, Key="d2/sub2/f00002.bin")
    del files["d2/sub2/f00002.bin"]
    proxy.reset_counts()
    third = fastload.stage(f"s3://{bucket}/", out)
    assert (third.copied_files, third.skipped) == (1, False)
    assert proxy.gets() == 1
    assert tree_of(out) == files
    assert fastload.verify(out).ok


def test_prefix_without_slash_include_exclude(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    files = _random_tree(60)
    upload(s3, bucket, files)
    want = {k[len("d3/"):]: v for k, v in files.items() if k.startswith("d3/")}
    r = fastload.stage(f"s3://{bucket}/d3", tmp_path / "d3")
    assert r.files == len(want) and tree_of(tmp_path / "d3") == want
    only = fastload.stage(
        f"s3://{bucket}/", tmp_path / "some", include=["*/sub1/*"], exclude=["*00019.bin"]
    )
    picked = {
        k: v for k, v in files.items() if "/sub1/" in k and not k.endswith("00019.bin")
    }
    assert only.files == len(picked) and tree_of(tmp_path / "some") == picked


def test_big_object_in_parts_and_single_objects(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    big = random.Random(1).randbytes((5 << 20) + 12345)
    upload(s3, bucket, {"data/big.bin": big, "data/small.bin": b"x" * 100})
    r = fastload.stage(f"s3://{bucket}/data/", tmp_path / "t", stripe_size=1 << 20)
    assert (tmp_path / "t/big.bin").read_bytes() == big
    assert proxy.gets() == 6 + 1  # six ranged parts, one whole small object
    assert fastload.verify(tmp_path / "t").ok and r.files == 2
    # One object: lands at the destination, or inside an existing directory.
    one = fastload.stage(f"s3://{bucket}/data/small.bin", tmp_path / "one.bin")
    assert one.path == tmp_path / "one.bin" and one.path.read_bytes() == b"x" * 100
    (tmp_path / "into").mkdir()
    inside = fastload.stage(f"s3://{bucket}/data/big.bin", tmp_path / "into")
    assert inside.path == tmp_path / "into/big.bin" and inside.path.read_bytes() == big
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/data/big.bin", tmp_path / "into").skipped
    assert proxy.gets() == 0


def test_mid_sized_objects_stream_through_faults(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Objects over a MiB and under a part (one GET each, written as they stream in),
    through truncated bodies and resets: whole, with the digests verify() expects."""
    rng = random.Random(6)
    files = {f"m/o{i}.bin": rng.randbytes((1 << 20) + rng.randrange(1, 3 << 20))
             for i in range(6)}  # fmt: skip
    files["m/small.bin"] = b"s" * 10
    upload(s3, bucket, files)
    proxy.truncate_every = 3
    proxy.truncate_at = 700_000  # after the first pieces were written
    proxy.reset_every = 5
    r = fastload.stage(f"s3://{bucket}/m/", tmp_path / "m")
    assert r.files == len(files) and proxy.faults >= 2
    assert tree_of(tmp_path / "m") == {k[len("m/"):]: v for k, v in files.items()}
    assert fastload.verify(tmp_path / "m").ok


def _make_archive(kind: str, src: Path, dst: Path) -> Path:
    if kind == "nested":
        inner = dst.parent / "inner"
        inner.mkdir()
        for cls in ("n01", "n02"):
            subprocess.run(["tar", "-cf", str(inner / f"{cls}.tar"), "-C", str(src), "."],
                           check=True)  # fmt: skip
        subprocess.run(["tar", "-cf", str(dst), "-C", str(inner), "."], check=True)
        return dst
    flags = {"tar": "-cf", "gz": "-czf", "zst": "--zstd -cf"}[kind]
    subprocess.run(["tar", *flags.split(), str(dst), "-C", str(src), "."], check=True)
    return dst


@pytest.mark.parametrize("kind", ["tar", "gz", "zst", "nested"])
def test_archive_object_extracts_like_local(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path, kind: str
) -> None:
    if kind == "zst":
        require_tool("zstd", "zstd")  # makes the archive
    src = tmp_path / "src"
    for k, v in _random_tree(200, seed=3).items():
        (src / k).parent.mkdir(parents=True, exist_ok=True)
        (src / k).write_bytes(v)
    name = {"tar": "a.tar", "gz": "a.tar.gz", "zst": "a.tar.zst", "nested": "a.tar"}[kind]
    archive = _make_archive(kind, src, tmp_path / name)
    upload_file(s3, bucket, f"arch/{name}", archive)
    unpack = "nested" if kind == "nested" else "auto"
    local = fastload.stage(archive, tmp_path / "local", unpack=unpack)
    remote = fastload.stage(f"s3://{bucket}/arch/{name}", tmp_path / "remote", unpack=unpack)
    assert tree_of(tmp_path / "remote") == tree_of(tmp_path / "local")
    assert remote.files == local.files > 0
    assert not list((tmp_path).glob("*.tar.part*"))  # never copied to disk whole
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/arch/{name}", tmp_path / "remote", unpack=unpack).skipped
    assert proxy.gets() == 0


def test_missing_key_bucket_and_not_an_archive(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/nope/x.bin"):
        fastload.stage(f"s3://{bucket}/nope/x.bin", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no-such-bucket"):
        fastload.stage("s3://no-such-bucket/x.bin", tmp_path / "x")
    upload(s3, bucket, {"page.tar.gz": b"<html><body>403 Forbidden</body></html>"})
    with pytest.raises(OSError, match="named like a gzip-compressed tar archive but is not"):
        fastload.stage(f"s3://{bucket}/page.tar.gz", tmp_path / "page")
    assert not (tmp_path / "page").exists()
    copied = fastload.stage(f"s3://{bucket}/page.tar.gz", tmp_path / "page.bin", unpack=False)
    assert copied.path.read_bytes().startswith(b"<html>")


def test_wrong_credentials_name_url_and_endpoint(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload(s3, bucket, {"k.bin": b"data"})
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(PermissionError) as info:
        fastload.stage(f"s3://{bucket}/k.bin", tmp_path / "k")
    assert f"s3://{bucket}/k.bin" in str(info.value) and proxy.endpoint in str(info.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(PermissionError):
        fastload.stage(f"s3://{bucket}/", tmp_path / "k")
    # Anonymous access to a private bucket is refused too.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    with pytest.raises(PermissionError):
        fastload.stage(f"s3://{bucket}/k.bin", tmp_path / "k", storage_options={"anonymous": True})


def test_profile_file_and_storage_options(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload(s3, bucket, {"k.bin": b"data"})
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[lab]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n"
    )
    config = tmp_path / "config"
    config.write_text(f"[profile lab]\nendpoint_url = {proxy.endpoint}\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    got = fastload.stage(f"s3://{bucket}/k.bin", tmp_path / "a", storage_options={"profile": "lab"})
    assert got.path.read_bytes() == b"data"
    monkeypatch.setenv("AWS_PROFILE", "lab")
    assert fastload.stage(f"s3://{bucket}/k.bin", tmp_path / "b").path.read_bytes() == b"data"
    # The site's endpoint from the fastload configuration file, credentials from options.
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    site = tmp_path / "fastload.toml"
    site.write_text(f'[storage.s3]\nendpoint_url = "{proxy.endpoint}"\n')
    monkeypatch.setenv("FASTLOAD_CONFIG", str(site))
    opts = {"access_key_id": KEY_ID, "secret_access_key": SECRET}
    c = fastload.stage(f"s3://{bucket}/k.bin", tmp_path / "c", storage_options=opts)
    assert c.path.read_bytes() == b"data"


def test_faults_are_retried_and_nothing_corrupt_is_staged(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    files = _random_tree(300, seed=5)
    files["big.bin"] = random.Random(9).randbytes(3 << 20)
    upload(s3, bucket, files)
    proxy.latency = 0.002
    proxy.fail_every = 7
    proxy.truncate_every = 11
    proxy.reset_every = 13
    r = fastload.stage(f"s3://{bucket}/", tmp_path / "out", stripe_size=1 << 20)
    assert r.files == len(files)
    assert tree_of(tmp_path / "out") == files
    assert proxy.faults >= 20
    assert fastload.verify(tmp_path / "out").ok


def test_server_gone_mid_stage_fails_then_resumes(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files = _random_tree(400, seed=7)
    upload(s3, bucket, files)
    out = tmp_path / "out"
    # The server goes away once 100 objects have been served in full: the stage has made
    # progress, and has more to fetch.
    proxy.close_after_gets = 100
    t0 = time.monotonic()
    with pytest.raises(OSError, match="cannot reach") as info:
        fastload.stage(f"s3://{bucket}/", out, workers=8)
    assert time.monotonic() - t0 < 120, "a stopped server must fail the stage, not hang it"
    assert proxy.endpoint in str(info.value)
    assert proxy.gets_answered >= 100
    with pytest.raises(FileNotFoundError):
        fastload.verify(out)  # not marked complete
    temporaries = [p for p in out.rglob("*") if ".fastload-" in p.name]
    assert not temporaries, temporaries
    staged = {k: v for k, v in tree_of(out).items() if not k.startswith(".fastload")}
    assert staged and all(files[k] == v for k, v in staged.items())  # whole objects only
    fresh = FaultProxy(s3.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", fresh.endpoint)
        r = fastload.stage(f"s3://{bucket}/", out)
        # What was staged before is not fetched again.
        assert r.copied_files == len(files) - len(staged), (r.copied_files, len(staged))
        fetched = [k for k, v in files.items() if k not in staged and v]
        assert fresh.gets() == len(fetched)  # an empty object needs no GET
        assert tree_of(out) == files
    finally:
        fresh.close()


@contextlib.contextmanager
def socket_closed_port() -> Iterator[int]:
    """A loopback port nothing listens on (bound, not listening, for the duration)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


_CHILD = """
import sys, fastload
fastload.stage(sys.argv[1], sys.argv[2], stripe_size=1 << 20, workers=2)
"""


def test_kill_mid_object_resumes_from_the_last_part(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    big = random.Random(2).randbytes(40 << 20)
    upload(s3, bucket, {"big.bin": big})
    # 8 parts in flight: ~25 parts a second at most, so the 30 parts between the 10th and
    # the end leave this poll over a second to see the 10th, even on a busy machine.
    proxy.latency = 0.3
    dst = tmp_path / "big.bin"
    record = tmp_path / ".big.bin.fastload-part.json"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, f"s3://{bucket}/big.bin", str(dst)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len(json.loads(record.read_text())["parts"]) >= 10:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        else:
            pytest.fail("the child never recorded 10 parts")
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    done_parts = len(json.loads(record.read_text())["parts"])
    assert 10 <= done_parts < 40 and not dst.exists()
    proxy.latency = 0
    proxy.settle()  # the killed child's last requests are not the resume's
    proxy.reset_counts()
    r = fastload.stage(f"s3://{bucket}/big.bin", dst, stripe_size=1 << 20)
    assert dst.read_bytes() == big and r.copied_files == 1
    assert proxy.gets() <= 40 - done_parts + 1  # the parts the record lacks, and its head
    assert not record.exists()
    assert fastload.verify(dst).ok


def test_object_replaced_while_read_is_source_changed(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    first = random.Random(3).randbytes(24 << 20)
    upload(s3, bucket, {"obj.bin": first})
    proxy.latency = 0.1
    replaced = []

    def on_progress(done: int, total: int, files: int, files_total: int) -> None:
        if not replaced:
            replaced.append(True)
            s3.client().put_object(Bucket=bucket, Key="obj.bin", Body=b"new" * 1000)

    with pytest.raises(fastload.SourceChangedError, match=f"s3://{bucket}/obj.bin"):
        fastload.stage(f"s3://{bucket}/obj.bin", tmp_path / "o", stripe_size=1 << 20,
                       progress=on_progress)  # fmt: skip
    assert not (tmp_path / "o").exists()
    proxy.latency = 0
    assert fastload.stage(f"s3://{bucket}/obj.bin", tmp_path / "o").path.read_bytes() == (
        b"new" * 1000
    )


def test_resolve_and_cli_read_s3(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    (src / "cls").mkdir(parents=True)
    (src / "cls/a.txt").write_text("a")
    subprocess.run(["tar", "-czf", str(tmp_path / "ds.tar.gz"), "-C", str(src), "."], check=True)
    upload_file(s3, bucket, "ds.tar.gz", tmp_path / "ds.tar.gz")
    got = fastload.resolve(sources=[f"s3://{bucket}/ds.tar.gz"], destination=tmp_path / "r")
    assert (got / "cls/a.txt").read_text() == "a"
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    cli = subprocess.run(
        [sys.executable, "-m", "fastload", "stage", f"s3://{bucket}/ds.tar.gz",
         str(tmp_path / "c"), "--endpoint-url", proxy.endpoint],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert (tmp_path / "c/cls/a.txt").read_text() == "a"


def test_no_credentials_fails_without_asking_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_module("obstore")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(PermissionError, match="no credentials for 's3://some-bucket/x'"):
        fastload.stage("s3://some-bucket/x", tmp_path / "x")


def test_progress_counts_bytes_and_objects(
    s3: S3Server, bucket: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    files = _random_tree(300, seed=11)
    files["big.bin"] = random.Random(3).randbytes(3 << 20)
    upload(s3, bucket, files)
    total = sum(len(v) for v in files.values())
    calls: list[tuple[int, int, int, int]] = []
    r = fastload.stage(f"s3://{bucket}/", tmp_path / "cb", stats=True, stripe_size=1 << 20,
                       progress=lambda *a: calls.append(a))  # fmt: skip
    assert calls and calls[-1] == (total, total, len(files), len(files))
    # The prefix was listed (before the lock) and planned against the empty destination.
    assert r.stats is not None and r.stats.listing_seconds > 0 and r.stats.planning_seconds > 0
    assert all(c[1] == total and c[3] == len(files) for c in calls)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)  # never goes back
    assert [c[2] for c in calls] == sorted(c[2] for c in calls)
    fastload.stage(f"s3://{bucket}/", tmp_path / "bar", progress=True)
    err = capfd.readouterr().err
    assert f"{len(files)}/{len(files)} files" in err, err[-500:]


def test_unreachable_endpoint_is_one_line(tmp_path: Path) -> None:
    """Nothing listens on the endpoint: the CLI says so in one line, soon, and leaves
    nothing behind."""
    with socket_closed_port() as port:
        endpoint = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_CONFIG_FILE": os.devnull,
        }
        cli = subprocess.run(
            [sys.executable, "-m", "fastload", "stage", "s3://b/prefix/", str(tmp_path / "d"),
             "--endpoint-url", endpoint],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert cli.returncode != 0
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert f"cannot reach {endpoint}" in lines[0] and "s3://b/prefix/" in lines[0]
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_registry_entry_with_an_s3_url(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A dataset of the user's configuration whose source is an object URL: resolve(name)
    stages it straight from the store (extracted), and a second resolve fetches nothing."""
    src = tmp_path / "src"
    (src / "train").mkdir(parents=True)
    (src / "train/x.bin").write_bytes(b"x" * 5000)
    subprocess.run(["tar", "-cf", str(tmp_path / "ds.tar"), "-C", str(src), "."], check=True)
    upload_file(s3, bucket, "sets/ds.tar", tmp_path / "ds.tar")
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'[datasets.s3set]\nsources = [{{ url = "s3://{bucket}/sets/ds.tar" }}]\n'
        'returns = "train"\n'
    )
    monkeypatch.setenv("FASTLOAD_CONFIG", str(cfg))
    monkeypatch.setenv("FASTLOAD_TMPDIR", str(tmp_path / "node"))
    got = fastload.resolve("s3set", destination=tmp_path / "out")
    assert got == tmp_path / "out" / "train"
    assert (got / "x.bin").read_bytes() == b"x" * 5000
    proxy.reset_counts()
    assert fastload.resolve("s3set", destination=tmp_path / "out") == got
    assert proxy.gets() == 0


def test_directories_are_listed_in_parallel(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A first page of the whole listing names folders (else the listing would go on
    page after page: a flat prefix); then one listing with a delimiter, and each
    "directory" under the prefix listed on its own (page after page where it holds more
    than a page): every object found once."""
    files = _random_tree(200, seed=5)  # d0..d6 and top.txt
    files.update({f"many/k{i:04d}": b"m" for i in range(1005)})  # two pages
    upload(s3, bucket, files)
    proxy.reset_counts()
    r = fastload.stage(f"s3://{bucket}/", tmp_path / "out")
    assert r.files == len(files) and tree_of(tmp_path / "out") == files
    assert proxy.requests["LIST"] == 1 + 1 + 8 + 1
