"""webdataset reading ``s3://`` shards through fsspec (s3fs), for test_bench_remote.py.

    VENV-s3fs/bin/python benchmarks/_wds_s3fs.py ENDPOINT

Runs in the s3fs venv (scripts/bench-peers.sh: s3fs pins an aiobotocore that clashes
with the benchmark venv's boto3), which also has webdataset and the same torch. Imports
nothing of the benchmarks. Prints ``ready`` once s3fs, webdataset and torch are
imported, else ``missing NAME`` and exits; then serves one JSON request per line on
stdin, answering one line each:

  {"op": "epoch", "urls": [...], "batch": B, "workers": W, "seed": S}
      one shuffled epoch through DataLoader(num_workers=W, fork, batch_size=B):
      ``ok COUNT UNIQUE`` (samples and distinct keys)
  {"op": "first", ...the same}
      the dataset and loader made and the first batch taken: ``ok COUNT COUNT``

An error answers ``error ...``. webdataset 1.0.2's gopen has no ``s3`` scheme; the
handler registered here opens the URL with ``fsspec.open`` (s3fs, its default
read-ahead cache and block size), which is how webdataset's documentation says to read
through fsspec. The endpoint is given to s3fs as ``client_kwargs``; the credentials come
from the environment.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(endpoint: str) -> int:
    try:
        import multiprocessing

        import fsspec
        import s3fs  # noqa: F401  (registers the s3 protocol with fsspec)
        import webdataset as wds
        from torch.utils.data import DataLoader
    except ImportError as e:
        print(f"missing {e.name}", flush=True)
        return 0
    storage = {"client_kwargs": {"endpoint_url": endpoint}}

    def gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        return fsspec.open(url, mode, **storage).open()

    wds.gopen_schemes["s3"] = gopen_s3

    def as_list(batch: list[Any]) -> list[Any]:
        return batch

    def loader(req: dict[str, Any]) -> Any:
        urls = req["urls"]
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=req["seed"],
                            nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                            empty_check=False).shuffle(1000)  # fmt: skip
        return DataLoader(ds, batch_size=req["batch"], num_workers=req["workers"],
                          collate_fn=as_list,
                          multiprocessing_context=multiprocessing.get_context("fork"))  # fmt: skip

    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "first":
                it = iter(loader(req))
                n = len(next(it))
                del it  # shuts the workers down
                print(f"ok {n} {n}", flush=True)
                continue
            keys = [s["__key__"] for batch in loader(req) for s in batch]
            print(f"ok {len(keys)} {len(set(keys))}", flush=True)
        except Exception as e:
            print("error " + repr(e).replace("\n", " "), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
