"""Runs one fastload call for a test in its own process and reports on stdout.

argv[1] is JSON: {"op": "stage"|"verify"|"pack", "src": ..., "dst": ..., "kwargs": {...},
"progress": bool, "hold": bool, "wait_stdin": bool}. Lines printed, each flushed at once:

    READY                     fastload is imported (then, with wait_stdin, a line is read)
    START                     stage() is being called
    PROGRESS bd bt fd ft      one progress callback (when "progress" is true)
    HELD                      with "hold": the first callback before the end sleeps
    RESULT {json}             the StageResult / VerifyResult / PackResult, exit status 0
    ERROR {json}              the exception raised (class, errno, filename, ...), status 3

KeyboardInterrupt is not caught: it ends the process the usual way. Ctrl-C works as in
a terminal even when the test run itself was started in the background, whose shell
ignores SIGINT (the child would inherit that, and Python then installs no handler).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def _emit(tag: str, payload: Any = None) -> None:
    line = tag if payload is None else f"{tag} {json.dumps(payload)}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _describe_error(e: BaseException) -> dict[str, Any]:
    import fastload

    checks = {
        "OSError": OSError,
        "FileNotFoundError": FileNotFoundError,
        "PermissionError": PermissionError,
        "ValueError": ValueError,
        "FastloadError": fastload.FastloadError,
        "StageError": fastload.StageError,
        "NotEnoughSpaceError": fastload.NotEnoughSpaceError,
        "SourceChangedError": fastload.SourceChangedError,
        "UnsupportedFileError": fastload.UnsupportedFileError,
    }

    def _s(v: Any) -> Any:
        return None if v is None else os.fsdecode(v) if isinstance(v, (str, bytes)) else str(v)

    return {
        "type": type(e).__name__,
        "str": str(e),
        "errno": getattr(e, "errno", None),
        "filename": _s(getattr(e, "filename", None)),
        "filename2": _s(getattr(e, "filename2", None)),
        "needed": getattr(e, "needed", None),
        "free": getattr(e, "free", None),
        "is": {name: isinstance(e, cls) for name, cls in checks.items()},
    }


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    spec = json.loads(sys.argv[1])
    import fastload

    _emit("READY")
    if spec.get("wait_stdin"):
        sys.stdin.readline()

    kwargs = dict(spec.get("kwargs", {}))
    if spec.get("progress"):

        held = []

        def cb(bd: int, bt: int, fd: int, ft: int) -> None:
            _emit(f"PROGRESS {bd} {bt} {fd} {ft}")
            if spec.get("hold") and not held and bd < bt:
                # The stage held mid-way, in its progress callback, for a signal to land
                # while it runs (however fast it is); Ctrl-C raises out of the sleep.
                held.append(bd)
                _emit("HELD")
                time.sleep(120)

        kwargs["progress"] = cb

    _emit("START")
    try:
        if spec["op"] == "verify":
            v = fastload.verify(spec["dst"])
            payload = {
                "ok": v.ok,
                "files": v.files,
                "mismatched": list(v.mismatched),
                "missing": list(v.missing),
            }
        elif spec["op"] == "pack":
            p = fastload.pack(spec["src"], spec["dst"], **kwargs)
            payload = {"shards": [str(s) for s in p.shards], "samples": p.samples}
        else:
            r = fastload.stage(spec["src"], spec["dst"], **kwargs)
            payload = {
                "path": str(r.path),
                "files": r.files,
                "bytes": r.bytes,
                "seconds": r.seconds,
                "engine": r.engine,
                "skipped": r.skipped,
                "copied_files": r.copied_files,
                "copied_bytes": r.copied_bytes,
            }
    except Exception as e:
        _emit("ERROR", _describe_error(e))
        return 3
    _emit("RESULT", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
