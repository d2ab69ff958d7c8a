"""The documented ways into fan-out other than stage(fanout=True) from Python:
``fastload stage --fanout`` (and ``--fanout-transport torch``) run by every node, and
``resolve(..., fanout=True)``. Two "nodes" (processes with a torchrun job's variables)
read a source behind netsim, which counts what it served: once in total, not per node."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import pytest

from kit.netsim import Mount
from kit.nodes import data_bytes, fanout_tree, results, start_nodes
from kit.tools import require_module
from kit.trees import assert_same_tree

require_module("torch.distributed")

MiB = 1 << 20


# --fanout-transport alone implies --fanout (its help says so).
@pytest.mark.parametrize("flags", [["--fanout"], ["--fanout-transport", "torch"]],
                         ids=["fanout", "transport"])  # fmt: skip
def test_cli_stage_fanout(tmp_path: Path, netsim: Callable[..., Mount],
                          flags: list[str]) -> None:  # fmt: skip
    src = fanout_tree(tmp_path / "src", small=40, big=3 * MiB)
    store = netsim(src, 50, 50, direct=True)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    launcher = [sys.executable, "-m", "fastload", "stage", *flags, "--no-progress"]
    procs = start_nodes(store.path, dsts, init=False, launcher=launcher)
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (out, err)
    served = store.unmount()["read_bytes"]
    total = data_bytes(src)
    for d in dsts:
        assert_same_tree(src, d)
    # Read once in total (two nodes staging alone would read it twice).
    assert served <= 1.1 * total, (served, total)


def test_resolve_fanout(tmp_path: Path, netsim: Callable[..., Mount]) -> None:
    src = fanout_tree(tmp_path / "src", small=40, big=3 * MiB)
    store = netsim(src, 50, 50, direct=True)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    got = results(start_nodes(store.path, dsts, init=False, args=("--resolve",)))
    served = store.unmount()["read_bytes"]
    total = data_bytes(src)
    assert [Path(r["path"]) for r in got] == dsts
    for d in dsts:
        assert_same_tree(src, d)
    assert served <= 1.1 * total, (served, total)
