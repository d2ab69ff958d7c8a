"""The rough edges of a new user's first hour (issue 52), each through the command line
or the API as they met it: s3:// without obstore, no credentials against no server
against refused credentials, what a failed archive leaves, the lock of a run that made
nothing, --workers' default, --stats' parts, the monitor's summary, a mix's counts after
a plain DataLoader, a typo'd option, a stale index's times, and what demo.sh --clean
removes."""

from __future__ import annotations

import calendar
import http.server
import io
import os
import re
import socket
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload


def cli(*args: str, env: dict[str, str] | None = None,
        pre: str = "") -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``fastload ARGS`` in a process of its own (``pre``: Python run before it)."""
    code = f"import sys\n{pre}\nfrom fastload.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- 4: s3:// without obstore -----------------------------------------------------------


@pytest.mark.parametrize("command", ["stage", "probe"])
def test_s3_without_obstore_is_one_line(tmp_path: Path, command: str) -> None:
    args = ["s3://bucket/prefix/", str(tmp_path / "d")] if command == "stage" else [
        "s3://bucket/prefix/", "--seconds", "1", "--json"]  # fmt: skip
    # obstore set to None in sys.modules: importing it fails as where it is not installed
    r = cli(command, *args, pre="sys.modules['obstore'] = None")
    assert r.returncode == 1
    line = _one_line(r.stderr)
    assert line.startswith("fastload: error: ") and "pip install 'fastload[s3]'" in line
    assert not (tmp_path / "d").exists() and os.listdir(tmp_path) == []


# --- 5: no credentials, no server, refused credentials --------------------------------


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A metadata service that refuses every request (403), as a sandbox's proxy does."""

    def _refuse(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = _refuse

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_metadata() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _no_aws(**extra: str) -> dict[str, str]:
    """This environment without AWS credentials, profiles or the metadata switch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull, **extra)
    return env


@pytest.mark.parametrize("metadata", ["refusing", "closed"])
def test_no_credentials_found_is_not_access_denied(
    tmp_path: Path, refusing_metadata: str, metadata: str
) -> None:
    """The issue's case: no keys anywhere, so the client asked the instance metadata
    service for a role's, which refused (or was not there); the store was never asked."""
    pytest.importorskip("obstore")
    where = refusing_metadata if metadata == "refusing" else f"http://127.0.0.1:{_closed_port()}"
    env = _no_aws(AWS_METADATA_ENDPOINT=where)
    for endpoint in ("http://127.0.0.1:9", "http://fastload-test.invalid"):
        r = cli("stage", "s3://datasets/coco/", str(tmp_path / "d"), "--endpoint-url", endpoint,
                env=env)  # fmt: skip
        assert r.returncode == 1
        # One line; on a slow machine the metadata service's retries may first pass the
        # 3 s after which a line says what is silent: the service, with the store.
        *slow, last = r.stderr.strip().splitlines()
        assert all("from the instance metadata service" in s and endpoint in s
                   for s in slow) and len(slow) <= 1, r.stderr  # fmt: skip
        line = _one_line(last)
        assert "no credentials found for 's3://datasets/coco/'" in line, line
        assert f"endpoint {endpoint}, not contacted" in line and "denied" not in line
        said = "answered 403" if metadata == "refusing" else "could not be reached"
        assert said in line and "--anonymous" in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "endpoint, why",
    [("http://127.0.0.1:9", "connection refused"),
     ("http://fastload-test.invalid", "does not resolve")],
)  # fmt: skip
def test_no_server_reached(tmp_path: Path, endpoint: str, why: str) -> None:
    pytest.importorskip("obstore")
    env = _no_aws(AWS_ACCESS_KEY_ID="someone", AWS_SECRET_ACCESS_KEY="secret",
                  AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
    for command in (["stage", "s3://datasets/coco/", str(tmp_path / "d")],
                    ["probe", "s3://datasets/coco/", "--seconds", "1", "--json"]):  # fmt: skip
        r = cli(*command, "--endpoint-url", endpoint, env=env)
        assert r.returncode == 1
        line = _one_line(r.stderr)
        assert f"cannot reach {endpoint} for 's3://datasets/coco/'" in line and why in line
        assert "denied" not in line and "credentials" not in line
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_server_refused_the_credentials(s3: Any, bucket: str, tmp_path: Path) -> None:
    from sources.s3server import upload

    upload(s3, bucket, {"k.bin": b"data"})
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    r = cli("stage", f"s3://{bucket}/k.bin", str(tmp_path / "d"), env=env)
    assert r.returncode == 1
    line = _one_line(r.stderr)
    assert f"'s3://{bucket}/k.bin': access denied by {os.environ['AWS_ENDPOINT_URL']}" in line
    assert not (tmp_path / "d").exists()


# --- 6: what a failed archive leaves ----------------------------------------------------


def _archive(n: int = 600, pad: int = 0) -> tuple[bytes, int]:
    """A tar of ``n`` small files (``pad`` zero bytes more each), and the offset of its
    last third's first header."""
    buf = io.BytesIO()
    cut = 0
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            if i == 2 * n // 3:
                cut = buf.tell()
            data = bytes([i % 251]) * (100 + i % 300) + bytes(pad)
            info = tarfile.TarInfo(f"d{i % 7}/f{i:04d}.bin")
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), cut


