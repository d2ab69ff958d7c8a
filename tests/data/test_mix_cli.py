"""``fastload mix plan FILE.toml``: the plan it prints (text and JSON) is what a Mix of
the file reads, per stream, rank and worker; bad files are errors naming the file."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kit.tools import require_module

torch = require_module("torch")

import fastload  # noqa: E402
from fastload.cli import main  # noqa: E402
from fastload.data import partition  # noqa: E402
from kit.procs import child_env  # noqa: E402

pytestmark = pytest.mark.native

MIX = """
seed = 3
samples_per_epoch = 100
world_size = 2
num_workers = 3
shuffle_block = 8

[[streams]]
name = "web"
source = "web/index.fidx"
proportion = 0.7

[[streams]]
name = "code"
source = "code/index.fidx"
proportion = 0.3
"""


@pytest.fixture
def mixfile(tmp_path: Path) -> Path:
    for name, n in (("web", 50), ("code", 20)):
        w = fastload.ShardWriter(tmp_path / name, max_count=15)
        for i in range(n):
            w.write({"__key__": f"{name}/{i:04d}", "txt": f"sample {i}"})
        w.close()
    path = tmp_path / "mix.toml"
    path.write_text(MIX)
    return path


def test_plan_matches_what_the_mix_reads(mixfile: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:  # fmt: skip
    assert main(["mix", "plan", str(mixfile), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["streams"] == {"web": 70, "code": 30}
    # the epoch one reader reads, padded and cut among 2 ranks x 3 workers
    root = mixfile.parent
    whole = list(fastload.Mix([fastload.Stream(root / "web/index.fidx", proportion=0.7,
                                               name="web"),
                               fastload.Stream(root / "code/index.fidx", proportion=0.3,
                                               name="code")],
                              seed=3, samples_per_epoch=100, shuffle_block=8))  # fmt: skip
    share = partition.share(100, 6, False)
    padded = (whole * 2)[: 6 * share]
    for rank in range(2):
        for worker in range(3):
            c = rank * 3 + worker
            got = collections.Counter(s["__stream__"] for s in padded[c * share : (c + 1) * share])
            assert plan["ranks"][rank]["workers"][worker] == {"web": got["web"],
                                                              "code": got["code"]}  # fmt: skip
        assert sum(sum(w.values()) for w in plan["ranks"][rank]["workers"]) == 3 * share
    # the text, from the command line in a process of its own
    out = subprocess.run([sys.executable, "-m", "fastload", "mix", "plan", str(mixfile),
                          "--num-workers", "2"], env=child_env(), capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert "epoch 0: 100 samples (mixed), 2 ranks x 2 readers each" in out
    assert "web" in out and "70.0%" in out and "  worker 1: web " in out


def test_bad_files(mixfile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = mixfile.with_name("bad.toml")
    bad.write_text(MIX.replace("seed = 3", "sed = 3"))
    assert main(["mix", "plan", str(bad)]) == 1
    assert f"{bad}: unknown key 'sed'" in capsys.readouterr().err
    bad.write_text(MIX.replace('proportion = 0.3', 'choose = 4'))
    assert main(["mix", "plan", str(bad)]) == 1
    assert "proportion is given for some streams only" in capsys.readouterr().err
    bad.write_text(MIX.replace('source = "code/index.fidx"', 'source = "nope/index.fidx"'))
    assert main(["mix", "plan", str(bad)]) == 1
    assert "nope/index.fidx" in capsys.readouterr().err
