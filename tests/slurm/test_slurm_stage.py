"""Under real srun: staging to each node's SLURM_TMPDIR, one copy per node while every
task gets the ready path; and a stage step cancelled with scancel resumes in the next
step of the same job."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from slurm_task import names_digest

from kit.slurm import NODES, TASK, Cluster


def make_tree(root: Path, files: int = 40) -> dict[str, bytes]:
    tree = {}
    for i in range(files):
        rel = f"part{i % 4}/file{i:03d}.bin"
        data = hashlib.sha256(str(i).encode()).digest() * (64 + i * 50)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        tree[rel] = data
    return tree


def read_tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }


def test_stage_and_resolve_one_copy_per_node(slurm: Cluster, tmp_path: Path) -> None:
    src = slurm.root / "shared" / tmp_path.name / "src"  # "network" storage all nodes see
    src.mkdir(parents=True)
    want = make_tree(src)
    # One job on three nodes: stage, then resolve (six tasks each), then the CLI (one a
    # node); each task reports what it got while the job (and its SLURM_TMPDIR) exists.
    job, code = slurm.sbatch(
        f"""#!/bin/bash
set -e
srun {slurm.python} {TASK} stage {src} data
srun {slurm.python} {TASK} resolve {src} {slurm.root}/shared/{tmp_path.name}/cache
srun -n 3 --ntasks-per-node=1 bash -c '{slurm.python} -m fastload stage --no-progress \
{src} "$SLURM_TMPDIR/cli" && {slurm.python} {TASK} list "$SLURM_TMPDIR/cli"'
""",
        "-N", "3", "--ntasks-per-node=2", "-o", str(tmp_path / "out.txt"),
    )  # fmt: skip
    assert code == 0, (tmp_path / "out.txt").read_text()
    lines = [json.loads(x) for x in (tmp_path / "out.txt").read_text().splitlines()
             if x.startswith("{")]  # fmt: skip
    staged = [x for x in lines if "copied_files" in x]
    listed = [x for x in lines if "listed" in x]
    resolved = [x for x in lines if "files" not in x and "listed" not in x]
    assert len(staged) == len(resolved) == 6 and len(listed) == 3
    for node in NODES:
        here = [x for x in staged if x["nodename"] == node]
        assert len(here) == 2
        # The two tasks of a node get the same path in that node's own SLURM_TMPDIR...
        assert {x["path"] for x in here} == {str(slurm.local(node, job) / "data")}
        # ...and only one of them copied: the other waited for it.
        assert sorted(x["copied_files"] for x in here) == [0, len(want)]
        assert all(x["files"] == len(want) for x in here)
        paths = {x["path"] for x in resolved if x["nodename"] == node}
        assert len(paths) == 1 and paths.pop().startswith(str(slurm.local(node, job)) + "/")
    for cli in listed:  # ``fastload stage`` in each node's SLURM_TMPDIR
        assert cli["path"] == str(slurm.local(cli["nodename"], job) / "cli")
        assert (cli["listed"], cli["names_sha256"]) == (len(want), names_digest(sorted(want)))
    assert sorted(x["nodename"] for x in listed) == list(NODES)
    # The epilog removed every node's directory when the job ended.
    assert not any(slurm.local(n, job).exists() for n in NODES)


class _Stalling(http.server.BaseHTTPRequestHandler):
    """Serves one file; the first GET that takes it sends half of it, then waits for
    ``release``."""

    body = b""
    stall = threading.Event()
    release = threading.Event()
    requests: ClassVar[list[dict[str, Any]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        rng = self.headers.get("Range")
        type(self).requests.append({"range": rng, "if_range": self.headers.get("If-Range")})
        start = int(rng.split("=")[1].split("-")[0]) if rng else 0
        self.send_response(206 if rng else 200)
        self.send_header("ETag", '"v1"')
        self.send_header("Content-Length", str(len(self.body) - start))
        if rng:
            end = len(self.body) - 1
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.body)}")
        self.end_headers()
        # fastload may ask once for the headers only (and hang up): the first request
        # that takes its half is the one that stalls.
        first = not rng and not type(self).stall.is_set()
        half = len(self.body) // 2 if first else len(self.body)
        try:
            self.wfile.write(self.body[start:half])
            self.wfile.flush()
            if first:
                type(self).stall.set()
                type(self).release.wait(60)
        except OSError:
            pass


@pytest.fixture
def stalling_server() -> Iterator[tuple[str, type[_Stalling]]]:
    class Handler(_Stalling):  # state of its own per test
        stall = threading.Event()
        release = threading.Event()
        requests: ClassVar[list[dict[str, Any]]] = []

    Handler.body = os.urandom(1 << 20) * 8
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/blob.bin", Handler
    finally:
        Handler.release.set()
        server.shutdown()
        server.server_close()


def test_scancel_of_a_stage_step_resumes_in_the_next(
    slurm: Cluster, tmp_path: Path, stalling_server: tuple[str, type[_Stalling]]
) -> None:
    url, handler = stalling_server
    cache = slurm.root / "shared" / tmp_path.name / "cache"
    out = tmp_path / "out.txt"
    job, _ = slurm.sbatch(
        f"""#!/bin/bash
srun -n 1 {slurm.python} {TASK} resolve {url} {cache}
echo "step 0 ended: $?"
srun -n 1 {slurm.python} {TASK} resolve {url} {cache}
echo "step 1 ended: $?"
srun -n 1 bash -c 'sha256sum $SLURM_TMPDIR/*/blob.bin $SLURM_TMPDIR/blob.bin 2>/dev/null'
""",
        "-N", "1", "-n", "1", "-o", str(out), wait=False,
    )  # fmt: skip
    assert handler.stall.wait(60), "the first step never asked for the file"
    part = next(iter(cache.rglob(".blob.bin.part")), None)
    for _ in range(600):  # the half it was sent is on disk
        part = next(iter(cache.rglob(".blob.bin.part")), None)
        if part is not None and part.stat().st_size >= len(handler.body) // 2:
            break
        time.sleep(0.05)
    assert part is not None and part.stat().st_size == len(handler.body) // 2
    assert f"{job}.0" in slurm.states(job)
    slurm.run(["scancel", f"{job}.0"])
    for _ in range(1200):
        if not slurm.states(job):
            break
        time.sleep(0.05)
    assert not slurm.states(job), "the job did not end"
    text = out.read_text()
    assert "step 0 ended: 0" not in text and "step 1 ended: 0" in text, text
    # The second step asked for the rest only, of the same version.
    ranged = [r for r in handler.requests if r["range"]]
    assert [r["range"] for r in ranged] == [f"bytes={len(handler.body) // 2}-"]
    assert ranged[0]["if_range"] == '"v1"'
    digest = hashlib.sha256(handler.body).hexdigest()
    assert digest in text, text
