"""Every ```python block of the README runs as written (in a scratch directory holding the
shards and index its examples name), or is listed here with the reason it cannot run on
this machine. A block added to the README without either fails this test."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest

import fastload

README = Path(__file__).resolve().parents[1] / "README.md"

# Blocks that need a cluster's data or a remote store, by a phrase of theirs.
NEEDS_ELSEWHERE = {
    '"/network/datasets/imagenet/train"': "stages a dataset from Mila's /network",
    "ILSVRC2012_img_train.tar": "stages ImageNet's train tar",
    "s3://datasets/coco/": "an S3 bucket (tests/sources/test_s3.py covers s3:// staging)",
    'resolve("imagenet"': "the dataset registry on a cluster, and a download",
    "/network/scratch/me/shards": "a job's nodes (tests/staging/test_fanout.py runs three)",
    "s3://bucket/train-": "shards in a bucket (tests/cache/ reads them from loopback S3)",
}


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        out.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return out


def _skip_reason(code: str) -> str | None:
    return next((why for phrase, why in NEEDS_ELSEWHERE.items() if phrase in code), None)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``shards/train-{000000..000999}.tar`` (a sample each, fields jpg and cls) and
    ``train.fidx`` over them, as the README's examples expect."""
    root = tmp_path_factory.mktemp("readme")
    samples = (
        {"__key__": f"s{i:06d}", "jpg": bytes([i % 256]) * (100 + i % 7), "cls": i % 10}
        for i in range(1000)
    )
    fastload.pack(samples, root / "shards", pattern="train-{:06d}.tar", max_count=1,
                  index=None)  # fmt: skip
    fastload.ShardIndex.build(str(root / "shards/train-{000000..000999}.tar"), root / "train.fidx")
    return root


def _namespace() -> dict[str, Any]:
    """The names the README leaves to the reader."""
    try:
        import PIL.Image as image

        pil: Any = types.SimpleNamespace(Image=image)
    except ImportError:  # pillow is not a test dependency: a stand-in type
        pil = types.SimpleNamespace(Image=types.SimpleNamespace(Image=type("Image", (), {})))
    return {
        "fastload": fastload,
        "start_epoch": 0,
        "epochs": 2,
        "checkpoint": {},
        "device": "cpu",
        "jpeg_bytes": b"\xff\xd8\xff\xe0 not really a jpeg",
        "PIL": pil,
        "to_png_bytes": lambda image: b"png",
        "torchvision_ds": [(bytes([i]) * 10, i % 3) for i in range(50)],
        "dst": "unused",
    }


# The README's examples ask for 8 DataLoader workers (this machine may have fewer cores)
# and pinned memory (it may have no GPU); torchdata calls a torch API torch deprecated.
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("line, code", _blocks(), ids=[f"line{n}" for n, _ in _blocks()])
def test_readme_block_runs(
    line: int, code: str, scratch: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    reason = _skip_reason(code)
    if reason is not None:
        pytest.skip(f"README line {line}: {reason}")
    pytest.importorskip("torch")
    work = tmp_path / "work"
    work.mkdir()
    (work / "shards").symlink_to(scratch / "shards")
    (work / "train.fidx").symlink_to(scratch / "train.fidx")
    monkeypatch.chdir(work)
    exec(compile(code, f"README.md:{line}", "exec"), _namespace())


def test_every_block_is_run_or_explained() -> None:
    blocks = _blocks()
    assert len(blocks) >= 6
    ran = [line for line, code in blocks if _skip_reason(code) is None]
    # The reading and writing examples, at least, run here.
    assert len(ran) >= 4, ran
