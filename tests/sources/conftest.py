"""The object store tests' fixtures (``s3``, ``proxy``, ``bucket``) are in tests/conftest.py,
shared with tests/cache/; the server and the proxy are in s3server.py here. ``server``: a
web server on loopback (kit/web.py) serving a folder of the test's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kit.web import WebServer, serving


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WebServer]:
    root = tmp_path / "www"
    root.mkdir()
    with serving(root) as srv:
        yield srv