def _files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def test_truncated_tar_says_what_it_left_and_the_next_call_keeps_it(tmp_path: Path) -> None:
    whole, cut = _archive()
    src, dst = tmp_path / "a.tar", tmp_path / "out"
    src.write_bytes(whole[: cut + 300])  # ends inside a header
    r = cli("stage", str(src), str(dst))
    assert r.returncode == 1
    line = _one_line(r.stderr)
    m = re.search(r"; (\d+) files extracted before the error are left in '(.*?)' \(no "
                  r"manifest: not a complete stage\); the next stage of this archive into "
                  r"it keeps those whose member is unchanged and extracts the rest$",
                  line)  # fmt: skip
    assert m is not None, line
    left = int(m.group(1))
    assert m.group(2) == str(dst) and 0 < left <= _files(dst) <= 400
    src.write_bytes(whole)
    again = fastload.stage(src, dst)
    assert again.files == 600 and again.copied_files <= 600 - left


def test_corrupt_tar_gz_says_its_files_are_not_trusted(tmp_path: Path) -> None:
    import gzip

    whole, cut = _archive(pad=20_000)  # a first member larger than what is read ahead
    # two gzip members (as pigz and concatenated archives make), the second one corrupt
    head, tail = gzip.compress(whole[:cut]), bytearray(gzip.compress(whole[cut:]))
    good = head + bytes(tail)
    for i in range(len(tail) // 2, len(tail) // 2 + 64):
        tail[i] ^= 0x5A
    packed = head + bytes(tail)
    src, dst = tmp_path / "a.tar.gz", tmp_path / "out"
    src.write_bytes(packed)
    r = cli("stage", str(src), str(dst))
    assert r.returncode == 1
    line = _one_line(r.stderr)
    m = re.search(r"; (\d+) files extracted before the error are left in '.*' \(no manifest: "
                  r"not a complete stage\); they are not trusted: the next stage of this "
                  r"archive into it extracts every member again, over them$", line)  # fmt: skip
    assert m is not None, line
    assert 0 < int(m.group(1)) <= _files(dst)
    src.write_bytes(good)
    again = fastload.stage(src, dst)
    assert again.files == again.copied_files == 600


# --- 7: no lock left by a run that made nothing -----------------------------------------


@pytest.mark.parametrize("kind", ["tree", "tar", "tar.gz"])
def test_failed_run_leaves_no_lock_beside_what_it_never_made(tmp_path: Path, kind: str) -> None:
    whole, _ = _archive(20)
    if kind == "tree":
        src = tmp_path / "src"
        with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
            tar.extractall(src, filter="data")
    else:
        import gzip

        src = tmp_path / f"a.{kind}"
        src.write_bytes(whole if kind == "tar" else gzip.compress(whole))
    before = sorted(os.listdir(tmp_path))
    r = cli("stage", str(src), str(tmp_path / "out"), "--include", "nothing-*")
    assert r.returncode == 1 and "matched nothing" in _one_line(r.stderr)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_waiter_takes_the_lock_file_at_the_path_after_it_was_removed(tmp_path: Path) -> None:
    """A run that leaves nothing removes its lock file; a process that waited on the
    removed file locks the path's new one, so two never hold the lock at once."""
    from fastload._util import drop_lock, lock_path, node_lock

    dst = tmp_path / "out"
    waiting = threading.Event()
    inside: list[bool] = []

    def second() -> None:
        # on_wait: called once the lock file is open, before waiting for it
        with node_lock(dst, on_wait=lambda line: waiting.set()):
            inside.append(lock_path(dst).exists())

    t = threading.Thread(target=second)
    with node_lock(dst):
        t.start()
        assert waiting.wait(60)
        drop_lock(dst)
        assert not inside
    t.join(60)
    assert inside == [True]  # it holds the file at the path, not the removed one


# --- 8: --workers' default --------------------------------------------------------------


def test_workers_default_in_help_is_what_probe_reports(tmp_path: Path) -> None:
    from fastload._util import usable_cores
    from fastload.staging.job import LOCAL_PER_CORE, MAX_NETWORK_FILES, MAX_SUBMITTERS
    from fastload.staging.remote import DEFAULT_OBJECTS_IN_FLIGHT

    helped = cli("stage", "--help")
    text = " ".join(helped.stdout.split())
    assert "default 64" not in text
    rule = f"default: {LOCAL_PER_CORE} per core, up to {MAX_SUBMITTERS} cores, from a local disk"
    assert rule in text and f"at most {MAX_NETWORK_FILES};" in text
    assert f"; {DEFAULT_OBJECTS_IN_FLIGHT} objects from a store" in text
    (tmp_path / "src").mkdir()
    for i in range(20):
        (tmp_path / "src" / f"f{i}").write_bytes(os.urandom(4096))
    found = fastload.probe(tmp_path / "src", dest=tmp_path, seconds=1.0)
    assert found.plan.in_flight == LOCAL_PER_CORE * min(usable_cores(), MAX_SUBMITTERS)


# --- 9: --stats' parts add up ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["tree", "tar"])
def test_stats_parts_add_up(tmp_path: Path, kind: str) -> None:
    whole, _ = _archive(300)
    src = tmp_path / "a.tar"
    src.write_bytes(whole)
    if kind == "tree":
        with tarfile.open(src) as tar:
            tar.extractall(tmp_path / "src", filter="data")
        src = tmp_path / "src"
    r = cli("stage", str(src), str(tmp_path / "out"), "--stats")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "lock wait" in x)
    n = r"(\d+\.\d\d) s"
    m = re.search(
        rf"lock wait {n}, before the first progress {n} \(listing {n}, planning {n}, opening "
        rf"and starting {n}\), copying {n}, committing {n}, total {n}", line
    )
    assert m is not None, line
    lock, before, listing, planning, opening, copying, committing, total = map(
        float, m.groups())  # fmt: skip
    assert listing + planning + opening == pytest.approx(before, abs=0.011)
    assert lock + before + copying + committing == pytest.approx(total, abs=0.021)


