"""A remote reader in a process forked after it was made (a DataLoader worker): the pin a
read holds is never given back by the give-back thread during that read.

CI caught ``test_epoch_completes_under_limit[3-workers-minimum]`` failing with a worker's
``FileNotFoundError: open shard '.../views/.../train-000003.tar'``: the first read of a
forked worker held the reader's lock inherited from the parent, then replaced it with a
new one (the fork check inside ``get()``), so the give-back thread, trying the new lock
while another worker waited for room, let go of the pin of the shard being read, and the
waiting worker evicted it.
"""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

require_module("obstore", "the s3 extra (obstore) is not installed")

from remote_kit import issue_shards, put_shards  # noqa: E402

from fastload.data._remote import open_remote  # noqa: E402


def _first_read_in_a_fork(reader: Any, out: Any) -> None:
    def fetch(index: Any, ids: list[int]) -> list[Any]:
        # What the give-back thread does while another reader waits for room, here
        # during the read: it must find the read's lock taken and keep the pin.
        t = threading.Thread(target=reader.give_back)
        t.start()
        t.join()
        return [reader._held is not None for _ in ids]

    try:
        out.put(reader.read([0, 1], fetch))
    except BaseException as e:
        out.put(repr(e))


def test_a_forked_readers_first_read_keeps_its_pin(s3: Any, bucket: str,
                                                    tmp_path: Path) -> None:  # fmt: skip
    paths = issue_shards(tmp_path / "local", seed=7, shards=2, per_shard=20)
    url = put_shards(s3, bucket, paths)
    reader = open_remote(url, tmp_path / "c", None, None)
    reader.get()  # opened here, as the dataset does where it is made
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_first_read_in_a_fork, args=(reader, out))
    p.start()
    got = out.get(timeout=120)
    p.join(30)
    assert got == [True, True], got
    if p.exitcode is None:
        p.kill()
        pytest.fail("the forked reader did not end")
