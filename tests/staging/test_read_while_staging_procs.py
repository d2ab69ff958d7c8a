"""Reading while staging, across processes (issue 49): four processes of a node share
one stage (the store serves each file once); a stager killed with SIGKILL mid-stage is
taken over by the next caller, whose reads go on; a DataLoader's two workers (forked or
spawned) iterate a shuffled ImageFolder through the handle and see exactly the tree's
samples (fastload.monitor counts the reads that waited on the stage); an object prefix
on the loopback S3 server serves the keys asked for first; Ctrl-C stops a stage in the
background cleanly and the next call resumes; ``fastload stage --background``.

Sources are on a netsim mount (2 ms per request) with 2 files in flight for the
background order, so a stage takes seconds and reads overlap it."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import fastload
from kit import procs, trees
from kit.netsim import mounts

N = 1200

_CHILD = r"""
import json, os, sys, time
import fastload
from fastload.staging import background as bg
spec = json.loads(sys.argv[1])
h = fastload.stage(spec["src"], spec["dst"], wait=False, workers=2)
print("HANDLE", flush=True)
if spec.get("announce"):
    while h.progress().state != "copying":
        time.sleep(0.01)
    print("STAGER" if bg._participants[h.path].schedule is not None else "READER", flush=True)
sys.stdin.readline()
for k, rel in enumerate(spec["read"]):
    got = h.local(rel).read_bytes()
    with open(os.path.join(spec["orig"], rel), "rb") as f:
        assert got == f.read(), rel
    print("READ", k, flush=True)
r = h.wait()
p = bg._participants.get(h.path)
if p is not None:
    p.finished.wait()  # (its reply to wait() comes just before its own end)
staged = p is not None and p.result is not None and not p.result.skipped
print("RESULT", json.dumps({"files": r.files, "staged": staged,
                            "copied": p.result.copied_files if staged else 0}), flush=True)
"""


class _Proc:
    """A child running _CHILD; its stdout lines arrive on a queue."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(spec)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=procs.child_env(),
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("EOF")

    def expect(self, prefix: str) -> str:
        while True:
            line = self.lines.get(timeout=120)
            if line == "EOF":
                assert self.proc.stderr is not None
                raise AssertionError(f"child ended before {prefix}: {self.proc.stderr.read()}")
            if line.startswith(prefix):
                return line

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.expect("RESULT ").split(" ", 1)[1])
        assert self.proc.wait(timeout=120) == 0
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rwsp") / "src"
    trees.build_small_files(root, N, per_dir=100, seed=149)
    return root


def test_four_processes_share_one_stage(tree: Path, tmp_path: Path) -> None:
    names = sorted(trees.regular_files(tree))
    picked = random.Random(4).sample(names, 160)
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        dst = tmp_path / "dst"
        kids = [_Proc({"src": str(m.path), "dst": str(dst), "orig": str(tree),
                       "read": picked[k::4]}) for k in range(4)]  # fmt: skip
        try:
            for k in kids:
                k.expect("HANDLE")
            for k in kids:
                k.go()
            results = [k.result() for k in kids]
        finally:
            for k in kids:
                k.close()
        counts = m.unmount()
    assert all(r["files"] == N for r in results)
    assert sum(r["staged"] for r in results) == 1  # one stager; the others read through it
    assert counts["opens"] == N  # each file served once, whoever asked for it
    trees.assert_same_tree(tree, dst)


