"""resolve() of a dataset larger than the node-local disk (issue 54): a real tmpfs of
1 MiB is the node's ``tmpdir``, the data 3-5 MiB. A tree is read in place, an archive
extracted once into the environment's cache, with a one-line warning saying why and what
it costs; ``on_full="error"`` (or FASTLOAD_ON_FULL, or the configuration) keeps the
error; a cache that is itself too small is an error naming both; data that fits is
staged as before. The S3 prefix and the four processes of one node are in
test_on_full_node.py.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from resolve_kit import clean_environ, env_vars, make_tar, sha256, tree_of

import fastload
import fastload.cli
from fastload.env import Environment, OnFullWarning, detect, placements
from kit import trees
from kit.trees import MiB

pytestmark = pytest.mark.native

SmallFs = Callable[..., Path]


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_environ(monkeypatch, tmp_path)


@pytest.fixture
def node(small_fs: SmallFs) -> Path:
    """The node-local disk: 1 MiB."""
    return small_fs("1m")


def _env(tmp_path: Path, node: Path, **extra: str) -> Environment:
    return detect(env_vars(tmp_path, FASTLOAD_TMPDIR=str(node), **extra), "node1")


def _tree(root: Path, mib: int = 3) -> Path:
    for i in range(mib):
        (root / f"part{i}").mkdir(parents=True)
        trees.write_patterned(root / f"part{i}" / "data.bin", MiB, seed=i)
    (root / "labels.txt").write_text("a\nb\n")
    return root


def _only_warning(record: pytest.WarningsRecorder) -> str:
    texts = [str(w.message) for w in record if issubclass(w.category, OnFullWarning)]
    assert len(texts) == 1, texts
    assert "\n" not in texts[0], "the warning is one line"
    return texts[0]


def _fastload_files(node: Path) -> list[str]:
    return sorted(p.name for p in node.iterdir())


# --------------------------------------------------------------------------------------
# Each behaviour
# --------------------------------------------------------------------------------------


def test_a_tree_too_big_is_read_in_place(tmp_path: Path, node: Path) -> None:
    src = _tree(tmp_path / "shared" / "bigds")
    env = _env(tmp_path, node)
    with pytest.warns(OnFullWarning) as record:
        got = fastload.resolve(src, env=env)
    assert got == src
    text = _only_warning(record)
    assert text.startswith(f"fastload: 'bigds' ({src}) needs 3.0 MiB and the node-local disk "
                           f"at '{node}' has ")  # fmt: skip
    assert f"reading it in place from '{src}' (every epoch reads the shared file system" in text
    assert text.endswith("on_full='error' (FASTLOAD_ON_FULL=error) fails instead")
    # Decided before the first byte (stage()'s own check of the room, from its walk):
    # beside the decision's lock and record, nothing was written (the stage that found no
    # room made nothing, and took its lock away).
    assert _fastload_files(node) == [".bigds.fastload-where.json", ".bigds.where.fastload.lock"]
    (place,) = placements(node)
    assert (place.where, place.kind, place.path, place.decided_by.split()[1]) == (
        "in_place", "tree", str(src), str(os.getpid()))
    assert place.needed >= 3 * MiB > place.free

    # Asked again: the recorded decision is followed, with the same warning.
    with pytest.warns(OnFullWarning) as again:
        assert fastload.resolve(src, env=env) == src
    assert _only_warning(again) == text
    assert placements(node)[0].followed == 1


def test_an_archive_too_big_is_extracted_once_into_the_cache(
    tmp_path: Path, node: Path, small_fs: SmallFs
) -> None:
    members = {f"d/f{i}.bin": os.urandom(MiB) for i in range(4)}
    archive = tmp_path / "shared" / "bigds.tar"
    data = make_tar(archive, members)
    env = _env(tmp_path, node)
    with pytest.warns(OnFullWarning) as record:
        got = fastload.resolve(archive, checksum=sha256(data), env=env)
    assert env.cache in got.parents and got.name == "bigds"
    assert tree_of(got) == members
    text = _only_warning(record)
    assert f"needs 4.0 MiB and the node-local disk at '{node}' has " in text
    assert f"extracting it once into the cache '{got}' instead (kept for later jobs" in text
    assert not (node / "bigds").exists()

    # A later job (another node-local disk) finds it in the cache: nothing extracted again.
    before = {p: p.stat().st_mtime_ns for p in got.rglob("*")}
    with pytest.warns(OnFullWarning):
        again = fastload.resolve(archive, env=_env(tmp_path, small_fs("1m")))
    assert again == got
    assert {p: p.stat().st_mtime_ns for p in got.rglob("*")} == before


def test_a_tar_named_zip_is_measured_as_the_tar_stage_extracts(
    tmp_path: Path, node: Path
) -> None:
    """A tar (GNU tar's) named ``.zip``: stage() extracts it as a tar (its content says
    so), and resolve() measures it as one (it measured it as a zip: ZipFormatError)."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(3):
        trees.write_patterned(src / "d" / f"f{i}.bin", MiB, seed=i)
    archive = tmp_path / "shared" / "bigds.zip"
    archive.parent.mkdir(parents=True)
    subprocess.run(["tar", "-cf", str(archive), "-C", str(src), "d"], check=True)
    with pytest.warns(OnFullWarning):
        got = fastload.resolve(archive, env=_env(tmp_path, node))
    trees.assert_same_tree(src, got, mtimes=False)  # (a ustar keeps whole seconds)
    (place,) = placements(node)
    assert (place.where, place.kind) == ("cache", "archive")
    assert place.needed >= 3 * MiB


