"""``fastload stage --background``: a stage in a process of its own session, the command
returning once it is under way (background.py's handle asks its stager how far it is)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from .background import RETRY, Staging
from .state import mkdir_parent

__all__ = ["stage_detached"]

#: ``fastload stage --background`` returns while the source is still listed after this
#: many seconds (before, a failure to open or list it is its own error and exit status).
STARTING_GRACE = 10.0


def stage_detached(src: str, dst: str, argv: list[str]) -> int:
    """``fastload stage --background``: runs ``fastload <argv>`` (``--serve``: it stages
    with wait=False and waits) in a process of its own session, and returns once that
    stage is under way (it serves readers), or with the process's error where it ended
    first. The process ends with the stage; in a job, with the job."""
    import subprocess
    import sys

    dst_abs = Path(os.path.abspath(dst))
    mkdir_parent(dst_abs.parent)
    log = dst_abs.parent / f".{dst_abs.name}.fastload-background.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastload", *argv], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    reader = Staging(src, dst_abs, {}, None)  # asks, never stages
    listing_since: float | None = None
    while proc.poll() is None:
        state = reader.progress().state
        if state == "starting" and listing_since is None:
            listing_since = time.monotonic()
        # Under way once it copies; a source that fails while it is opened and listed
        # (no credentials, a broken archive) is reported here, unless its listing
        # takes longer than STARTING_GRACE (then readers get its error).
        if state == "copying" or (state == "starting" and listing_since is not None
                                  and time.monotonic() - listing_since > STARTING_GRACE):
            print(f"{dst_abs}: staging in the background (process {proc.pid}; its errors "
                  f"in {log})")  # fmt: skip
            return 0
        if state not in ("waiting", "starting"):
            break  # ended already
        time.sleep(RETRY)
    code = proc.wait()
    text = log.read_text(errors="replace")
    sys.stderr.write(text if not text or text.endswith("\n") else text + "\n")
    if code == 0:
        print(f"{dst_abs}: staged")
    return code
