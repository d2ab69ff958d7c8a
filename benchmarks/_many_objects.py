"""One step of the many-objects benchmark (issue 38), in a process of its own:

    python _many_objects.py plan|stage URL DST

``plan``: the prefix listed and planned against DST (what stage() does before its first
GET); ``stage``: stage(URL, DST). Prints one JSON line: the peak of Python's traced
memory (tracemalloc, from before the step), the process's peak RSS and CPU seconds,
the files. The fastload imported is the one on PYTHONPATH (so an older checkout can be
measured the same way). The store's endpoint and keys come from the AWS variables.
"""

from __future__ import annotations

import json
import resource
import sys
import tracemalloc
from pathlib import Path


def main() -> None:
    step, url, dst = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    import fastload
    from fastload.staging.api import open_source
    from fastload.staging.request import StageRequest

    tracemalloc.start()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    if step == "plan":
        req = StageRequest.make()
        source, dest = open_source(url, dst, req)
        with dest.locked():
            files = len(source.plan(req, dest).files)  # type: ignore[attr-defined]
    else:
        files = fastload.stage(url, dst).files
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru.ru_utime + ru.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    print(json.dumps({"step": step, "files": files, "traced_peak": peak,
                      "maxrss_kib": ru.ru_maxrss, "cpu_s": cpu}))  # fmt: skip


if __name__ == "__main__":
    main()