def test_a_gzip_is_measured_by_what_it_extracts_to(tmp_path: Path, node: Path) -> None:
    """A .tar.gz of 5 MiB of zeros is a few KiB: its trailer says 5 MiB, so it goes to
    the cache before a byte lands on the 1 MiB disk (no ENOSPC halfway)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(5):
            info = tarfile.TarInfo(f"z{i}.bin")
            info.size = MiB
            tf.addfile(info, io.BytesIO(bytes(MiB)))
    archive = tmp_path / "shared" / "zeros.tar.gz"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(gzip.compress(buf.getvalue()))
    assert archive.stat().st_size < 64 * 1024
    with pytest.warns(OnFullWarning):
        got = fastload.resolve(archive, env=_env(tmp_path, node))
    assert sorted(p.name for p in got.iterdir()) == [f"z{i}.bin" for i in range(5)]
    (place,) = placements(node)
    assert (place.where, place.kind) == ("cache", "archive")
    assert place.needed >= 5 * MiB


def test_on_full_error_keeps_the_error(tmp_path: Path, node: Path) -> None:
    src = _tree(tmp_path / "shared" / "bigds")
    env = _env(tmp_path, node)
    today = rf"not enough space to stage into '{node}/bigds': need 3\.0 MiB"
    with pytest.raises(fastload.NotEnoughSpaceError, match=today):
        fastload.resolve(src, env=env, on_full="error")
    assert not (node / ".bigds.fastload-where.json").exists()


@pytest.mark.parametrize("where", ["variable", "config"])
def test_on_full_error_from_the_variable_or_the_config(
    tmp_path: Path, node: Path, where: str
) -> None:
    src = _tree(tmp_path / "shared" / "bigds")
    if where == "variable":
        env = _env(tmp_path, node, FASTLOAD_ON_FULL="error")
    else:
        config = tmp_path / "config.toml"
        config.write_text('[environments.local]\non_full = "error"\n')
        env = _env(tmp_path, node, FASTLOAD_CONFIG=str(config))
    assert env.on_full == "error"
    with pytest.raises(fastload.NotEnoughSpaceError):
        fastload.resolve(src, env=env)
    # The argument wins over the environment's setting.
    with pytest.warns(OnFullWarning):
        assert fastload.resolve(src, env=env, on_full="fallback") == src


def test_a_bad_on_full_is_refused(tmp_path: Path, node: Path) -> None:
    with pytest.raises(ValueError, match="FASTLOAD_ON_FULL must be 'fallback' or 'error'"):
        _env(tmp_path, node, FASTLOAD_ON_FULL="ignore")
    config = tmp_path / "config.toml"
    config.write_text('[paths]\non_full = "maybe"\n')
    with pytest.raises(ValueError, match=r"\[paths\] on_full must be"):
        _env(tmp_path, node, FASTLOAD_CONFIG=str(config))
    with pytest.raises(ValueError, match="on_full must be 'fallback' or 'error', not 'x'"):
        fastload.resolve(tmp_path, env=_env(tmp_path, node), on_full="x")  # type: ignore[arg-type]


def test_data_that_fits_is_staged_as_before(tmp_path: Path, node: Path) -> None:
    src = tmp_path / "shared" / "small"
    src.mkdir(parents=True)
    trees.write_patterned(src / "a.bin", 200 * 1024, seed=3)
    env = _env(tmp_path, node)
    got = fastload.resolve(src, env=env)  # no warning (warnings are errors here)
    assert got == node / "small"
    trees.assert_same_tree(src, got, mtimes=False)  # (a ustar keeps whole seconds)
    (place,) = placements(node)
    assert (place.where, place.path) == ("local", str(node / "small"))


def test_a_staged_copy_counts_as_room(tmp_path: Path, small_fs: SmallFs) -> None:
    """3 MiB staged on a 4 MiB disk: asked again, it fits (what is there is not needed
    twice), even after the record is gone."""
    node = small_fs("4m")
    src = _tree(tmp_path / "shared" / "ds")
    env = _env(tmp_path, node)
    assert fastload.resolve(src, env=env) == node / "ds"
    (node / ".ds.fastload-where.json").unlink()
    assert fastload.resolve(src, env=env) == node / "ds"
    assert placements(node)[0].where == "local"


def test_a_cache_too_small_names_both(tmp_path: Path, node: Path, small_fs: SmallFs) -> None:
    cache = small_fs("2m")
    members = {f"f{i}.bin": os.urandom(MiB) for i in range(3)}
    archive = tmp_path / "shared" / "bigds.tar"
    make_tar(archive, members)
    env = _env(tmp_path, node, FASTLOAD_CACHE=str(cache))
    with pytest.raises(fastload.NotEnoughSpaceError) as e:
        fastload.resolve(archive, env=env)
    text = str(e.value)
    assert f"not enough space for 'bigds' ({archive}) (3.0 MiB" in text
    assert f"the node-local disk at '{node}' has " in text
    assert f"the cache '{cache}/staged/" in text and "FASTLOAD_CACHE" in text
    assert e.value.filename.startswith(str(cache)) and e.value.needed > e.value.free
    assert _fastload_files(cache) == [], "nothing written into the cache"


def test_a_registry_layout_in_place(tmp_path: Path, node: Path) -> None:
    """A registry entry whose source lands ``into`` a folder and ``returns`` the root
    above it (torchvision's layout): read in place, the root above the source."""
    root = tmp_path / "datasets" / "torchvision"
    _tree(root / "cifar-10-batches-py")
    config = tmp_path / "config.toml"
    config.write_text(
        '[datasets.mycifar]\nreturns = ""\n'
        '[[datasets.mycifar.sources]]\npath = "torchvision/cifar-10-batches-py"\n'
        'into = "cifar-10-batches-py"\n'
    )
    env = _env(tmp_path, node, FASTLOAD_CONFIG=str(config))
    with pytest.warns(OnFullWarning):
        assert fastload.resolve("mycifar", env=env) == root


def test_fastload_env_says_where_and_why(
    tmp_path: Path, node: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tree(tmp_path / "shared" / "bigds")
    for k, v in env_vars(tmp_path, FASTLOAD_TMPDIR=str(node)).items():
        monkeypatch.setenv(k, v)
    with pytest.warns(OnFullWarning):
        fastload.resolve(src)
    assert fastload.cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "on full        fallback   [default]" in out
    assert (f"placed         {node}/bigds -> {src}  (read in place: 3.0 MiB needed"
            in out), out  # fmt: skip
    assert fastload.cli.main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["on_full"] == "fallback"
    (place,) = report["placements"]
    assert place["where"] == "in_place" and "reading it in place" in place["why"]


def test_a_source_grown_past_the_disk_falls_back(tmp_path: Path, node: Path) -> None:
    """Staged once (the record says "local"), then the source grows past the disk: the
    next call follows the record into stage(), whose space check (before its first byte)
    finds too little room; the fallback is decided then, and recorded."""
    src = tmp_path / "shared" / "ds"
    src.mkdir(parents=True)
    trees.write_patterned(src / "a.bin", 100 * 1024, seed=1)
    env = _env(tmp_path, node)
    assert fastload.resolve(src, env=env) == node / "ds"
    _tree(src)
    with pytest.warns(OnFullWarning, match="reading it in place") as record:
        assert fastload.resolve(src, env=env) == src
    (place,) = placements(node)
    assert (place.where, place.followed) == ("in_place", 0)
    assert place.why == _only_warning(record)
    with pytest.warns(OnFullWarning):  # the record followed from now on
        assert fastload.resolve(src, env=env) == src
    assert placements(node)[0].followed == 1


def test_measured_before_the_stage_when_asked(tmp_path: Path, node: Path) -> None:
    """choose(measure=True) (a caller whose stage would not raise before it returns)
    sizes a tree itself, with the same answer stage()'s check gives."""
    from fastload.env.placement import choose

    src = _tree(tmp_path / "shared" / "bigds")
    target = node / "bigds"
    place, decided = choose(str(src), target, tmp_path / "cache" / "bigds", label="'bigds'",
                            measure=True)  # fmt: skip
    assert decided and (place.where, place.kind, place.path) == ("in_place", "tree", str(src))
    assert place.needed == 3 * MiB + 4096 and "reading it in place" in place.why
    assert _fastload_files(node) == [".bigds.fastload-where.json", ".bigds.where.fastload.lock"]
    again, decided = choose(str(src), target, tmp_path / "cache" / "bigds", label="'bigds'")
    assert not decided and again == dataclasses.replace(place, followed=1)
