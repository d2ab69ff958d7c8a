"""Real buckets and real users (issue 37): what the AWS console, s3fs and rclone leave in a
bucket (folder markers, zero-byte objects, a key that is also a prefix, keys with odd
characters), and the storage_options names people type (fastload's, obstore's, s3fs's,
boto3's), against a real S3 server (SeaweedFS) on loopback that checks signatures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from s3server import KEY_ID, SECRET, S3Server, put_each, tree_of, upload

import fastload
from fastload.sources.settings import normalize_s3_options

pytestmark = pytest.mark.slow

FILES = {"a.txt": b"alpha", "d/b.bin": b"\x01" * 3000}


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch, bucket: str) -> str:
    """The bucket, with no credentials nor endpoint in the environment."""
    for k in list(os.environ):
        if k.startswith("AWS_") and k != "AWS_EC2_METADATA_DISABLED":
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    return bucket


@pytest.mark.parametrize(
    "names",
    [
        {"access_key_id": KEY_ID, "secret_access_key": SECRET, "endpoint_url": "{ep}"},
        {"aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET, "endpoint_url": "{ep}"},
        {"key": KEY_ID, "secret": SECRET, "client_kwargs": {"endpoint_url": "{ep}"}},
        {"aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET,
         "endpoint_url": "{ep}", "region_name": "us-east-1"},
        {"key": KEY_ID, "secret": SECRET, "endpoint": "{ep}", "region": "us-east-1"},
    ],
    ids=["fastload", "obstore", "s3fs", "boto3", "mixed"],
)
@pytest.mark.parametrize("env", [False, True], ids=["bare-env", "aws-env"])
def test_each_name_set_works(
    s3: S3Server, no_aws_env: str, proxy: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, names: dict[str, Any], env: bool,
) -> None:  # fmt: skip
    bucket = no_aws_env
    upload(s3, bucket, {f"p/{k}": v for k, v in FILES.items()})
    if env:  # the credential chain finds the same keys: the user's values win, no clash
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    opts = {k: ({"endpoint_url": proxy.endpoint} if isinstance(v, dict)
                else v.replace("{ep}", proxy.endpoint)) for k, v in names.items()}  # fmt: skip
    r = fastload.stage(f"s3://{bucket}/p/", tmp_path / "out", storage_options=opts)
    assert r.files == len(FILES) and tree_of(tmp_path / "out") == FILES


def test_wrong_secret_is_refused_by_the_server(
    s3: S3Server, no_aws_env: str, proxy: Any, tmp_path: Path
) -> None:
    bucket = no_aws_env
    upload(s3, bucket, {"p/a.txt": b"a"})
    bad = {"key": KEY_ID, "secret": "not-the-secret", "endpoint_url": proxy.endpoint}
    with pytest.raises(PermissionError, match="access denied") as e:
        fastload.stage(f"s3://{bucket}/p/", tmp_path / "out", storage_options=bad)
    assert "not-the-secret" not in str(e.value)


@pytest.mark.parametrize(
    ("opts", "says"),
    [
        ({"typo_option": 1}, "unknown storage option 'typo_option'"),
        ({"secret_acess_key": "x"}, "did you mean 'secret_access_key'"),
        ({"key": "A", "aws_access_key_id": "B"}, "'key' and 'aws_access_key_id'"),
        ({"anon": "maybe"}, "must be true or false"),
        ({"secret": 5}, "must be a string, not ****"),
        ({"client_kwargs": {"verify": False}}, "client_kwargs.verify"),
    ],
)
def test_bad_options_are_one_line_naming_the_key(opts: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as e:
        normalize_s3_options(opts, "storage_options")
    text = str(e.value)
    assert says in text and "\n" not in text


def test_same_value_under_two_names_is_accepted() -> None:
    got = normalize_s3_options(
        {"key": "A", "aws_access_key_id": "A", "anon": "false", "region_name": "r"}, "here"
    )
    assert got == {"access_key_id": "A", "anonymous": False, "region": "r"}


def test_secrets_never_appear_in_messages(s3: S3Server, no_aws_env: str, tmp_path: Path) -> None:
    secret = "SuperSecretValue123"
    for opts in (
        {"secret": secret, "aws_secret_access_key": secret + "x", "key": "k"},
        {"secret_access_key": secret, "key": "k", "endpoint_url": "127.0.0.1:1"},
    ):
        with pytest.raises(ValueError) as e:
            fastload.stage(f"s3://{no_aws_env}/p/", tmp_path / "o", storage_options=opts)
        assert secret not in str(e.value)


def test_folder_markers_and_empty_objects(
    s3: S3Server, bucket: str, proxy: Any, tmp_path: Path
) -> None:
    client = s3.client()
    upload(s3, bucket, {"p/a.txt": b"a", "p/full/x.txt": b"x"})
    for key in ("p/empty/", "p/full/", "p/zero.bin"):  # the console's "Create folder"
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    proxy.reset_counts()
    out = tmp_path / "out"
    r = fastload.stage(f"s3://{bucket}/p/", out)
    assert (out / "empty").is_dir() and not any((out / "empty").iterdir())
    assert (out / "full" / "x.txt").read_bytes() == b"x"
    assert (out / "zero.bin").is_file() and (out / "zero.bin").stat().st_size == 0
    assert r.files == 3  # a.txt, full/x.txt, zero.bin
    assert proxy.gets() == 2  # the two objects with bytes; no GET of a marker or of zero.bin
    assert fastload.verify(out).ok
    assert fastload.stage(f"s3://{bucket}/p/", out).skipped


def test_object_that_is_also_a_prefix_is_refused_before_writing(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    put_each(s3, bucket, {"q/a": b"file", "q/a/b": b"under", "q/c": b"c"})
    out = tmp_path / "out"
    with pytest.raises(OSError, match=r"'q/a' and 'q/a/b'") as e:
        fastload.stage(f"s3://{bucket}/q/", out)
    assert "both" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()
    assert not any(m in p.name for p in tmp_path.rglob("*") for m in (".fastload-", ".fl-tmp"))


def test_keys_with_special_characters_stage_under_their_names(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    names = ["a b.txt", "plus+sign", "pct%20x", "hash#1", "q?x", "semi;colon", "amp&x",
             "eq=x", "star*x", "br[1]", "déjà vu", "日本語"]  # fmt: skip
    files = {n: n.encode() for n in names}
    upload(s3, bucket, {f"s/{n}": v for n, v in files.items()})
    out = tmp_path / "out"
    fastload.stage(f"s3://{bucket}/s/", out)
    assert tree_of(out) == files


def test_secrets_appear_in_no_file_and_no_output(
    s3: S3Server, no_aws_env: str, proxy: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import subprocess
    import sys

    bucket = no_aws_env
    upload(s3, bucket, {f"p/{k}": v for k, v in FILES.items()})
    config = tmp_path / "config" / "fastload.toml"
    config.parent.mkdir()
    config.write_text(
        f'[storage.s3]\nendpoint_url = "{proxy.endpoint}"\naccess_key_id = "{KEY_ID}"\n'
        f'secret_access_key = "{SECRET}"\n'
    )
    monkeypatch.setenv("FASTLOAD_CONFIG", str(config))
    work = tmp_path / "work"
    fastload.stage(f"s3://{bucket}/p/", work / "out", progress=True)
    fastload.stage(f"s3://{bucket}/p/", work / "out2", storage_options={"secret": SECRET})
    with pytest.raises(PermissionError) as e:
        fastload.stage(f"s3://{bucket}/p/", work / "bad",
                       storage_options={"secret": SECRET + "-wrong"})  # fmt: skip
    outputs = [str(e.value)]
    for args in (["env"], ["env", "--json"], ["stage", f"s3://{bucket}/p/", str(work / "c")]):
        r = subprocess.run([sys.executable, "-m", "fastload", *args], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ))  # fmt: skip
        assert r.returncode == 0, r.stderr
        outputs += [r.stdout, r.stderr]
    captured = capfd.readouterr()
    outputs += [captured.out, captured.err]
    for text in outputs:
        assert SECRET not in text
    written = [p for p in work.parent.rglob("*") if p.is_file() and p != config]
    assert any(".fastload" in str(p) for p in written)  # the manifests were read
    for p in written:
        assert SECRET.encode() not in p.read_bytes(), p


@pytest.mark.parametrize(
    ("url", "opts", "expect"),
    [
        ("gs://bkt/p/", {"anon": True}, {"skip_signature": "true", "bucket": "bkt"}),
        ("gs://bkt/p/", {"google_skip_signature": "true", "endpoint_url": "http://127.0.0.1:1"},
         {"skip_signature": "true", "base_url": "http://127.0.0.1:1"}),
        ("az://cont/p/", {"account_name": "acct", "anon": True},
         {"account_name": "acct", "skip_signature": "true", "container_name": "cont"}),
        ("az://cont/p/", {"azure_storage_account_name": "acct", "sas_token": "sv=1&sig=x"},
         {"account_name": "acct", "sas_key": "sv=1&sig=x"}),
    ],
    ids=["gs-anon", "gs-prefixed", "az-anon", "az-adlfs"],
)
def test_gs_and_az_names_are_mapped(url: str, opts: dict[str, Any], expect: dict[str, str]
                                    ) -> None:  # fmt: skip
    from fastload.sources import store_for

    store = store_for(url, opts)  # made, no request sent (no server for these here)
    config = store._store.config
    assert {k: config.get(k) for k in expect} == expect


@pytest.mark.parametrize(
    ("url", "opts", "says"),
    [
        ("gs://bkt/", {"service_acount": "x"}, "did you mean 'service_account'"),
        ("az://c/", {"acount_name": "x"}, "did you mean 'account_name'"),
        ("az://c/", {"sas_token": "a", "sas_key": "b"}, "'sas_token' and 'sas_key'"),
    ],
)
def test_gs_and_az_bad_names(url: str, opts: dict[str, Any], says: str) -> None:
    from fastload.sources import store_for

    with pytest.raises(ValueError, match=r"unknown storage option|both set") as e:
        store_for(url, opts)
    assert says in str(e.value) and "\n" not in str(e.value)
    if "sas" in says:  # a secret's values are not shown
        assert "'a'" not in str(e.value) and "'b'" not in str(e.value)
