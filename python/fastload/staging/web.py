"""stage() of an ``http(s)://`` URL: a file or an archive on a web server.

The body is downloaded first, as resolve() downloads (sources/download.py: resumed
after an interruption with ``Range`` and ``If-Range``, so a changed file is fetched
whole; a checksum verified as it arrives), into a folder beside the destination
(``.NAME.fastload-http``), then staged like a local file or archive. The download is
removed once the stage is complete; after a failure it is kept, so the next call
resumes it instead of starting over.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from ..sources.download import download
from .destination import Destination
from .request import Source, StageRequest
from .result import StageResult


class WebSource:
    """A local source made from a download of ``url``, named by the URL (the messages
    and the manifest's source), the download removed once the stage is complete."""

    def __init__(self, url: str, inner: Any, folder: Path) -> None:
        self.url, self.inner, self.folder = url, inner, folder
        self.name = self.label = url

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        result: StageResult = self.inner.run(req, dest, listing)
        shutil.rmtree(self.folder, ignore_errors=True)
        return result


def open_web(url: str, dst: str | os.PathLike[str], req: StageRequest,
             open_local: Any) -> tuple[Source, Destination]:  # fmt: skip
    """The source and destination of a stage() of ``url`` (``open_local``: how api.py
    opens a local file or archive)."""
    if req.fanout is not False:
        raise ValueError(f"fanout= stages a local tree or an object store, not '{url}'")
    dst_abs = Path(os.path.abspath(os.fspath(dst)))
    folder = dst_abs.parent / f".{dst_abs.name}.fastload-http"
    checksum = None if req.checksum is None else ":".join(req.checksum)
    got = download(url, folder, checksum, req.progress)
    # verified as it arrived: the local pipeline need not read it again for that
    local = dataclasses.replace(req, checksum=None)
    source, dest = open_local(got, Path(os.fspath(dst)), local)
    return WebSource(url, source, folder), dest
