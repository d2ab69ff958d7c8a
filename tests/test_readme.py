"""Every ```python block of the README and of the user docs (docs/*.md but the map of
the code, DESIGN.md: every page there, those added later too) runs as written (in a
scratch directory holding the shards and index its examples name), or is listed here
with the reason it cannot run on this machine; and what a block promises (in its
comments and names) is checked after the statement that makes the promise. A block
added without either, or a block that runs with no check, fails this test."""

from __future__ import annotations

import ast
import json
import re
import types
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit.tools import require_module

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose examples a user runs: the README and the user docs, not the map.
# Pages whose blocks need a machine of their own (a small disk, a server) have a test of
# their own that runs every block, in order, on it.
OWN_RUNNER = {
    "on-full.md": "tests/env/test_on_full_doc.py (a 1 MiB tmpfs as the node-local disk)",
    "zip.md": "tests/staging/test_zip_doc.py (its blocks in order, making their own zips)",
    "read-while-staging.md": "tests/staging/test_read_while_staging_doc.py (its blocks in order)",
}
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md")
                         if p.name != "DESIGN.md" and p.name not in OWN_RUNNER)]  # fmt: skip

# Blocks that need a cluster's data or a remote store, by a phrase of theirs.
NEEDS_ELSEWHERE = {
    '"/network/datasets/imagenet/train"': "stages a dataset from Mila's /network",
    "ILSVRC2012_img_train.tar": "stages ImageNet's train tar",
    "s3://datasets/coco/": "an S3 bucket (tests/sources/test_s3.py covers s3:// staging)",
    'resolve("imagenet"': "the dataset registry on a cluster, and a download",
    "/network/scratch/me/shards": "a job's nodes (tests/staging/test_fanout.py runs three)",
    "s3://bucket/train-": "shards in a bucket (tests/cache/ reads them from loopback S3)",
    'fastload.to_device(loader, "cuda"': "a CUDA device (tests/gpu/test_gpu.py, where one is)",
    '"read_timeout": "300s"': "a slow S3 store (tests/sources/test_s3_silent.py: the limit)",
}


Namespace = dict[str, Any]


def _check_index_dataset(ns: Namespace) -> None:
    """``sample = ds[123]``: {"__key__": ..., "jpg": <read-only buffer>, "cls": ...}."""
    sample, ds = ns["sample"], ns["ds"]
    assert len(ds) == 1000 and sorted(sample) == ["__key__", "cls", "jpg"]
    assert sample["__key__"] == "s000123"
    jpg = memoryview(sample["jpg"])
    assert jpg.readonly and bytes(jpg) == bytes([123]) * (100 + 123 % 7)
    assert bytes(sample["cls"]) == b"3"


def _keys(batches: list[Any]) -> list[str]:
    return [s["__key__"] for b in batches for s in b]


def _check_steps_per_epoch(ns: Namespace) -> None:
    """``len(loader)`` is exact, and a batch is a list of at most 256 samples."""
    ds, loader = ns["ds"], ns["loader"]
    ds.set_epoch(5)
    batches = list(loader)
    assert len(batches) == ns["steps_per_epoch"]
    assert all(isinstance(b, list) and 0 < len(b) <= 256 for b in batches)
    assert sorted(_keys(batches)) == [f"s{i:06d}" for i in range(1000)]


def _check_resume(ns: Namespace) -> None:
    """``load_state_dict``: a loader restored from a checkpoint taken mid-epoch yields
    the samples not yet read, each once."""
    make_loader = type(ns["loader"])
    ds = fastload.ShardIterableDataset("train.fidx", seed=0, batch_size=256, num_workers=8)
    ds.set_epoch(3)
    first = make_loader(ds, batch_size=None, num_workers=8)
    it = iter(first)
    read = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    again = fastload.ShardIterableDataset("train.fidx", seed=0, batch_size=256, num_workers=8)
    again.set_epoch(3)
    restored = make_loader(again, batch_size=None, num_workers=8)
    restored.load_state_dict(state)
    rest = list(restored)
    assert rest and not set(_keys(read)) & set(_keys(rest))
    assert sorted(_keys(read) + _keys(rest)) == [f"s{i:06d}" for i in range(1000)]


def _check_packed_batches(ns: Namespace) -> None:
    """The last PackedBatch of the epoch: its keys, a zero-copy uint8 view of a jpg, the
    labels decoded to int64."""
    import torch

    batch, jpg, labels = ns["batch"], ns["jpg"], ns["labels"]
    assert len(batch) == 1000 % 256 == len(batch.keys)
    numbers = [int(k[1:]) for k in batch.keys]
    assert labels.dtype == torch.int64 and labels.tolist() == [n % 10 for n in numbers]
    assert jpg.dtype == torch.uint8
    assert bytes(jpg.numpy()) == bytes([numbers[0] % 256]) * (100 + numbers[0] % 7)


def _check_shard_writer(ns: Namespace) -> None:
    """``ShardWriter``: the index is written on close; the sample reads back."""
    ds = fastload.ShardIndexDataset("out/index.fidx")
    assert len(ds) == 1
    s = ds[0]
    assert s["__key__"] == "cat/0001" and bytes(s["jpg"]) == ns["jpeg_bytes"]
    assert bytes(s["cls"]) == b"3" and json.loads(bytes(s["meta"])) == {"w": 640}


