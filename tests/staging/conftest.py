"""Fixtures of the staging tests that several files share."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit import trees
from kit.trees import RWS_FILES


@pytest.fixture(scope="session")
def rws_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The read-while-staging tests' source (issue 49): RWS_FILES small files, 100 per
    folder; read only (a test that changes its source makes its own)."""
    root = tmp_path_factory.mktemp("rws") / "src"
    trees.build_small_files(root, RWS_FILES, per_dir=100, seed=49)
    return root
