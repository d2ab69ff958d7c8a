"""The chunk digest of the native module: fed in pieces, it is the digest of the whole."""

from __future__ import annotations

import random

from fastload import _core


def test_fl64_stream_any_split_is_the_whole() -> None:
    rng = random.Random(4)
    data = rng.randbytes(300_001)
    for seed in (0, 7):
        whole = _core.fl64(data, seed)
        for _ in range(20):
            cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(0, 12)))
            stream = _core.Fl64Stream(seed)
            for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
                stream.update(memoryview(data)[a:b])
            assert stream.digest() == whole
    empty = _core.Fl64Stream()
    assert empty.digest() == _core.fl64(b"")