def _check_pack_dataset(ns: Namespace) -> None:
    """``pack_dataset``: every (image, class) pair of the dataset, once, shuffled into
    shards under the fields named."""
    ds = fastload.ShardIndexDataset("out/index.fidx", fields=["png", "cls"])
    got = sorted((bytes(s["png"]), bytes(s["cls"])) for s in ds)
    want = sorted((png, b"%d" % cls) for png, cls in ns["torchvision_ds"])
    assert got == want


def _check_monitor(ns: Namespace) -> None:
    """``stats = loop.stats()``: the epoch counted, the trace written."""
    stats, loop = ns["stats"], ns["loop"]
    assert stats["data/samples"] == 1000 == stats["workers/samples"]
    assert 0 <= stats["data/wait_share"] <= 1
    loop.close()
    assert json.loads(Path("trace.json").read_text())["traceEvents"]


def _check_mix(ns: Namespace) -> None:
    """``fastload.Mix``: 7 web and 3 books samples in every batch, counted by stats()."""
    assert ns["counts"] == {"web": 700, "books": 300}
    assert sorted(ns["streams"]) == ["books"] * 3 + ["web"] * 7


def _check_gpu_handoff(ns: Namespace) -> None:
    """docs/gpu.md's loop: the last batch's payloads stayed on the host, its first view,
    labels and plain copy hold that batch's samples (sample ``i``: ``jpg`` is byte ``i %
    256`` repeated ``100 + i % 7`` times, ``cls`` is ``i % 10``)."""
    jpg, labels = ns["jpg"], ns["labels"]
    samples = jpg.tolist()
    assert len(samples) == len(labels) == 1000 % 256 and jpg.data.device.type == "cpu"
    assert bytes(ns["first"].numpy()) == samples[0]
    assert bytes(ns["raw"].cpu().numpy()) == b"".join(samples)
    for payload, label in zip(samples, labels.tolist(), strict=True):
        i = next(i for i in range(payload[0], 1000, 256) if len(payload) == 100 + i % 7
                 and label == i % 10)  # fmt: skip
        assert payload == bytes([i % 256]) * (100 + i % 7)


# What a block promises, checked after its top-level statement holding the phrase.
CHECKS: dict[str, Callable[[Namespace], None]] = {
    "sample = ds[123]": _check_index_dataset,
    "steps_per_epoch = len(loader)": _check_steps_per_epoch,
    "loader.load_state_dict(": _check_resume,
    "batch.to(device": _check_packed_batches,
    'fastload.ShardWriter("out"': _check_shard_writer,
    "fastload.pack_dataset(": _check_pack_dataset,
    "stats = loop.stats()": _check_monitor,
    "counts = mix.stats()": _check_mix,
    "raw = jpg.data.to(device, non_blocking=True)": _check_gpu_handoff,
}


def _blocks() -> list[tuple[str, int, str]]:
    """(page relative to the repository, line of the block's first line, code) of every
    python block of :data:`PAGES`."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = str(page.relative_to(ROOT))
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            out.append((name, text[: m.start()].count("\n") + 1, m.group(1)))
    return out


def _skip_reason(code: str) -> str | None:
    return next((why for phrase, why in NEEDS_ELSEWHERE.items() if phrase in code), None)


def _runnable() -> list[tuple[str, int, str]]:
    """The blocks that run here (the others are explained in NEEDS_ELSEWHERE)."""
    return [(page, line, code) for page, line, code in _blocks() if _skip_reason(code) is None]


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
@pytest.mark.parametrize("page, line, code", _runnable(),
                         ids=[f"{p}:{n}" for p, n, _ in _runnable()])  # fmt: skip
def test_readme_block_runs(
    page: str, line: int, code: str, scratch: Path, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    require_module("torch")
    work = tmp_path / "work"
    work.mkdir()
    (work / "shards").symlink_to(scratch / "shards")
    (work / "train.fidx").symlink_to(scratch / "train.fidx")
    monkeypatch.chdir(work)
    ns = _namespace()
    checked = []
    tree = ast.parse(code)
    ast.increment_lineno(tree, line)  # tracebacks name the page's own lines
    for stmt in tree.body:
        exec(compile(ast.Module([stmt], type_ignores=[]), page, "exec"), ns)
        text = ast.get_source_segment(code, _shifted(stmt, -line)) or ""
        for phrase, check in CHECKS.items():
            if phrase in text:
                check(ns)
                checked.append(phrase)
    assert checked, f"{page} line {line}: a block that runs has no check (CHECKS)"


def _shifted(stmt: ast.stmt, by: int) -> ast.stmt:
    """A copy of ``stmt``'s position moved by ``by`` lines (for get_source_segment)."""
    node = ast.stmt()
    node.lineno, node.end_lineno = stmt.lineno + by, (stmt.end_lineno or stmt.lineno) + by
    node.col_offset, node.end_col_offset = stmt.col_offset, stmt.end_col_offset
    return node


def test_every_block_is_run_or_explained() -> None:
    blocks = _blocks()
    assert len(blocks) >= 6
    assert {page for page, _, _ in blocks} >= {"README.md", "docs/reading.md"}
    ran = _runnable()
    # The reading and writing examples, at least, run here.
    assert len(ran) >= 4, ran
    # Every check still finds its statement in a block that runs.
    for phrase in CHECKS:
        assert any(phrase in code for _, _, code in ran), phrase
