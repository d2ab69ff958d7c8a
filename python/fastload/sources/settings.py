"""Where an object store's settings come from, and how they are checked.

Later sources override earlier ones:
1. the site's defaults (``[storage.s3]`` in the fastload configuration file, passed down
   by the package (``fastload/__init__.py``) through :func:`set_site_loader`,
   kept in :mod:`.base`);
2. the profile (``AWS_PROFILE``, else ``default``) in ``~/.aws/credentials`` and
   ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``);
3. the environment: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
   ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
   ``AWS_REGION`` / ``AWS_DEFAULT_REGION``;
4. ``storage_options=`` (keys: ``endpoint_url``, ``profile``, ``anonymous``, ``region``,
   ``access_key_id``, ``secret_access_key``, ``session_token``, or any obstore key).

Every key and value is checked before any request, and an error names where it came
from (obstore panics on some malformed values).
"""

from __future__ import annotations

import configparser
import difflib
import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .base import set_site_loader, site_options

StorageOptions = Mapping[str, Any]


def _metadata_disabled() -> bool:
    """``AWS_EC2_METADATA_DISABLED=true``, as the AWS SDKs read it."""
    return os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"


def _profile(name: str | None) -> dict[str, str]:
    """The keys of an AWS profile from the shared credentials and config files."""
    chosen = name or os.environ.get("AWS_PROFILE") or "default"
    out: dict[str, str] = {}
    files = [
        (os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"), f"profile {chosen}"),
        (os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), chosen),
    ]
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(os.path.expanduser(path), encoding="utf-8")
        except (OSError, configparser.Error):
            continue
        for sec in (section, chosen):  # config's "default" section has no "profile " prefix
            if parser.has_section(sec):
                out.update({k.lower(): v.strip() for k, v in parser.items(sec)})
                break
    if name and not out:
        raise ValueError(f"AWS profile {name!r} is in neither ~/.aws/credentials nor ~/.aws/config")
    return out


def check_endpoint(value: Any, origin: str) -> str:
    """``value`` as an endpoint URL (``http://HOST[:PORT]`` or ``https://...``), or a
    ValueError in one line naming where it came from and what a valid one looks like
    (before any request: obstore panics on some malformed ones)."""
    if not isinstance(value, str):
        raise ValueError(
            f"endpoint_url from {origin} must be a string such as 'http://127.0.0.1:9000', "
            f"not {type(value).__name__}"
        )
    try:
        parts = urllib.parse.urlsplit(value.strip())
        _ = parts.port  # a port that is not a number, or out of range, raises
        port_ok = True
    except ValueError:
        port_ok = False
        parts = urllib.parse.urlsplit("")
    if parts.scheme.lower() in ("http", "https") and parts.hostname and port_ok:
        return value.strip()
    hint = ""
    if "://" not in value and value.strip():
        hint = f" (did you mean 'http://{value.strip()}'?)"
    elif parts.scheme and parts.scheme.lower() not in ("http", "https"):
        hint = f" (the scheme '{parts.scheme}' is neither http nor https)"
    raise ValueError(
        f"endpoint {value!r} from {origin} is not a valid endpoint URL{hint}: give one like "
        "'http://127.0.0.1:9000' or 'https://s3.example.org'"
    )


# obstore's S3 configuration keys (its S3Config), each also accepted with an ``aws_``
# prefix, as obstore itself does.
_OBSTORE_S3 = frozenset((
    "access_key_id", "bucket", "checksum_algorithm", "conditional_put",
    "container_credentials_relative_uri", "container_credentials_full_uri",
    "container_authorization_token_file", "copy_if_not_exists", "disable_tagging",
    "disable_bulk_delete", "imdsv1_fallback", "metadata_endpoint", "region",
    "request_payer", "role_arn", "role_session_name", "s3_express", "secret_access_key",
    "server_side_encryption", "session_token", "skip_signature", "sse_bucket_key_enabled",
    "sse_customer_key_base64", "sse_kms_key_id", "sts_endpoint", "unsigned_payload",
    "virtual_hosted_style_request", "web_identity_token_file",
))  # fmt: skip
# fastload's own names, beside obstore's.
_FASTLOAD_S3 = frozenset(("endpoint_url", "profile", "anonymous", "client_options"))
# Other names for the same settings: obstore's, s3fs/fsspec's, boto3's.
_S3_ALIASES = {
    "endpoint": "endpoint_url", "aws_endpoint": "endpoint_url",
    "aws_endpoint_url": "endpoint_url", "aws_endpoint_url_s3": "endpoint_url",
    "default_region": "region", "aws_default_region": "region", "region_name": "region",
    "key": "access_key_id", "secret": "secret_access_key", "token": "session_token",
    "anon": "anonymous", "profile_name": "profile", "aws_profile": "profile",
}  # fmt: skip
_SECRET_KEYS = frozenset(("secret_access_key", "session_token", "sse_customer_key_base64"))
_BOOL_KEYS = frozenset(("anonymous", "skip_signature", "virtual_hosted_style_request",
                        "unsigned_payload", "disable_tagging", "imdsv1_fallback",
                        "s3_express", "sse_bucket_key_enabled"))  # fmt: skip


