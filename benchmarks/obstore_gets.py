"""Small GETs through obstore alone, no fastload code (issue 33: what the object store's
binding costs per object, the floor under SmallGets): the same objects fetched with
If-Match (the listed ETag) and their bodies taken, ``--workers`` at a time, three ways,
rounds interleaved:

- ``asyncio``: ``await get_async(...)`` then ``await bytes_async()`` on one event loop
  (what SmallGets does), the loop thread's CPU time per object shown too;
- ``threads``: ``get(...).bytes()``, obstore's blocking calls, on ``--workers`` threads;
- ``threads16``: the same on 16 threads.

Per way: the process's CPU per object (getrusage: every thread, obstore's runtime
included), the wall time, and a probe thread's mean lateness waking every millisecond
(how long others held the GIL).

    python benchmarks/obstore_gets.py --out O [--objects 2000] [--kb 100] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from objs_ab import parse_args, served  # benchmarks/ is on the path: this script's folder


def _probe(stop: threading.Event, out: list[list[float]]) -> None:
    late: list[float] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(0.001)
        late.append(time.perf_counter() - t0 - 0.001)
    out.append(late)


def main() -> None:
    a = parse_args(__doc__)
    import obstore as ob
    from obstore.store import S3Store

    with served(a) as (server, mod):
        store = S3Store("bench", endpoint=server.endpoint, access_key_id=mod.KEY_ID,
                        secret_access_key=mod.SECRET, region="us-east-1",
                        client_options={"allow_http": True})  # fmt: skip
        etags = {m["path"]: m["e_tag"] for page in ob.list(store, "small/") for m in page}
        keys = sorted(etags)

        def by_asyncio() -> int:
            got = [0]
            loop_cpu = [0.0]

            async def run() -> None:
                it = iter(keys)

                async def worker() -> None:
                    for k in it:
                        r = await ob.get_async(store, k, options={"if_match": etags[k]})
                        n = len(await r.bytes_async())
                        got[0] += n

                await asyncio.gather(*(worker() for _ in range(a.workers)))

            def thread() -> None:
                t0 = time.thread_time()
                asyncio.run(run())
                loop_cpu[0] = time.thread_time() - t0

            t = threading.Thread(target=thread)
            t.start()
            t.join()
            print(f"    (the loop thread: {loop_cpu[0] / len(keys) * 1e6:.1f} us/object)")
            return got[0]

        def by_threads(n: int) -> Callable[[], int]:
            def one(k: str) -> int:
                return len(ob.get(store, k, options={"if_match": etags[k]}).bytes())

            def run() -> int:
                with ThreadPoolExecutor(n) as pool:
                    return sum(pool.map(one, keys))

            return run

        ways: dict[str, Callable[[], int]] = {"asyncio": by_asyncio,
                                              "threads": by_threads(a.workers),
                                              "threads16": by_threads(16)}  # fmt: skip
        rows: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
        total: Any = None
        for r in range(a.rounds):
            for name, way in ways.items():
                stop, out = threading.Event(), []
                probe = threading.Thread(target=_probe, args=(stop, out))
                probe.start()
                u0 = resource.getrusage(resource.RUSAGE_SELF)
                w0 = time.perf_counter()
                got = way()
                wall = time.perf_counter() - w0
                u1 = resource.getrusage(resource.RUSAGE_SELF)
                stop.set()
                probe.join()
                total = got if total is None else total
                assert got == total, (name, got, total)
                cpu = u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime
                late = sum(out[0]) / len(out[0])
                rows[name].append((cpu / len(keys) * 1e6, wall, late * 1e3))
                print(f"round {r + 1} {name}: {rows[name][-1][0]:.1f} us/object, "
                      f"{wall:.3f} s, probe late {late * 1e3:.3f} ms", flush=True)
        print(f"\n{len(keys)} objects, {a.workers} in flight, {a.rounds} rounds: medians")
        print("| way | process CPU us/object | wall s | GIL probe late ms |")
        print("|---|---|---|---|")
        for name, rs in rows.items():
            med = [sorted(x)[len(x) // 2] for x in zip(*rs, strict=True)]
            print(f"| {name} | {med[0]:.1f} | {med[1]:.3f} | {med[2]:.3f} |")


if __name__ == "__main__":
    main()
