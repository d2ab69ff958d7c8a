"""A Mix killed (SIGKILL, DataLoader workers running) at random points of an epoch and
resumed in a new process: the same worker count (StatefulDataLoader's own restore)
gives exactly the rest of the uninterrupted epoch; 3 workers or none, and a world of 2
ranks resumed as 3, read exactly what was left. Remote streams, through the node cache
on the loopback S3 server, read what the same streams read locally.

Child processes run this file (``python test_mix_resume.py MODE JSON``).
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

import fastload  # noqa: E402
from fastload.data import partition  # noqa: E402
from kit.procs import run_script, with_tests_on_path  # noqa: E402

pytestmark = pytest.mark.native

HERE = Path(__file__).resolve()
SETS = {"web": (105, 40), "books": (45, 25), "code": (18, 18)}  # samples, per shard
WEIGHTS = {"web": 0.7, "books": 0.2, "code": 0.1}
CONFIGS = {"mixed": {"batch_size": 6}, "per_stream": {"batch_size": 6, "batching": "per_stream"}}


def write_sets(root: Path) -> dict[str, str]:
    out = {}
    for name, (total, per) in SETS.items():
        w = fastload.ShardWriter(root / name, max_count=per)
        for i in range(total):
            w.write({"__key__": f"{name}/{i:05d}", "bin": os.urandom(5 + i % 40)})
        out[name] = str(w.close().path)  # type: ignore[union-attr]
    return out


def make(sets: dict[str, str], config: str, **kw: Any) -> Any:
    streams = [fastload.Stream(sets[n], proportion=w, name=n) for n, w in WEIGHTS.items()]
    return fastload.Mix(streams, samples_per_epoch=200, seed=11, shuffle_block=16,
                        **CONFIGS[config], **kw)  # fmt: skip


def keys_of(batches: Any) -> list[str]:
    return [s["__key__"] for b in batches for s in b]


def keep_list(batch: list[Any]) -> list[Any]:
    return batch


def loader(ds: Any, workers: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ctx = multiprocessing.get_context("fork") if workers else None
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers, collate_fn=keep_list,
                              multiprocessing_context=ctx)  # fmt: skip


# --- children ------------------------------------------------------------------------------


def child_read(args: dict[str, Any]) -> None:
    """Reads batches, saving the keys so far and the loader's state after each (atomic
    rename); after ``stop`` batches it waits to be killed."""
    if args["world_size"] > 1:
        os.environ.update(RANK=str(args["rank"]), WORLD_SIZE=str(args["world_size"]))
    dl = loader(make(args["sets"], args["config"]), 2)
    keys: list[str] = []
    out = Path(args["out"])
    for n, batch in enumerate(dl, 1):
        keys += [s["__key__"] for s in batch]
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps({"keys": keys, "state": dl.state_dict(), "batches": n}))
        os.replace(tmp, out)
        if n == args["stop"]:
            time.sleep(600)  # killed here, workers running


def child_resume(args: dict[str, Any]) -> None:
    """Resumes saved states every way; writes the keys each way read."""
    saved = [pickle.loads(Path(p).read_bytes())["state"] for p in args["saved"]]
    sets, config = args["sets"], args["config"]
    out: dict[str, Any] = {}
    if len(saved) == 1:
        dl = loader(make(sets, config), 2)
        dl.load_state_dict(saved[0])
        out["same"] = keys_of(dl)
        for workers in (3, 0):
            ds = make(sets, config)
            ds.load_state_dict(saved[0])
            out[str(workers)] = keys_of(loader(ds, workers))
    else:
        out["world3"] = []
        for rank in range(3):
            os.environ.update(RANK=str(rank), WORLD_SIZE="3")
            ds = make(sets, config)
            ds.load_state_dict(saved)
            out["world3"].append(keys_of(loader(ds, 1)))
    Path(args["out"]).write_bytes(pickle.dumps(out))


# --- the parent ----------------------------------------------------------------------------


def kill_at(args: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """Runs ``child_read`` and SIGKILLs it once it has saved ``args['stop']`` batches."""
    env = with_tests_on_path(dict(os.environ))
    out = Path(args["out"])
    log = out.with_suffix(".log")
    with log.open("wb") as f:
        p = subprocess.Popen([sys.executable, str(HERE), "read", json.dumps(args)], env=env,
                             stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while True:
            if out.exists() and pickle.loads(out.read_bytes())["batches"] >= args["stop"]:
                break
            if p.poll() is not None:
                raise AssertionError(log.read_text(errors="replace")[-4000:])
            assert time.monotonic() < deadline, "the reading child hangs"
            time.sleep(0.05)
    finally:
        p.kill()
        p.wait()
    saved: dict[str, Any] = pickle.loads(out.read_bytes())
    return saved


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_sets(tmp_path_factory.mktemp("mixr"))


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_kill_and_resume(config: str, sets: dict[str, str], tmp_path: Path) -> None:
    require_module("torchdata.stateful_dataloader")
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    whole = keys_of(loader(make(sets, config), 2))
    batches = len(whole) // 6
    stop = rng.randrange(1, batches - 1)
    base = {"sets": sets, "config": config, "world_size": 1, "rank": 0}
    saved = kill_at({**base, "stop": stop, "out": str(tmp_path / "one.pkl")})
    first = saved["keys"]
    assert first == whole[: len(first)] and len(first) >= stop * 6, seed
    run_script(HERE, "resume", [{**base, "saved": [str(tmp_path / "one.pkl")],
                                 "out": str(tmp_path / "r1.pkl")}])  # fmt: skip
    got = pickle.loads((tmp_path / "r1.pkl").read_bytes())
    assert first + got["same"] == whole, seed
    for workers in ("3", "0"):
        assert sorted(first + got[workers]) == sorted(whole), (seed, workers)
    # Two ranks killed at their own random points, resumed by three.
    ranks = []
    for rank in range(2):
        stop_r = rng.randrange(1, batches // 2 - 1)
        ranks.append(kill_at({**base, "world_size": 2, "rank": rank, "stop": stop_r,
                              "out": str(tmp_path / f"rank{rank}.pkl")}))  # fmt: skip
    run_script(HERE, "resume", [{**base, "saved": [str(tmp_path / f"rank{r}.pkl") for r in (0, 1)],
                                 "out": str(tmp_path / "r3.pkl")}])  # fmt: skip
    again = pickle.loads((tmp_path / "r3.pkl").read_bytes())["world3"]
    read = [k for r in ranks for k in r["keys"]]
    n = len(whole) if config == "mixed" else len(whole) // 6  # positions: samples or batches
    per = 1 if config == "mixed" else 6
    padded = 4 * partition.share(n, 4, False)
    left = padded - len(read) // per
    assert [len(a) // per for a in again] == [-(-left // 3)] * 3, seed
    everything = collections.Counter(read + [k for a in again for k in a])
    assert set(everything) == set(whole), seed
    assert sum(everything.values()) == (padded + (-left) % 3) * per, seed


# --- remote streams ------------------------------------------------------------------------


def test_remote_streams_through_the_cache(tmp_path: Path, s3: Any, bucket: str,
                                          sets: dict[str, str]) -> None:  # fmt: skip
    from cache.remote_kit import cache_bytes
    from sources.s3server import upload

    folder = Path(sets["web"]).parent
    upload(s3, bucket, {f"web/{p.name}": p.read_bytes() for p in sorted(folder.glob("*.tar"))})
    url = f"s3://{bucket}/web/"
    streams = [fastload.Stream(url, proportion=0.7, name="web"),
               fastload.Stream(sets["books"], proportion=0.2, name="books"),
               fastload.Stream(sets["code"], proportion=0.1, name="code")]  # fmt: skip
    for config in CONFIGS:
        remote = fastload.Mix(streams, samples_per_epoch=200, seed=11, shuffle_block=16,
                              cache_dir=tmp_path / "cache", cache_limit="1MB", num_workers=2,
                              **CONFIGS[config])  # fmt: skip
        dl = torch.utils.data.DataLoader(remote, batch_size=None, num_workers=2,
                                         collate_fn=keep_list,
                                         multiprocessing_context=multiprocessing.get_context(
                                             "fork"))  # fmt: skip
        got = [plain(b) for b in dl]
        local = make(sets, config, num_workers=2)
        want = [plain(b) for b in torch.utils.data.DataLoader(
            local, batch_size=None, num_workers=2, collate_fn=keep_list,
            multiprocessing_context=multiprocessing.get_context("fork"))]  # fmt: skip
        assert got == want and len(got) == len(remote), config
        assert {s["__stream__"] for b in got for s in b} == {"web", "books", "code"}
        assert cache_bytes(tmp_path / "cache") > 0  # web's shards came through the cache
    # a cache that cannot hold what 2 readers pin: refused before any shard is fetched
    with pytest.raises(ValueError, match=r"for num_workers=2 the minimum cache_limit is"):
        fastload.Mix(streams, samples_per_epoch=200, cache_dir=tmp_path / "small",
                     cache_limit=60_000, num_workers=2)  # fmt: skip


def plain(batch: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A batch as comparable values: names as they are, a digest of each payload."""
    return [{k: v if isinstance(v, str) else hashlib.sha256(bytes(v)).hexdigest()[:16]
             for k, v in s.items()} for s in batch]  # fmt: skip


def _main(argv: Sequence[str]) -> None:
    mode, args = argv[0], json.loads(argv[1])
    {"read": child_read, "resume": child_resume}[mode](args)


if __name__ == "__main__":
    _main(sys.argv[1:])
