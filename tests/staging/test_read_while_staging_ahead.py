"""A stage that follows the loop (issue 49): FileDataset.sampler() gives a DataLoader the
epoch's order and hints the stager the files coming next (Staging.ahead, the channel's
"ahead" op); the stager fetches the files hinted before its own order, each once, and
ignores a hint for a path outside the tree or not in the source.

The source is a netsim mount (2 ms per request) and the stage keeps 2 files in flight:
its own order takes seconds, so where the hinted files land in it shows."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from fastload.data.files import FileDataset
from fastload.staging.background import Staging
from fastload.staging.channel import Client, channel_name
from fastload.staging.state import read_manifest
from kit import trees
from kit.netsim import hold_the_listing, listed, staging_behind
from kit.trees import RWS_FILES

N = RWS_FILES


@pytest.fixture
def tree(rws_tree: Path) -> Path:
    return rws_tree


def _size(path: str) -> int:
    return os.path.getsize(path)


def test_the_stage_fetches_the_files_hinted_first(tree: Path, tmp_path: Path) -> None:
    """60 files picked at random over the tree, hinted once the plan exists, are all
    whole at their names while most of the tree is not (without the hints they are
    spread over the stage's order: the last of them lands near its end)."""
    names = sorted(trees.regular_files(tree))
    hinted = random.Random(49).sample(names, 60)
    with staging_behind(tmp_path, tree) as (m, dst, h):
        listed(h)
        h.ahead(hinted)
        landed = None
        while landed is None:
            done = h.progress().files_done
            if all(os.path.exists(dst / rel) for rel in hinted):
                landed = done  # files done before the last hinted one landed, at most
            time.sleep(0.005)
        result = h.wait()
        counts = m.unmount()
    assert landed < N // 2, f"the hinted files landed after {landed} of {N} files"
    assert result.files == N and result.copied_files == N
    assert counts["opens"] == N  # each file fetched once
    trees.assert_same_tree(tree, dst)


def test_files_hinted_before_the_listing_are_fetched_then(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hints before the stager's listing exists (held here): the hinted files are
    fetched at once (a path not in the source ignored), then handed to the plan and not
    fetched again."""
    go = hold_the_listing(monkeypatch)
    names = sorted(trees.regular_files(tree))
    hinted = random.Random(7).sample(names, 40)
    with staging_behind(tmp_path, tree) as (m, dst, h):
        assert h.files() == names  # (the names' walk: hints come after it)
        h.ahead(["dir000/nope.dat", "../x", *hinted])
        for _ in range(3000):  # (a bound on the wait, not a timing figure)
            if all(os.path.exists(dst / rel) for rel in hinted):
                break
            time.sleep(0.01)
        assert all(os.path.exists(dst / rel) for rel in hinted), "not fetched early"
        assert h.progress().state == "starting"  # no listing yet: fetched early
        go.set()
        result = h.wait()
        counts = m.unmount()
    assert result.files == N and result.copied_files == N
    assert counts["opens"] == N  # the files fetched early were not fetched again
    manifest = read_manifest(dst)
    assert manifest is not None and manifest["complete"] and len(manifest["files"]) == N
    trees.assert_same_tree(tree, dst)


def test_a_hint_outside_the_tree_is_ignored(tree: Path, tmp_path: Path) -> None:
    """Hints naming paths outside the tree, absolute, or not in the source are
    acknowledged and ignored; a DataLoader over the sampler of a torchvision drop-in on
    the handle reads every file once and the stage is whole."""
    torch = pytest.importorskip("torch")
    import fastload.torchvision as ftv

    names = sorted(trees.regular_files(tree))
    assert all(n.endswith(".dat") for n in names)
    with staging_behind(tmp_path, tree) as (m, dst, h):
        listed(h)
        bad = ["../src/dir000/" + os.path.basename(names[0]), "/etc/passwd", "dir000/nope.dat",
               "", ".", names[-1]]  # fmt: skip
        reply = Client(channel_name(dst)).request({"op": "ahead", "paths": bad})
        assert reply["state"] in ("copying", "done") and "error" not in reply
        h.ahead(bad)
        ds = ftv.DatasetFolder(h, loader=_size, extensions=(".dat",))  # over the handle
        assert len(ds) == N
        loader = torch.utils.data.DataLoader(ds, batch_size=32, sampler=ds.sampler(seed=3),
                                             num_workers=2, collate_fn=list)  # fmt: skip
        sizes = [s for batch in loader for s, _t in batch]
        result = h.wait()
        counts = m.unmount()
    assert sorted(sizes) == sorted((tree / rel).stat().st_size for rel in names)
    assert result.files == N and result.copied_files == N
    assert counts["opens"] == N
    manifest = read_manifest(dst)
    assert manifest is not None and manifest["complete"] and len(manifest["files"]) == N
    # "../src/..." would land beside dst, "/etc/passwd" under dst (assert_same_tree)
    assert not (tmp_path / "src").exists() and not (dst / "dir000" / "nope.dat").exists()
    trees.assert_same_tree(tree, dst)


class _Recorder(Staging):
    """A handle on a tree in place that keeps the hints it is given (a stage done sends
    none: this shows what the sampler would send)."""

    hints: list[list[str]]

    def ahead(self, relpaths: object) -> None:  # type: ignore[override]
        self.hints.append(list(relpaths))  # type: ignore[call-overload]


def test_the_sampler_draws_a_seeded_permutation_per_epoch(tree: Path) -> None:
    pytest.importorskip("torch")
    import torch

    names = sorted(trees.regular_files(tree))
    ds = FileDataset(tree, names, _size)
    a, b = ds.sampler(seed=7), ds.sampler(seed=7)
    first, second = list(a), list(a)
    assert sorted(first) == sorted(second) == list(range(N)) and len(a) == N
    assert first != second  # a new permutation per epoch
    assert [list(b), list(b)] == [first, second]  # the same seed, the same epochs
    assert list(ds.sampler(seed=8)) != first
    b.set_epoch(1)
    assert list(b) == second
    assert list(ds.sampler(shuffle=False)) == list(range(N))
    torch.manual_seed(5)  # no seed: torch's generator, as RandomSampler
    x = list(ds.sampler())
    torch.manual_seed(5)
    assert list(ds.sampler()) == x and sorted(x) == list(range(N))


def test_the_sampler_hints_windows_ahead_of_its_position(tree: Path) -> None:
    """The first window (``ahead`` files), then each ``step`` samples the files that
    come into it: every file hinted once, before its index is yielded."""
    names = sorted(trees.regular_files(tree))
    h = _Recorder.ready(tree)
    assert isinstance(h, _Recorder)
    h.hints = []
    ds = FileDataset(h, names, _size)
    sampler = ds.sampler(seed=1)
    sampler.ahead, sampler.step = 300, 100
    got: list[int] = []
    for k, i in enumerate(sampler):
        sent = [p for hint in h.hints for p in hint]
        assert names[i] in sent  # hinted before it is read
        assert len(sent) == min(N, 300 + (k // 100) * 100)  # a window ahead, no more
        got.append(i)
    sent = [p for hint in h.hints for p in hint]
    assert sent == [names[i] for i in got]  # in the loop's order, each once
    assert [len(x) for x in h.hints[:2]] == [300, 100]


def test_ahead_never_blocks_nor_fails_without_a_stager(tmp_path: Path) -> None:
    """A handle whose stager is gone (none serves the channel): ahead() returns at
    once, its hints dropped by the thread that sends them."""
    h = Staging("nowhere", tmp_path / "dst", {}, None)
    h.ahead(["a", "../b"] * 1000)  # returns (the test would hang otherwise)
    for _ in range(100):
        with h._hints_cond:
            if not h._hints:
                break
        time.sleep(0.01)
    with h._hints_cond:
        assert h._hints == []
    assert h._final is None  # nothing taken over, nothing failed
