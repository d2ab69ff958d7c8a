"""Every ```python block of docs/zip.md runs as written, in order, in a scratch directory
(its asserts are the checks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "zip.md"


def test_zip_doc_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) >= 4
    assert all("assert" in b or "zipfile.ZipFile" in b or "zip_options" in b for b in blocks)
    monkeypatch.chdir(tmp_path)
    ns: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), ns)
    assert (tmp_path / "staged" / "legacy" / "README.txt").exists()
