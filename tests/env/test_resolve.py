"""fastload.resolve(): end to end from a local tree, from an archive, from the dataset
registry under a simulated cluster's dataset roots, and from an HTTP server on loopback
started here; checksums; six processes of one "node" resolving at once (one copy); a
waiter taking over when the process that holds the node lock is killed.

Child processes run this file as a script (see ``_child_main``): ``procs.Child`` runs
``[*wrapper, python, stage_child.py, SPEC]``, and with ``wrapper=[python, this file]``
this file runs instead, reading SPEC from its last argument.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from resolve_kit import clean_environ, env_vars, make_tar, sha256, tree_of

import fastload
from fastload.env import Environment, detect
from kit import procs, trees
from kit.tools import require_module
from kit.web import WebServer, serving

pytestmark = pytest.mark.native

THIS = Path(__file__).resolve()
BACKENDS = ["urllib", "fsspec"]


# --------------------------------------------------------------------------------------
# Fixtures: an environment in temporary directories, a loopback HTTP server
# --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_environ(monkeypatch, tmp_path)


@pytest.fixture
def env(tmp_path: Path) -> Environment:
    (tmp_path / "datasets").mkdir()
    return detect(env_vars(tmp_path), "node1")


# Variables that steer environment detection (FASTLOAD_ENGINE and the like are kept).

@pytest.fixture
def server(tmp_path: Path) -> Iterator[WebServer]:
    root = tmp_path / "www"
    root.mkdir()
    with serving(root) as srv:
        yield srv


@pytest.fixture(params=BACKENDS)
def http_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name: str = request.param
    if name == "fsspec":
        require_module("fsspec")
        require_module("aiohttp")
    monkeypatch.setenv("FASTLOAD_HTTP", name)
    return name


# --------------------------------------------------------------------------------------
# Local sources
# --------------------------------------------------------------------------------------


def test_local_tree(env: Environment, tmp_path: Path) -> None:
    src = tmp_path / "shared" / "mydata"
    trees.build_small_files(src, 40, per_dir=10)
    path = fastload.resolve(src, env=env)
    assert path == env.tmpdir / "mydata"
    trees.assert_same_tree(src, path)
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_ctime_ns)
              for p in path.rglob("*")}
    assert fastload.resolve(str(src), env=env) == path  # done: nothing copied again
    assert before == {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_ctime_ns)
                      for p in path.rglob("*")}


def test_relative_names_are_looked_up_in_dataset_roots(env: Environment) -> None:
    root = env.dataset_roots[0]
    trees.build_small_files(root / "corpus" / "v2", 5)
    path = fastload.resolve("corpus/v2", env=env)
    assert path == env.tmpdir / "v2"
    trees.assert_same_tree(root / "corpus" / "v2", path)
    assert fastload.resolve("corpus", env=env, include="v2/dir000/*") == env.tmpdir / "corpus"
    assert sorted(tree_of(env.tmpdir / "corpus")) == sorted(
        "v2/dir000/" + p.name for p in (root / "corpus/v2/dir000").iterdir()
    )


def test_archive_and_templates(env: Environment, tmp_path: Path) -> None:
    members = {"a/x.txt": b"x" * 1000, "a/b/y.bin": os.urandom(70_000), "top": b"t"}
    data = make_tar(env.scratch / "pack" / "mydata.tar.gz", members, gz=True)  # type: ignore[operator]
    path = fastload.resolve(
        "mydata",
        sources=["{scratch}/pack/{name}.tar.gz"],
        destination="{tmpdir}/staged/{name}-{user}",
        checksum=sha256(data),
        env=env,
    )
    assert path == env.tmpdir / "staged" / "mydata-bob"
    assert tree_of(path) == members
    # unpack=False copies the archive itself.
    copied = fastload.resolve(env.scratch / "pack" / "mydata.tar.gz", unpack=False, env=env)  # type: ignore[operator]
    assert copied == env.tmpdir / "mydata.tar.gz" and copied.read_bytes() == data


def test_checksum_mismatch(env: Environment, tmp_path: Path) -> None:
    data = make_tar(tmp_path / "shared" / "d.tar", {"f": b"payload"})
    bad = "sha256:" + "0" * 64
    with pytest.raises(fastload.ChecksumMismatchError) as info:
        fastload.resolve(tmp_path / "shared" / "d.tar", checksum=bad, env=env)
    assert isinstance(info.value, OSError) and "checksum mismatch" in str(info.value)
    assert fastload.resolve(tmp_path / "shared" / "d.tar", checksum=sha256(data), env=env)
    assert (env.tmpdir / "d" / "f").read_bytes() == b"payload"
    with pytest.raises(ValueError, match="checksum must look like"):
        fastload.resolve(tmp_path / "shared" / "d.tar", checksum="crc:1", env=env)


def test_not_found_names_every_place_tried(env: Environment, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        fastload.resolve("nothing-here", sources=["/nope/a", "rel/b"], env=env)
    msg = str(info.value)
    assert isinstance(info.value, fastload.StageError)
    assert "/nope/a" in msg and str(env.dataset_roots[0] / "rel" / "b") in msg
    with pytest.raises(ValueError, match="not supported yet"):
        fastload.resolve("ftp://host/x", env=env)
    with pytest.raises(ValueError, match="needs a dataset name"):
        fastload.resolve(env=env)


# --------------------------------------------------------------------------------------
# The dataset registry on a simulated cluster
# --------------------------------------------------------------------------------------


def test_http_download_once(
    env: Environment, server: WebServer, http_backend: str
) -> None:
    members = {"cifar-like/data_batch_1": os.urandom(200_000), "cifar-like/meta": b"m"}
    data = make_tar(server.root / "pack.tar.gz", members, gz=True)
    url = server.url("pack.tar.gz")
    path = fastload.resolve(url, checksum=sha256(data), env=env)
    assert path == env.tmpdir / "pack"
    assert tree_of(path) == members
    cached = list((env.cache / "downloads").rglob("pack.tar.gz"))
    assert len(cached) == 1 and cached[0].read_bytes() == data
    assert not [p for p in cached[0].parent.iterdir() if p.name.endswith(".part")]
    # Again, and into another destination: no second download.
    assert fastload.resolve(url, checksum=sha256(data), env=env) == path
    other = fastload.resolve(url, destination=env.tmpdir / "again", env=env)
    assert tree_of(other) == members
    assert server.gets["pack.tar.gz"] == 1


def test_http_checksum_mismatch_leaves_nothing(
    env: Environment, server: WebServer, http_backend: str
) -> None:
    make_tar(server.root / "d.tar", {"f": b"data"})
    with pytest.raises(fastload.ChecksumMismatchError, match="checksum mismatch") as info:
        fastload.resolve(server.url("d.tar"), checksum="md5:" + "0" * 32, env=env)
    assert info.value.filename == server.url("d.tar")
    downloads = env.cache / "downloads"
    assert [p.name for p in downloads.rglob("*") if p.is_file()] == [".d.tar.fastload.lock"]
    assert not (env.tmpdir / "d").exists()


def test_http_missing_falls_back_to_the_next_source(
    env: Environment, server: WebServer, http_backend: str, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="404"):
        fastload.resolve(server.url("absent.tar"), env=env)
    local = tmp_path / "mirror" / "ds"
    trees.build_small_files(local, 4)
    got = fastload.resolve("ds", sources=[server.url("absent.tar"), str(local)], env=env)
    assert got == env.tmpdir / "ds"
    trees.assert_same_tree(local, got)


def test_http_where_the_cache_refuses_locks(
    env: Environment, server: WebServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache on a file system without locks: the download goes to a temporary of this
    process's own, renamed into place."""
    import errno

    resolve_module = sys.modules["fastload.sources.download"]
    real_lock = resolve_module.node_lock

    def node_lock(path: Path) -> Any:
        if "downloads" in path.parts:
            raise OSError(errno.ENOLCK, "No locks available")
        return real_lock(path)

    monkeypatch.setattr(resolve_module, "node_lock", node_lock)
    data = make_tar(server.root / "nolock.tar", {"a": b"1"})
    assert fastload.resolve(server.url("nolock.tar"), checksum=sha256(data), env=env)
    assert fastload.resolve(server.url("nolock.tar"), env=env) == env.tmpdir / "nolock"
    names = sorted(p.name for p in (env.cache / "downloads").rglob("*") if p.is_file())
    assert names == [".nolock.tar.fastload-download.json", "nolock.tar"]
    assert server.gets["nolock.tar"] == 1