# --- 10: the monitor's summary agrees with its stats ------------------------------------


def _shards(root: Path, n: int = 1000, per_shard: int = 10) -> Path:
    if not (root / "shards").exists():
        samples = ({"__key__": f"s{i:06d}", "jpg": bytes([i % 256]) * (500 + i % 7),
                    "cls": i % 10} for i in range(n))  # fmt: skip
        fastload.pack(samples, root / "shards", pattern="train-{:06d}.tar",
                      max_count=per_shard, index=None)  # fmt: skip
    return root / "shards"


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_monitor_final_summary_agrees_with_stats(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from fastload.data.monitor import _rate

    shards = _shards(tmp_path)
    idx = fastload.ShardIndex.build(str(shards / "train-{000000..000099}.tar"),
                                    tmp_path / "train.fidx")  # fmt: skip
    ds = fastload.ShardIndexDataset(idx.path, packed=True)
    loader = DataLoader(ds, batch_size=10, num_workers=2, collate_fn=fastload.collate)
    loop = fastload.monitor(loader, log_every=1e-9)  # a line logged after every step
    assert sum(len(b) for b in loop) == 1000
    stats, line = loop.stats(), loop.summary()
    assert stats["data/samples"] == 1000 and stats["data/bytes"] > 0
    assert f"| {_rate(stats['data/samples_per_s'])} samples/s |" in line, (line, stats)
    assert f"| {_rate(stats['data/bytes_per_s'], 'B')}/s" in line, (line, stats)
    assert line.startswith(f"data wait {stats['data/wait_share']:.0%} |")


# --- 11: a mix's counts after a plain DataLoader ----------------------------------------


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("start, batch_size", [("fork", 10), ("fork", None), ("spawn", 10)])
def test_mix_stats_after_a_plain_dataloader(tmp_path: Path, start: str,
                                            batch_size: int | None) -> None:  # fmt: skip
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    shards = _shards(tmp_path)
    web = fastload.Stream(str(shards / "train-{000000..000069}.tar"), proportion=0.7,
                          name="web")  # fmt: skip
    books = fastload.Stream(str(shards / "train-{000070..000099}.tar"), proportion=0.3,
                            name="books")  # fmt: skip
    mix = fastload.Mix([web, books], samples_per_epoch=1000, batch_size=batch_size, seed=0)
    loader = DataLoader(mix, batch_size=None, num_workers=2, multiprocessing_context=start)
    assert sum(len(b) if batch_size else 1 for b in loader) == 1000
    assert mix.stats() == {"epoch": 0, "streams": {"web": 700, "books": 300}}
    mix.set_epoch(1)
    half = 0
    for b in loader:  # the next epoch, half read
        half += len(b) if batch_size else 1
        if half >= 500:
            break
    del b
    got = mix.stats()
    assert got["epoch"] == 1 and sum(got["streams"].values()) <= 1000


# --- 12: a typo'd option ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, typo, usage, hint",
    [(["stage", "a", "b", "--exlude", "*.zip"], "--exlude", "fastload stage", "--exclude"),
     (["verify", "d", "--progess"], "--progess", "fastload verify", "--progress"),
     (["mix", "plan", "m.toml", "--jsno"], "--jsno", "fastload mix plan", "--json")],
)  # fmt: skip
def test_typo_option_suggests_the_closest(args: list[str], typo: str, usage: str,
                                          hint: str) -> None:  # fmt: skip
    r = cli(*args)
    assert r.returncode == 2 and r.stderr.startswith(f"usage: {usage} "), r.stderr
    assert f"{usage}: error: unrecognized option '{typo}' (did you mean {hint}?)" in r.stderr


