"""docs/read-while-staging.md: every ```python block runs as written, in order, in one
namespace, in a scratch directory holding the tree its examples name (``data/pets``:
three files in each of two class folders); the blocks' own asserts are the checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "read-while-staging.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_its_examples() -> None:
    assert len(_blocks()) == 4


def test_every_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    for cls in ("cat", "dog"):
        for i in range(1, 4):
            f = tmp_path / "data" / "pets" / cls / f"{i:04d}.jpg"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(b"\xff\xd8\xff\xe0" + f"{cls}{i}".encode() * 100)
    monkeypatch.chdir(tmp_path)
    ns: dict[str, object] = {"__name__": "doc"}
    for block in _blocks():
        exec(compile(block, str(DOC), "exec"), ns)
    assert ns["head"] == b"\xff\xd8\xff\xe0"
    assert Path(str(ns["path"])).read_bytes() == (tmp_path / "data/pets/dog/0002.jpg").read_bytes()