def test_a_killed_stager_is_taken_over_and_reads_go_on(tree: Path, tmp_path: Path) -> None:
    names = sorted(trees.regular_files(tree))
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        dst = tmp_path / "dst"
        spec = {"src": str(m.path), "dst": str(dst), "orig": str(tree)}
        first = _Proc({**spec, "announce": True, "read": []})
        second = None
        try:
            assert first.expect("STAGER") == "STAGER"
            second = _Proc({**spec, "read": names[::-1][:240]})
            second.expect("HANDLE")
            second.go()
            second.expect("READ 20")
            os.kill(first.proc.pid, signal.SIGKILL)
            assert first.proc.wait(timeout=60) == -signal.SIGKILL
            done = second.result()  # every read checked in the child, after the kill too
        finally:
            first.close()
            if second is not None:
                second.close()
        m.unmount()
    assert done["files"] == N and done["staged"]
    assert 0 < done["copied"] < N  # resumed: what the killed stager finished was kept
    trees.assert_same_tree(tree, dst)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def _digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataloader_reads_a_shuffled_imagefolder_through_the_handle(
    tmp_path: Path, context: str
) -> None:
    torch = pytest.importorskip("torch")
    import fastload.torchvision as ftv

    src = tmp_path / "src"
    rng = random.Random(5)
    expected = []
    for c in range(6):
        for i in range(50):
            data = rng.randbytes(rng.randrange(100, 4000))
            trees.write_file(src / f"class{c}" / f"img{i:03d}.png", data)
            expected.append((_digest(data), c))
    trees.write_file(src / "class2" / "notes.txt", b"not an image")
    with mounts(tmp_path) as mount:
        m = mount(src, 2000, 2000)
        h = fastload.stage(m.path, tmp_path / "dst", wait=False, workers=2)
        ds = ftv.ImageFolder(h, loader=_read)
        assert len(ds) == 300 and ds.classes == [f"class{c}" for c in range(6)]
        assert sorted(ds.targets) == sorted(t for _, t in expected)
        loader = torch.utils.data.DataLoader(
            ds, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context=context,
            collate_fn=_as_list,
        )  # fmt: skip
        with fastload.monitor(loader) as mon:
            seen = [(_digest(x), t) for batch in mon for x, t in batch]
            stats, line = mon.stats(), mon.summary()
        h.wait()
        m.unmount()
    assert sorted(seen) == sorted(expected)
    if context == "fork":
        # Forked workers ask for the first batches at once, before their files are
        # staged: those reads waited. (Spawned ones start after the stage's end here.)
        assert stats["stage/waits"] >= 1 and stats["stage/wait_s"] > 0
        assert "reads waited on the stage" in line


def test_an_object_prefix_serves_the_keys_asked_for_first(
    s3: Any, bucket: str, proxy: Any, tmp_path: Path
) -> None:
    from sources.s3server import tree_of, upload

    rng = random.Random(9)
    files = {f"d{i // 50:02d}/k{i:04d}.bin": rng.randbytes(rng.randrange(1, 3000))
             for i in range(400)}  # fmt: skip
    upload(s3, bucket, files)
    proxy.reset_counts()
    proxy.latency = 0.01
    dst = tmp_path / "dst"
    h = fastload.stage(f"s3://{bucket}/", dst, wait=False, workers=2)
    last = sorted(files)[-4:]
    for key in last:
        assert h.local(key).read_bytes() == files[key]
    seen = h.progress()
    assert seen.files_total == len(files) and seen.files_done < len(files)
    with pytest.raises(FileNotFoundError):
        h.local("d00/none.bin")
    assert h.wait().files == len(files)
    proxy.latency = 0.0
    assert tree_of(dst) == files
    assert proxy.gets() == len(files)  # the keys read first were not fetched again


_CTRL_C = r"""
import json, signal, sys, time
import fastload
signal.signal(signal.SIGINT, signal.default_int_handler)
h = fastload.stage(sys.argv[1], sys.argv[2], wait=False, workers=2)
while h.progress().files_done < 100:
    time.sleep(0.01)
print("COPYING", flush=True)
h.wait()
"""