# --- 13: a stale index's times ----------------------------------------------------------


def test_stale_index_says_when_in_readable_times(tmp_path: Path) -> None:
    shards = _shards(tmp_path, n=20)
    shard = shards / "train-000000.tar"
    indexed = calendar.timegm((2026, 1, 2, 3, 4, 5)) * 10**9 + 250_000_000
    os.utime(shard, ns=(indexed, indexed))
    fastload.ShardIndex.build(str(shards / "train-{000000..000001}.tar"), tmp_path / "i.fidx")
    later = calendar.timegm((2026, 3, 4, 5, 6, 7)) * 10**9 + 5
    os.utime(shard, ns=(later, later))
    r = cli("index", "--info", str(tmp_path / "i.fidx"))
    assert r.returncode == 1
    stale = next(x for x in r.stdout.splitlines() if "stale:" in x)
    assert (f"shard '{shard}' changed since it was indexed: modified 2026-03-04 "
            "05:06:07.000000005 UTC, indexed when modified 2026-01-02 03:04:05.250000000 "
            "UTC; rebuild it (`fastload index`)") in stale, stale  # fmt: skip


# --- 2: demo.sh --clean -----------------------------------------------------------------


def test_demo_clean_removes_the_demos_data_only(tmp_path: Path) -> None:
    """In a copy of the clone's scripts (the script works from its own folder's parent):
    the demo's dataset and staged copy go, the venv, the build and a SRC of one's own
    stay."""
    clone, tmpdir = tmp_path / "clone", tmp_path / "node"
    (clone / "scripts").mkdir(parents=True)
    demo = Path(__file__).resolve().parents[2] / "scripts" / "demo.sh"
    (clone / "scripts" / "demo.sh").write_bytes(demo.read_bytes())
    for made in ("demo-data/source/train/a.JPEG", ".venv/bin/python", "build/cpp/x.o",
                 "mine/data.bin"):  # fmt: skip
        (clone / made).parent.mkdir(parents=True, exist_ok=True)
        (clone / made).write_bytes(b"x")
    staged = tmpdir / "fastload-demo"
    (staged / "dataset").mkdir(parents=True)
    (staged / ".dataset.fastload.lock").write_bytes(b"")
    r = subprocess.run(["bash", str(clone / "scripts" / "demo.sh"), "--clean"], cwd=tmp_path,
                       env={**os.environ, "SLURM_TMPDIR": str(tmpdir)}, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(clone)) == [".venv", "build", "mine", "scripts"]
    assert os.listdir(tmpdir) == [] and "removed demo-data/" in r.stdout