def _canonical_s3(name: str) -> str | None:
    low = name.lower()
    if low in _FASTLOAD_S3 or low in _OBSTORE_S3:
        return low
    if low in _S3_ALIASES:
        return _S3_ALIASES[low]
    if low.startswith("aws_") and low[4:] in _OBSTORE_S3:
        return low[4:]
    return None


def _accepted_s3() -> list[str]:
    return sorted(_FASTLOAD_S3 | _OBSTORE_S3 | set(_S3_ALIASES)
                  | {f"aws_{k}" for k in _OBSTORE_S3} | {"client_kwargs"})  # fmt: skip


def normalize_s3_options(options: StorageOptions | None, origin: str) -> dict[str, Any]:
    """``options`` under one name per setting: fastload's and obstore's own names,
    obstore's ``aws_`` forms, s3fs/fsspec's (``key``, ``secret``, ``token``, ``anon``,
    ``endpoint_url``, ``client_kwargs={"endpoint_url", "region_name"}``, ``profile``) and
    boto3's (``aws_access_key_id``, ``region_name``, ...). An unknown key, a value of the
    wrong type, or two names of one setting with different values is a ValueError in
    one line naming the key (close matches first) and ``origin``, before any request;
    secrets are never shown."""
    flat: list[tuple[str, Any]] = []
    for name, value in (options or {}).items():
        if str(name).lower() == "client_kwargs":  # s3fs: botocore client arguments
            if not isinstance(value, Mapping):
                raise ValueError(f"storage option 'client_kwargs' from {origin} must be a "
                                 f"mapping, not {type(value).__name__}")
            for k, v in value.items():
                if str(k).lower() not in ("endpoint_url", "region_name"):
                    raise ValueError(
                        f"storage option 'client_kwargs.{k}' from {origin} is not used: "
                        "fastload takes 'endpoint_url' and 'region_name' from it"
                    )
                flat.append((f"client_kwargs.{k}", (_canonical_s3(str(k)), v)))
            continue
        canon = _canonical_s3(str(name))
        if canon is None:
            close = difflib.get_close_matches(str(name).lower(), _accepted_s3(), n=3)
            hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
            raise ValueError(
                f"unknown storage option {name!r} from {origin}: {hint}accepted: "
                "endpoint_url, access_key_id, secret_access_key, session_token, region, "
                "profile, anonymous, client_options, obstore's S3 keys (also with aws_), "
                "s3fs's key/secret/token/anon/client_kwargs, boto3's aws_* and region_name"
            )
        flat.append((str(name), (canon, value)))
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for name, (canon, value) in flat:
        assert canon is not None
        value = _typed(canon, name, value, origin)
        if canon in out and out[canon] != value:
            shown = "" if canon in _SECRET_KEYS else f" ({out[canon]!r} and {value!r})"
            raise ValueError(
                f"storage options {named[canon]!r} and {name!r} from {origin} both set "
                f"{canon} to different values{shown}: give one"
            )
        out[canon], named[canon] = value, name
    return out


def _typed(canon: str, name: str, value: Any, origin: str) -> Any:
    if canon in _BOOL_KEYS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
            return value.strip().lower() in ("true", "1")
        raise ValueError(f"storage option {name!r} from {origin} must be true or false, "
                         f"not {type(value).__name__}")
    if canon == "client_options":
        if isinstance(value, Mapping):
            return dict(value)
        raise ValueError(f"storage option {name!r} from {origin} must be a mapping")
    if not isinstance(value, str):
        what = "****" if canon in _SECRET_KEYS else type(value).__name__
        raise ValueError(f"storage option {name!r} from {origin} must be a string, not {what}")
    return value


