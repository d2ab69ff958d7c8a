"""What a new user hits first, through the command line as they would type it: a bad
archive, a repair after verify, error messages that name flags, waiting on another
process, a permission error, a missing index, packing a .tar.gz, and DataLoader with
torch's default collate."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import fastload
from kit import procs
from kit.tools import missing, require_module


def cli(*args: str, check: bool = False, **kw: object) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "fastload", *args], capture_output=True, text=True, **kw  # type: ignore[call-overload]
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _tree(root: Path, n: int = 12) -> None:
    for i in range(n):
        p = root / f"c{i % 3}" / f"s{i:03d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(100 + i))


@pytest.mark.parametrize("content", [b"<html><body>404 Not Found</body></html>", os.urandom(40)])
def test_file_named_like_an_archive_that_is_not_one(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "d.tar.gz"
    bad.write_bytes(content)
    r = cli("stage", str(bad), str(tmp_path / "out"))
    assert r.returncode == 1
    assert "is named like a gzip-compressed tar archive but is not one" in r.stderr
    assert str(bad) in r.stderr and "--no-unpack" in r.stderr and "unpack=False" not in r.stderr
    assert not (tmp_path / "out").exists()
    ok = cli("stage", str(bad), str(tmp_path / "copy.bin"), "--no-unpack", check=True)
    assert "staged 1 of 1" in ok.stdout and (tmp_path / "copy.bin").read_bytes() == content
    plain = tmp_path / "notes.txt"
    plain.write_text("hello")
    forced = cli("stage", str(plain), str(tmp_path / "x"), "--unpack")
    assert forced.returncode == 1 and "is not a tar archive" in forced.stderr


@pytest.mark.parametrize("kind", ["tree", "archive"])
def test_stage_after_a_failed_verify_repairs_exactly_what_differs(
    tmp_path: Path, kind: str
) -> None:
    src = tmp_path / "src"
    _tree(src)
    if kind == "archive":
        subprocess.run(["tar", "-cf", str(tmp_path / "src.tar"), "-C", str(src), "."], check=True)
        source = tmp_path / "src.tar"
    else:
        source = src
    out = tmp_path / "out"
    cli("stage", str(source), str(out), check=True)
    changed = out / "c1/s001.jpg"
    data = bytearray(changed.read_bytes())
    data[5] ^= 0xFF  # same size, same mtime kept below: only the digests tell
    st = changed.stat()
    changed.write_bytes(bytes(data))
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns))
    (out / "c2/s002.jpg").unlink()
    v = cli("verify", str(out))
    assert v.returncode == 1
    assert "differs: c1/s001.jpg" in v.stdout and "missing: c2/s002.jpg" in v.stdout
    assert "again re-copies exactly these" in v.stderr
    again = cli("stage", str(source), str(out), check=True)
    assert "staged 2 of 12 files" in again.stdout, again.stdout
    assert cli("verify", str(out)).returncode == 0
    assert (out / "c1/s001.jpg").read_bytes() == (src / "c1/s001.jpg").read_bytes()
    # --repair finds a damage verify was not asked about.
    (out / "c0/s000.jpg").write_bytes(b"oops")
    assert "already staged" in cli("stage", str(source), str(out), check=True).stdout
    repaired = cli("stage", str(source), str(out), "--repair", check=True)
    assert "staged 1 of 12" in repaired.stdout
    assert (out / "c0/s000.jpg").read_bytes() == (src / "c0/s000.jpg").read_bytes()


def test_errors_name_the_flags_to_type(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src, 3)
    os.mkfifo(src / "pipe")
    r = cli("stage", str(src), str(tmp_path / "out"))
    assert r.returncode == 1 and "--skip-special" in r.stderr and "on_special" not in r.stderr
    cli("stage", str(src), str(tmp_path / "out"), "--skip-special", check=True)
    (tmp_path / "f").write_bytes(b"x")
    for shard in ("one.tar", "two.tar"):  # the same sample key in two shards
        with tarfile.open(tmp_path / shard, "w") as tf:
            tf.add(tmp_path / "f", arcname="a.jpg")
    r = cli("index", str(tmp_path / "one.tar"), str(tmp_path / "two.tar"),
            "-o", str(tmp_path / "i.fidx"))  # fmt: skip
    assert r.returncode == 1 and "--on-duplicate first" in r.stderr, r.stderr
    assert "on_duplicate=" not in r.stderr


def test_help_texts(tmp_path: Path) -> None:
    top = cli("--help", check=True).stdout
    assert "``" not in top and "stage" in top
    v = cli("verify", "--help", check=True).stdout
    assert "re-copies exactly those files" in v
    s = cli("stage", "--help", check=True).stdout
    for flag in ("--unpack", "--no-unpack", "--repair", "--endpoint-url", "--anonymous"):
        assert flag in s


_HOLD = """
import sys, time
from pathlib import Path
from fastload._util import node_lock
with node_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()  # until the test lets go
"""


def test_a_waiting_process_says_for_whom(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src, 3)
    dst = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(dst)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    stager = None
    try:
        assert holder.stdout.readline().strip() == "held"
        stager = subprocess.Popen(
            [sys.executable, "-m", "fastload", "stage", str(src), str(dst), "--progress"],
            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert stager.stderr is not None
        said = stager.stderr.readline()  # its first line: why it does not start
        assert f"waiting for process {holder.pid} on {os.uname().nodename}" in said, said
        assert str(dst) in said
        # It waits (blocked on the lock) until the holder lets go, then stages.
        procs.wait_blocked_on_lock(stager.pid)
        assert stager.poll() is None and not dst.exists()
        holder.stdin.write("go\n")
        holder.stdin.close()
        out, err = stager.communicate(timeout=120)
        assert stager.returncode == 0, err
        assert "staged" in out
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
        if stager is not None and stager.poll() is None:
            stager.kill()
            stager.communicate()


def test_permission_error_names_the_destination(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src, 2)
    parent = tmp_path / "locked"
    parent.mkdir()
    # An immutable directory refuses new files even to root (who ignores modes).
    if subprocess.run(["chattr", "+i", str(parent)], capture_output=True).returncode:
        missing("chattr +i is not available here (apt-get install e2fsprogs)")
    try:
        r = cli("stage", str(src), str(parent / "data"))
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=True)
    assert r.returncode == 1
    assert f"'{parent / 'data'}'" in r.stderr and "not permitted" in r.stderr, r.stderr
    assert ".fastload.lock" not in r.stderr


def test_missing_index_file_says_so(tmp_path: Path) -> None:
    require_module("torch")
    with pytest.raises(FileNotFoundError, match=r"no index file 'missing\.fidx'") as info:
        fastload.ShardIndexDataset("missing.fidx")
    assert "open shard" not in str(info.value) and "fastload index" in str(info.value)


def test_pack_accepts_a_tar_gz_like_a_tar(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src)
    subprocess.run(["tar", "-cf", str(tmp_path / "d.tar"), "-C", str(src), "."], check=True)
    subprocess.run(["tar", "-czf", str(tmp_path / "d.tar.gz"), "-C", str(src), "."], check=True)
    cli("pack", str(tmp_path / "d.tar"), str(tmp_path / "a"), "--max-count", "5", check=True)
    cli("pack", str(tmp_path / "d.tar.gz"), str(tmp_path / "b"), "--max-count", "5", check=True)
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.tar"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "b").glob("*.tar"))
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".")]


def test_dataloader_default_collate(tmp_path: Path) -> None:
    """A DataLoader with no collate_fn batches fastload's samples (map-style and
    iterable, two workers): fields are raw bytes (decoding is the user's), which default
    collation keeps as lists, in sample order; each sample once and whole."""
    require_module("torch")
    from torch.utils.data import DataLoader

    samples = ({"__key__": f"k{i:04d}", "jpg": bytes([i % 256]) * 50, "cls": i % 5}
               for i in range(64))  # fmt: skip
    fastload.pack(samples, tmp_path / "shards", max_count=16)
    index = str(tmp_path / "shards/index.fidx")
    ds = fastload.ShardIndexDataset(index, fields=["jpg", "cls"])
    batch = next(iter(DataLoader(ds, batch_size=8, num_workers=2)))
    assert isinstance(batch["jpg"], list) and isinstance(batch["cls"], list)
    assert [bytes(b) for b in batch["jpg"]] == [bytes([i]) * 50 for i in range(8)]
    assert [bytes(c) for c in batch["cls"]] == [b"%d" % (i % 5) for i in range(8)]
    it = fastload.ShardIterableDataset(index, fields=["jpg", "cls"])
    got = [b for b in DataLoader(it, batch_size=16, num_workers=2)]
    assert [len(b["jpg"]) for b in got] == [16] * 4
    pairs = sorted((bytes(j), bytes(c))
                   for b in got for j, c in zip(b["jpg"], b["cls"], strict=True))
    assert pairs == sorted((bytes([i]) * 50, b"%d" % (i % 5)) for i in range(64))