def test_http_in_the_registry(tmp_path: Path, server: WebServer, http_backend: str) -> None:
    data = make_tar(server.root / "tiny.tar", {"tiny/a": b"a", "tiny/b": b"b"})
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'[datasets.tiny]\nreturns = "tiny"\nsources = [{{ url = "{server.url("tiny.tar")}", '
        f'checksum = "{sha256(data)}" }}]\n',
        encoding="utf-8",
    )
    env = detect(env_vars(tmp_path, FASTLOAD_CONFIG=str(cfg)), "node1")
    assert fastload.resolve("tiny", env=env) == env.tmpdir / "tiny" / "tiny"
    assert (env.tmpdir / "tiny" / "tiny" / "b").read_bytes() == b"b"


# --------------------------------------------------------------------------------------
# One stager per node
# --------------------------------------------------------------------------------------


def child(spec: dict[str, Any], environ: dict[str, str], *, stdin: bool = False) -> procs.Child:
    env = procs.child_env(**environ)
    for var in [v for v in env if v.startswith("SLURM_")]:
        del env[var]
    return procs.Child(spec, env=env, stdin=stdin, wrapper=[sys.executable, str(THIS)])


def test_six_processes_one_copy(tmp_path: Path) -> None:
    src = tmp_path / "shared" / "ds"
    trees.build_small_files(src, 300, per_dir=50)
    trees.write_patterned(src / "big.bin", 8 * trees.MiB, seed=1)
    (tmp_path / "datasets").mkdir()
    spec = {"args": [str(src)], "kwargs": {}, "wait_stdin": True}
    kids = [child(spec, env_vars(tmp_path), stdin=True) for _ in range(6)]
    try:
        for c in kids:
            assert c.wait_line("READY") is not None, c.finish().stderr
        for c in kids:
            c.go()
    finally:
        for c in kids:
            c.finish(timeout=120)
    results = [c.expect_result() for c in kids]
    dst = tmp_path / "node-local" / "ds"
    assert {r["path"] for r in results} == {str(dst)}
    staged = [r["staged"] for r in results]
    copiers = [s for s in staged if s["copied_files"] > 0]
    assert len(copiers) == 1, staged
    assert copiers[0]["copied_files"] == copiers[0]["files"] == 301
    trees.assert_same_tree(src, dst)