# obstore's keys for Google Cloud Storage and Azure (GCSConfig, AzureConfig), each also
# accepted with its prefix (``google_``; ``azure_``, ``azure_storage_``), and the other
# names users bring (gcsfs's, adlfs's, fastload's own).
_OBSTORE = {
    "gs": frozenset(("service_account", "service_account_key", "base_url", "bearer_token",
                     "bucket", "application_credentials", "skip_signature")),
    "az": frozenset((
        "account_name", "account_key", "client_id", "client_secret", "credential_type",
        "tenant_id", "authority_host", "sas_key", "token", "use_emulator",
        "use_fabric_endpoint", "encryption_key", "endpoint", "msi_endpoint", "object_id",
        "msi_resource_id", "federated_token_file", "use_azure_cli", "skip_signature",
        "container_name", "disable_tagging", "fabric_token_service_url",
        "fabric_workload_host", "fabric_session_token", "fabric_cluster_identifier",
    )),
}  # fmt: skip
_PREFIXES = {"gs": ("google_",), "az": ("azure_storage_", "azure_")}
_ALIASES = {
    "gs": {"endpoint_url": "base_url", "anon": "skip_signature", "anonymous": "skip_signature",
           "service_account_path": "service_account", "credentials": "application_credentials"},
    "az": {"endpoint_url": "endpoint", "anon": "skip_signature", "anonymous": "skip_signature",
           "sas_token": "sas_key", "access_key": "account_key"},
}  # fmt: skip
_OTHER_SECRETS = frozenset(("service_account_key", "bearer_token", "account_key",
                            "client_secret", "sas_key", "token", "fabric_session_token"))


def normalize_options(scheme: str, options: StorageOptions | None, origin: str) -> dict[str, Any]:
    """``options`` for a ``scheme://`` store under obstore's names: s3 through
    :func:`normalize_s3_options`; gs and az: obstore's keys, with their ``google_`` or
    ``azure_`` prefixes, and gcsfs's and adlfs's common names (``anon``, ``endpoint_url``,
    ``sas_token``, ...). An unknown key or two names of one setting with different values
    is a ValueError in one line naming the key (close matches first)."""
    if scheme == "s3":
        return normalize_s3_options(options, origin)
    keys, aliases = _OBSTORE[scheme], _ALIASES[scheme]
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for name, value in (options or {}).items():
        low = str(name).lower()
        canon = aliases.get(low, low)
        for prefix in _PREFIXES[scheme]:
            if canon not in keys and canon.startswith(prefix):
                canon = canon[len(prefix):]
        if canon not in keys:
            accepted = sorted(keys | set(aliases) | {p + k for p in _PREFIXES[scheme][:1]
                                                     for k in keys})  # fmt: skip
            close = difflib.get_close_matches(low, accepted, n=3)
            hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
            raise ValueError(
                f"unknown storage option {name!r} for {scheme}:// from {origin}: {hint}"
                f"accepted: obstore's {scheme} keys ({', '.join(sorted(keys))}), also "
                f"with {' or '.join(_PREFIXES[scheme])}, and {', '.join(sorted(aliases))}"
            )
        if canon == "skip_signature" and not isinstance(value, bool):
            value = _typed("anonymous", str(name), value, origin)
        if canon in out and out[canon] != value:
            shown = "" if canon in _OTHER_SECRETS else f" ({out[canon]!r} and {value!r})"
            raise ValueError(
                f"storage options {named[canon]!r} and {name!r} from {origin} both set "
                f"{canon} to different values{shown}: give one"
            )
        out[canon], named[canon] = value, str(name)
    return out


def s3_settings(options: StorageOptions | None) -> dict[str, Any]:
    """The S3 settings in force: site < profile < environment < ``options``; the endpoint
    checked (:func:`check_endpoint`)."""
    opts = normalize_s3_options(options, "storage_options")
    origin = "the configuration file's [storage.s3]"
    s: dict[str, Any] = normalize_s3_options(site_options("s3"), origin)
    prof = _profile(opts.pop("profile", None) or s.pop("profile", None))
    for key, to in (
        ("aws_access_key_id", "access_key_id"),
        ("aws_secret_access_key", "secret_access_key"),
        ("aws_session_token", "session_token"),
        ("region", "region"),
        ("endpoint_url", "endpoint_url"),
    ):
        if key in prof:
            s[to] = prof[key]
            if to == "endpoint_url":
                origin = "the AWS profile"
    env = os.environ
    for var, to in (
        ("AWS_ACCESS_KEY_ID", "access_key_id"),
        ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
        ("AWS_SESSION_TOKEN", "session_token"),
        ("AWS_DEFAULT_REGION", "region"),
        ("AWS_REGION", "region"),
        ("AWS_ENDPOINT_URL", "endpoint_url"),
        ("AWS_ENDPOINT_URL_S3", "endpoint_url"),
    ):
        if env.get(var):
            s[to] = env[var]
            if to == "endpoint_url":
                origin = var
    if "endpoint_url" in opts:
        origin = "storage_options (or --endpoint-url)"
    s.update(opts)
    if s.get("endpoint_url") is not None:
        s["endpoint_url"] = check_endpoint(s["endpoint_url"], origin)
    return s


__all__ = [
    "StorageOptions",
    "check_endpoint",
    "normalize_options",
    "normalize_s3_options",
    "s3_settings",
    "set_site_loader",
    "site_options",
]