def test_ctrl_c_stops_the_stage_cleanly_and_the_next_call_resumes(tree: Path, tmp_path: Path
                                                                  ) -> None:  # fmt: skip
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        dst = tmp_path / "dst"
        child = subprocess.Popen([sys.executable, "-c", _CTRL_C, str(m.path), str(dst)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=procs.child_env())  # fmt: skip
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "COPYING"
            child.send_signal(signal.SIGINT)
            _out, err = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
        assert err.rstrip().endswith("KeyboardInterrupt"), err  # and nothing after it
        kept = trees.assert_no_partial_files(tree, dst)
        assert 100 <= kept < N
        r = fastload.stage(m.path, dst)  # resumes: what the stopped stage finished stays
        m.unmount()
    assert r.files == N and r.copied_files < N - 99
    trees.assert_same_tree(tree, dst)


def test_the_cli_stages_in_the_background(tree: Path, tmp_path: Path) -> None:
    """``fastload stage --background`` returns once the stage is under way; a script's
    handle reads through the process it left running; a missing source is its error."""
    names = sorted(trees.regular_files(tree))
    cli = [sys.executable, "-m", "fastload", "stage", "--background", "--workers", "2"]
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        dst = tmp_path / "dst"
        r = subprocess.run([*cli, str(m.path), str(dst)], capture_output=True, text=True,
                           env=procs.child_env(), timeout=120, check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "staging in the background" in r.stdout
        h = fastload.stage(m.path, dst, wait=False, workers=2)
        assert h.local(names[-1]).read_bytes() == (tree / names[-1]).read_bytes()
        assert h.progress().files_done < N
        assert h.wait().files == N
        counts = m.unmount()
    assert counts["opens"] == N  # the background process staged; this one only read
    trees.assert_same_tree(tree, dst)
    r = subprocess.run([*cli, str(tmp_path / "absent"), str(tmp_path / "dst2")],
                       capture_output=True, text=True, env=procs.child_env(), timeout=120,
                       check=False)  # fmt: skip
    assert r.returncode != 0 and "absent" in r.stderr


_OTHER_USER = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
name = "\0" + sys.argv[1]  # the abstract name (argv holds no NUL)
if sys.argv[2] == "ask":
    s.connect(name)
    try:
        s.sendall(b'{"op": "want", "paths": ["dir000/f00000.dat"]}\n')
        s.settimeout(60)
        got = s.recv(100)
    except (BrokenPipeError, ConnectionResetError):
        got = b""  # closed before the request was read
    print(repr(got), flush=True)
else:  # squat the name, and hold it until told
    s.bind(name)
    s.listen(8)
    print("BOUND", flush=True)
    sys.stdin.readline()
"""


def _as_nobody() -> dict[str, Any]:
    """subprocess keywords running a child as the user nobody."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a child as another user")
    return {"user": 65534, "group": 65534, "extra_groups": []}


# The other user's child needs only the standard library: the system's interpreter
# (the user nobody may not reach the test's virtual environment).
_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def test_another_user_cannot_ask_the_stager(tree: Path, tmp_path: Path) -> None:
    """The channel is the user's alone: a request of another user's process is not
    answered (the connection is closed), and the stage goes on."""
    from fastload.staging.channel import channel_name

    names = sorted(trees.regular_files(tree))
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        dst = tmp_path / "dst"
        h = fastload.stage(m.path, dst, wait=False, workers=2)
        h.local(names[0])  # the stager serves
        r = subprocess.run([_PYTHON, "-c", _OTHER_USER, channel_name(dst)[1:], "ask"],
                           capture_output=True, text=True, timeout=120, check=False,
                           cwd="/", **_as_nobody())  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "b''"  # closed unanswered
        assert not h.done
        assert h.wait().files == N
        m.unmount()


def test_a_channel_squatted_by_another_user_is_refused(tree: Path, tmp_path: Path) -> None:
    """Another user's process holding the channel's name first: the stage fails saying
    so, and no reader takes that process for the stager."""
    from fastload.staging.channel import channel_name

    dst = tmp_path / "dst"
    squat = subprocess.Popen([_PYTHON, "-c", _OTHER_USER, channel_name(dst)[1:], "bind"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd="/", **_as_nobody())  # fmt: skip
    try:
        assert squat.stdout is not None and squat.stdout.readline().strip() == "BOUND"
        h = fastload.stage(tree, dst, wait=False)
        with pytest.raises(fastload.StageError, match="another"):
            h.local(sorted(trees.regular_files(tree))[0])
        with pytest.raises(fastload.StageError, match="another"):
            h.wait()
    finally:
        squat.communicate("\n", timeout=60)
