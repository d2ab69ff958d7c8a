"""docs/cluster.md's "On a SLURM cluster" scripts, run as written under real sbatch: the
paths point into the test cluster's shared folder, ``fastload`` is this interpreter's
``-m fastload``, ``train.py`` is slurm_task.py's ``iterate`` and the shards are small."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from test_slurm_data import make_samples

import fastload
from fastload import ShardIndex
from kit.slurm import NODES, TASK, Cluster

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"


def scripts() -> list[str]:
    text = PAGE.read_text()
    section = text[text.index("## On a SLURM cluster") :]
    section = section[: section.index("\n## ")]
    return re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)


def test_readme_pack_and_train_scripts(slurm: Cluster, tmp_path: Path) -> None:
    pack, train = scripts()
    shared = slurm.root / "shared" / tmp_path.name
    make_samples(shared / "raw")

    def adapt(script: str) -> str:
        script = script.replace("/network/scratch/me", str(shared))
        script = re.sub(r"(?m)(^|\s)fastload (pack|stage) ",
                        rf"\1{slurm.python} -m fastload \2 --no-progress ", script)  # fmt: skip
        script = script.replace("python train.py", f"{slurm.python} {TASK} iterate")
        assert "fastload " not in script.replace("-m fastload ", "")
        return script.replace("--seed 7 ", "--seed 7 --max-count 10 ")  # 12 shards

    job, code = slurm.sbatch(adapt(pack), "-o", str(shared / "pack-%a.txt"))
    assert code == 0, [p.read_text() for p in shared.glob("pack-*.txt")]
    for i in range(4):  # the array's four tasks, each its own part
        assert f"task {i} of 4" in (shared / f"pack-{i}.txt").read_text()
    slurm.run([slurm.python, "-m", "fastload", "index", str(shared / "shards")])
    keys = ShardIndex.open(shared / "shards" / "index.fidx").keys()
    # What one process writes with the same seed, shard for shard, byte for byte.
    one = fastload.pack(shared / "raw", shared / "one", shuffle=True, seed=7, max_count=10,
                        progress=False)  # fmt: skip
    assert one.index is not None and ShardIndex.open(one.index).keys() == keys
    assert sorted(p.name for p in (shared / "shards").glob("*.tar")) == sorted(
        p.name for p in one.shards
    )
    for p in one.shards:
        assert (shared / "shards" / p.name).read_bytes() == p.read_bytes(), p.name

    job, code = slurm.sbatch(adapt(train), "-o", str(shared / "train.txt"))
    out = (shared / "train.txt").read_text()
    assert code == 0, out
    tasks = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert sorted(t["rank"] for t in tasks) == list(range(6))
    assert Counter(t["nodename"] for t in tasks) == dict.fromkeys(NODES, 2)
    for t in tasks:  # each read the copy in its own node's SLURM_TMPDIR
        assert t["slurm_tmpdir"] == str(slurm.local(t["nodename"], job))
    # torch.distributed is not initialised: the ranks are SLURM_PROCID of SLURM_NTASKS,
    # each read by two DataLoader workers; every sample once, 120 / 6 to each rank.
    assert all(t["source"] == "slurm" and t["world_size"] == 6 for t in tasks)
    seen = Counter(k for t in tasks for k in t["keys"])
    assert set(seen) == set(keys) and set(seen.values()) == {1}
    assert [len(t["keys"]) for t in tasks] == [20] * 6
