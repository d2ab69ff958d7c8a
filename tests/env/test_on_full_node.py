"""resolve() of data larger than the node-local disk (a 1 MiB tmpfs), continued: shards
under a prefix of a real S3 server on loopback are downloaded once into the cache, the
warning naming ShardIterableDataset(..., cache_limit=...); four processes of one node
asking at once agree on one decision, made by one of them.

The four processes run this file as a script (``_child``), released together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from resolve_kit import clean_environ, env_vars, make_tar, tree_of

import fastload
from fastload.env import OnFullWarning, detect, placements
from kit import procs
from kit.trees import MiB

pytestmark = pytest.mark.native

THIS = Path(__file__).resolve()
SmallFs = Callable[..., Path]


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_environ(monkeypatch, tmp_path)


def test_shards_in_a_bucket_go_to_the_cache(
    tmp_path: Path, small_fs: SmallFs, bucket: str, s3: Any
) -> None:
    from sources.s3server import upload

    node = small_fs("1m")
    shards = {}
    for i in range(3):
        tar = tmp_path / "shards" / f"train-{i:04d}.tar"
        make_tar(tar, {f"s{i}.bin": os.urandom(MiB)})
        shards[f"shards/train-{i:04d}.tar"] = tar.read_bytes()
    upload(s3, bucket, shards)
    env = detect(env_vars(tmp_path, FASTLOAD_TMPDIR=str(node)), "node1")
    url = f"s3://{bucket}/shards/"
    with pytest.warns(OnFullWarning) as record:
        got = fastload.resolve(url, env=env)
    assert env.cache in got.parents
    assert {f"shards/{k}": v for k, v in tree_of(got).items()} == shards
    (text,) = [str(w.message) for w in record]
    assert f"fastload: 'shards' ({url}) needs 3.0 MiB and the node-local disk at '{node}'" in text
    assert f"downloading it once into the cache '{got}' instead" in text
    assert ("ShardIterableDataset(..., cache_limit=...) trains on shards larger than the "
            "disk") in text  # fmt: skip
    assert "\n" not in text
    (place,) = placements(node)
    assert (place.where, place.kind, place.shards) == ("cache", "prefix", True)
    assert sorted(p.name for p in node.iterdir() if not p.name.startswith(".")) == []


def test_on_full_error_for_a_prefix(
    tmp_path: Path, small_fs: SmallFs, bucket: str, s3: Any
) -> None:
    from sources.s3server import upload

    node = small_fs("1m")
    upload(s3, bucket, {f"p/f{i}.bin": os.urandom(MiB) for i in range(2)})
    env = detect(env_vars(tmp_path, FASTLOAD_TMPDIR=str(node)), "node1")
    with pytest.raises(fastload.NotEnoughSpaceError, match="not enough space to stage into"):
        fastload.resolve(f"s3://{bucket}/p/", env=env, on_full="error")


@pytest.mark.parametrize("kind", ["tree", "archive"])
def test_four_processes_of_a_node_decide_once(
    tmp_path: Path, small_fs: SmallFs, kind: str
) -> None:
    node = small_fs("1m")
    members = {f"d/f{i}.bin": os.urandom(MiB) for i in range(3)}
    src = tmp_path / "shared" / "bigds"
    if kind == "archive":
        src = src.with_suffix(".tar")
        make_tar(src, members)
    else:
        for name, data in members.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes(data)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    environ = procs.with_tests_on_path(environ | env_vars(tmp_path, FASTLOAD_TMPDIR=str(node)))
    pipe = subprocess.PIPE
    kids = [
        subprocess.Popen([sys.executable, str(THIS), str(src)], env=environ, cwd="/",
                         text=True, stdin=pipe, stdout=pipe, stderr=pipe)
        for _ in range(4)
    ]
    try:
        for k in kids:
            assert k.stdout is not None and k.stdout.readline().strip() == "READY"
        for k in kids:  # released together
            assert k.stdin is not None
            k.stdin.write("go\n")
            k.stdin.flush()
        outs = [k.communicate(timeout=120) for k in kids]
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
                k.wait()
    assert all(k.returncode == 0 for k in kids), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    (place,) = placements(node)
    assert place.decided_by.split()[1] in {str(k.pid) for k in kids}
    assert place.followed == 3, "each process but one follows the recorded decision"
    assert {r["path"] for r in results} == {place.path}
    assert len({r["warning"] for r in results}) == 1 and results[0]["warning"] == place.why
    if kind == "tree":
        assert place.where == "in_place" and place.path == str(src)
    else:
        assert place.where == "cache" and tree_of(Path(place.path)) == members
    assert sorted(p.name for p in node.iterdir() if not p.name.startswith(".")) == []


def _child(src: str) -> None:
    print("READY", flush=True)
    sys.stdin.readline()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = fastload.resolve(src)
    (warning,) = [str(w.message) for w in caught if w.category is OnFullWarning]
    print(json.dumps({"path": str(path), "warning": warning}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