def test_six_processes_one_download(tmp_path: Path, server: WebServer) -> None:
    members = {f"d/{i}": os.urandom(30_000) for i in range(20)}
    data = make_tar(server.root / "shared.tar", members)
    (tmp_path / "datasets").mkdir()
    spec = {
        "args": [server.url("shared.tar")],
        "kwargs": {"checksum": sha256(data)},
        "wait_stdin": True,
    }
    kids = [child(spec, env_vars(tmp_path), stdin=True) for _ in range(6)]
    try:
        for c in kids:
            assert c.wait_line("READY") is not None, c.finish().stderr
        for c in kids:
            c.go()
    finally:
        for c in kids:
            c.finish(timeout=120)
    results = [c.expect_result() for c in kids]
    assert server.gets["shared.tar"] == 1
    assert len([r for r in results if r["staged"]["copied_files"] > 0]) == 1
    assert tree_of(tmp_path / "node-local" / "shared") == members


def test_waiter_takes_over_from_a_killed_stager(tmp_path: Path) -> None:
    src = tmp_path / "shared" / "ds"
    trees.build_small_files(src, 200, per_dir=50)
    (tmp_path / "datasets").mkdir()
    environ = env_vars(tmp_path)
    # The first stager stops inside the node lock (in its progress callback) ...
    first = child({"args": [str(src)], "kwargs": {}, "pause_in_progress": True}, environ,
                  stdin=True)
    second = None
    try:
        assert first.wait_line("PAUSED", timeout=60) is not None, first.finish().stderr
        # ... a second one starts and waits for the lock ...
        second = child({"args": [str(src)], "kwargs": {}, "quiet_progress": True}, environ)
        assert second.wait_stderr(f"waiting for process {first.proc.pid}"), (
            second.finish().stderr)
        procs.wait_blocked_on_lock(second.proc.pid)
        assert second.proc.poll() is None and second.result is None
        # ... and takes over when the first is killed.
        first.signal(signal.SIGKILL)
        second.finish(timeout=120)
    finally:
        first.finish(timeout=60)
        if second is not None:
            second.finish(timeout=60)
    assert first.returncode == -signal.SIGKILL and first.result is None
    res = second.expect_result()
    assert res["path"] == str(tmp_path / "node-local" / "ds")
    trees.assert_same_tree(src, tmp_path / "node-local" / "ds")
    assert fastload.verify(tmp_path / "node-local" / "ds").ok


