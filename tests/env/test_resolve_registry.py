"""resolve() through the dataset registry and the configuration file: CIFAR-10 on Mila,
ImageNet's tar of tars, datasets a site's file adds."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from resolve_kit import clean_environ, env_vars, make_tar, tree_of

import fastload
from fastload.env import Environment, detect
from kit import trees

pytestmark = pytest.mark.native


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_environ(monkeypatch, tmp_path)


def mila_env(tmp_path: Path) -> Environment:
    """Mila as a site would simulate it: /network/datasets under a temporary root, given
    through the configuration file; the host name says Mila."""
    network = tmp_path / "network" / "datasets"
    network.mkdir(parents=True)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[environments.mila]\ndataset_roots = ["{network}"]\n', encoding="utf-8")
    environ = {
        "USER": "bob",
        "HOME": str(tmp_path / "home"),
        "FASTLOAD_CONFIG": str(cfg),
        "SLURM_JOB_ID": "1",
        "SLURM_TMPDIR": str(tmp_path / "slurm_tmpdir"),
        "SCRATCH": str(tmp_path / "scratch"),
    }
    env = detect(environ, "cn-b002.server.mila.quebec")
    assert env.name == "mila" and env.dataset_roots == (network,)
    return env


def test_registry_cifar10_on_mila(tmp_path: Path) -> None:
    env = mila_env(tmp_path)
    batches = env.dataset_roots[0] / "torchvision" / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    for name in ("data_batch_1", "test_batch", "batches.meta"):
        (batches / name).write_bytes(os.urandom(3000))
    root = fastload.resolve("cifar10", env=env)
    assert root == env.tmpdir / "cifar10"  # the torchvision root
    assert tree_of(root / "cifar-10-batches-py") == tree_of(batches)
    from fastload.env.datasets import datasets

    assert {"imagenet", "cifar10", "cifar100", "mnist", "fashionmnist"} <= set(datasets(env))


def test_registry_imagenet_tar_of_tars(tmp_path: Path) -> None:
    env = mila_env(tmp_path)
    inet = env.dataset_roots[0] / "imagenet"
    inner = {}
    for wnid in ("n01440764", "n01443537"):
        inner[f"{wnid}.tar"] = make_tar(
            tmp_path / "build" / f"{wnid}.tar",
            {f"{wnid}_{i}.JPEG": os.urandom(500 + i) for i in range(3)},
        )
    make_tar(inet / "ILSVRC2012_img_train.tar", inner)
    val = make_tar(inet / "ILSVRC2012_img_val.tar", {"ILSVRC2012_val_00000001.JPEG": b"v"})

    # The registry's checksum is the real archive's: this stand-in does not match it.
    with pytest.raises(fastload.ChecksumMismatchError):
        fastload.resolve("imagenet", split="train", env=env, destination=tmp_path / "bad")

    train = fastload.resolve("imagenet", split="train", env=env, checksum=False)
    assert train == env.tmpdir / "imagenet" / "train"
    assert sorted(p.name for p in train.iterdir()) == ["n01440764", "n01443537"]
    assert len(list((train / "n01440764").iterdir())) == 3
    assert fastload.resolve("imagenet", env=env, checksum=False) == train  # default split

    # No sorted copy of val here: the archive is copied as it is, for torchvision.
    got = fastload.resolve("imagenet", split="val", env=env, checksum=False)
    assert got == env.tmpdir / "imagenet" / "ILSVRC2012_img_val.tar"
    assert got.read_bytes() == val
    with pytest.raises(ValueError, match="has no split 'test'"):
        fastload.resolve("imagenet", split="test", env=env)


def test_config_adds_datasets(tmp_path: Path) -> None:
    src = tmp_path / "lab" / "speech"
    trees.build_small_files(src, 6)
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        textwrap.dedent(f"""
            [datasets.speech]
            description = "the lab's corpus"
            [[datasets.speech.sources]]
            path = "/missing/{{name}}"
            [[datasets.speech.sources]]
            path = "{src}"
            into = "audio"
        """),
        encoding="utf-8",
    )
    env = detect(env_vars(tmp_path, FASTLOAD_CONFIG=str(cfg)), "node1")
    assert fastload.resolve("speech", env=env) == env.tmpdir / "speech" / "audio"
    trees.assert_same_tree(src, env.tmpdir / "speech" / "audio")

    cfg.write_text("[datasets.broken]\nsources = [{ path = 'x', url = 'http://y' }]\n")
    env = detect(env_vars(tmp_path, FASTLOAD_CONFIG=str(cfg)), "node1")
    with pytest.raises(ValueError, match="either a path or a url"):
        fastload.resolve("broken", env=env)


def test_registry_file_ships_with_the_package() -> None:
    from importlib.resources import files

    text = files("fastload.env").joinpath("datasets.toml").read_text(encoding="utf-8")
    assert "[imagenet]" in text and "[cifar10]" in text


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------
