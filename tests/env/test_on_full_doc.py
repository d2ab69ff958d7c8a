"""Every ```python block of docs/on-full.md runs as written, in order, on a node whose
disk is a 1 MiB tmpfs, from a directory holding the 3 MiB folder ``bigds`` the page
names; what a block promises is asserted in the block itself."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from resolve_kit import clean_environ, env_vars

from kit import trees
from kit.trees import MiB

pytestmark = pytest.mark.native

PAGE = Path(__file__).resolve().parents[2] / "docs" / "on-full.md"


def _blocks() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_the_page_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_fs: Callable[..., Path]
) -> None:
    clean_environ(monkeypatch, tmp_path)
    node = small_fs("1m")
    for k, v in env_vars(tmp_path, FASTLOAD_TMPDIR=str(node)).items():
        monkeypatch.setenv(k, v)
    work = tmp_path / "work"
    for i in range(3):
        (work / "bigds" / f"c{i}").mkdir(parents=True)
        trees.write_patterned(work / "bigds" / f"c{i}" / "x.bin", MiB, seed=i)
    monkeypatch.chdir(work)
    blocks = _blocks()
    assert len(blocks) == 3
    namespace: dict[str, object] = {}
    for code in blocks:
        exec(compile(code, str(PAGE), "exec"), namespace)
    assert not any(p.name == "bigds" for p in node.iterdir()), "nothing staged"