def test_waiter_takes_over_a_killed_download(tmp_path: Path, server: WebServer) -> None:
    members = {f"f{i}": os.urandom(100_000) for i in range(30)}  # ~3 MiB: 1.5 s slowly
    data = make_tar(server.root / "big.tar", members)
    (tmp_path / "datasets").mkdir()
    environ = env_vars(tmp_path)
    server.slow = 1
    spec = {"args": [server.url("big.tar")], "kwargs": {"checksum": sha256(data)}}
    first = child(spec, environ)
    second = None
    try:
        assert server.sending.wait(60), first.finish().stderr
        second = child(spec, environ)
        procs.wait_blocked_on_lock(second.proc.pid)  # on the download's lock
        assert second.proc.poll() is None and second.result is None
        first.signal(signal.SIGKILL)
        second.finish(timeout=120)
    finally:
        first.finish(timeout=60)
        if second is not None:
            second.finish(timeout=60)
    assert first.returncode == -signal.SIGKILL and first.result is None
    second.expect_result()
    assert server.gets["big.tar"] == 2
    assert tree_of(tmp_path / "node-local" / "big") == members
    cached = next((tmp_path / "cache" / "downloads").rglob("big.tar"))
    assert cached.read_bytes() == data
    assert not list(cached.parent.glob("*.part"))


# --------------------------------------------------------------------------------------
# The child process
# --------------------------------------------------------------------------------------


def _emit(tag: str, payload: Any = None) -> None:
    sys.stdout.write(tag if payload is None else f"{tag} {json.dumps(payload)}")
    sys.stdout.write("\n")
    sys.stdout.flush()


def _child_main(spec: dict[str, Any]) -> int:
    """Calls resolve() with the spec's arguments and reports what stage() did."""
    resolve_module = sys.modules["fastload.env.resolver"]
    real_stage = resolve_module.stage
    staged: list[dict[str, Any]] = []

    def recording_stage(*args: Any, **kwargs: Any) -> Any:
        r = real_stage(*args, **kwargs)
        staged.append({"files": r.files, "copied_files": r.copied_files, "skipped": r.skipped})
        return r

    resolve_module.stage = recording_stage
    kwargs = dict(spec.get("kwargs", {}))
    if spec.get("pause_in_progress"):

        def pause(*_: int) -> None:
            _emit("PAUSED")
            sys.stdin.readline()  # holds the node lock until killed

        kwargs["progress"] = pause
    elif spec.get("quiet_progress"):
        # A callback (nothing shown): a process that has to wait for the node lock says
        # for whom on stderr.
        kwargs["progress"] = lambda *_: None
    _emit("READY")
    if spec.get("wait_stdin"):
        sys.stdin.readline()
    _emit("START")
    try:
        path = fastload.resolve(*spec.get("args", []), **kwargs)
    except Exception as e:
        _emit("ERROR", {"type": type(e).__name__, "str": str(e)})
        return 3
    _emit("RESULT", {"path": str(path), "staged": staged[-1] if staged else None})
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(json.loads(sys.argv[-1])))
