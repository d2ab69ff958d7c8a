"""Several processes of one node staging the same source to the same destination at
once: one copies, the others wait for it and return; the tree is whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit import procs, trees

pytestmark = pytest.mark.native


@pytest.mark.parametrize("n_procs", [5])
def test_concurrent_stagers_make_one_copy(engine: str, mixed_src: Path, tmp_path: Path,
                                          n_procs: int) -> None:
    dst = tmp_path / "data" / "dst"
    dst.parent.mkdir()
    spec = {**procs.stage_spec(mixed_src, dst, engine=engine), "wait_stdin": True}
    children = [procs.Child(spec, env=procs.child_env(), stdin=True)
                for _ in range(n_procs)]
    try:
        for c in children:  # all imported and waiting: start them together
            assert c.wait_line("READY") is not None, c.finish().stderr
        for c in children:
            c.go()
    finally:
        for c in children:
            c.finish(timeout=180)
    results = [c.expect_result() for c in children]

    n, size = len(trees.regular_files(mixed_src)), sum(trees.regular_files(mixed_src).values())
    for r in results:
        assert (r["files"], r["bytes"]) == (n, size), r
        assert r["path"] == str(dst)
    copiers = [r for r in results if r["copied_files"] > 0]
    assert len(copiers) == 1, f"{len(copiers)} processes copied: {results}"
    assert copiers[0]["copied_files"] == n and copiers[0]["copied_bytes"] == size
    for r in results:
        if r is not copiers[0]:
            assert r["copied_bytes"] == 0, r
            assert r["skipped"] is True or r["copied_files"] == 0, r
    trees.assert_same_tree(mixed_src, dst)
    leftovers = {p.name for p in dst.parent.iterdir()} - {
        "dst", ".dst.fastload.lock", ".dst.fastload"}
    assert not leftovers, leftovers


def test_concurrent_stagers_different_destinations(engine: str, rich_src: Path,
                                                   tmp_path: Path) -> None:
    """Locks are per destination: stagers of different destinations do not block or
    disturb each other."""
    dsts = [tmp_path / f"dst{i}" for i in range(3)]
    children = [procs.Child({**procs.stage_spec(rich_src, d, engine=engine),
                               "wait_stdin": True}, env=procs.child_env(), stdin=True)
                for d in dsts]
    try:
        for c in children:
            assert c.wait_line("READY") is not None, c.finish().stderr
        for c in children:
            c.go()
    finally:
        for c in children:
            c.finish(timeout=180)
    for i, c in enumerate(children):
        d = dsts[i]
        res = c.expect_result()
        assert res["copied_files"] == res["files"] > 0
        trees.assert_same_tree(rich_src, d)
