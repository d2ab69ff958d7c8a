"""S3 requests made here, for what obstore cannot do with a key as the bucket stores it:
obstore parses every key of a listing into its own path type, which refuses a key with a
``.`` or ``..`` segment, an empty one, or an ASCII control character (the whole listing
fails on one such key), drops a leading or trailing ``/`` (``/abs.txt`` is fetched as
``abs.txt``; a folder marker ``d/`` reads as an object ``d``), and addresses only keys
it can parse.

So an S3 prefix is listed here (ListObjectsV2 with ``encoding-type=url``, each key as
stored), and a key obstore would address under another name is fetched here; the rest
goes through obstore. Requests are signed with AWS Signature Version 4 (the standard
library's hmac and hashlib), over one keep-alive connection per thread (http.client).
Used only where the credentials are at hand as keys (or the bucket is public); else
obstore lists, and a key it cannot parse is named in fastload's words.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import http.client
import ssl
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from typing import Any

from .retry import RawError

__all__ = ["RawError", "RawS3"]

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _quote(s: str, safe: str = "") -> str:
    return urllib.parse.quote(s, safe="-_.~" + safe, errors="surrogateescape")


class RawS3:
    """Signed requests to one bucket of an S3 endpoint (path-style addressing, or
    virtual-hosted where ``virtual``); ``keys`` is ``(access key, secret, session token
    or None)``, None for a public bucket (unsigned)."""

    def __init__(self, endpoint: str, bucket: str, region: str,
                 keys: tuple[str, str, str | None] | None, *, virtual: bool = False,
                 timeout: float = 60.0, verify: bool = True) -> None:  # fmt: skip
        u = urllib.parse.urlsplit(endpoint)
        self.https = u.scheme == "https"
        host = u.hostname or ""
        if virtual:
            host = f"{bucket}.{host}"
        self.host, self.port = host, u.port
        self.netloc = host if u.port is None else f"{host}:{u.port}"
        self.base = "" if virtual else "/" + _quote(bucket)
        self.bucket, self.region, self.keys = bucket, region, keys
        self.timeout, self.verify = timeout, verify

    # --- requests ------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A connection kept alive for a sequence of requests (a listing's pages), closed
        at the end."""
        sess = Session(self)
        try:
            yield sess
        finally:
            sess.drop()

    def request(
        self, method: str, key: str | None, query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None, session: Session | None = None,
    ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        """One request (``key`` None: the bucket itself), on ``session``'s connection
        (else one of its own, closed after): status, headers (lowercase names), body; an
        error status is a :class:`RawError`, as is a failure to reach the server (its
        text saying which, as obstore's does)."""
        if session is None:
            with self.session() as own:
                return self.request(method, key, query, headers, own)
        path = self.base + ("" if key is None else "/" + _quote(key, "/"))
        q = sorted((query or {}).items())
        qs = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in q)
        hdrs = {"host": self.netloc, **{k.lower(): v for k, v in (headers or {}).items()}}
        if self.keys is not None:
            self._sign(method, path, qs, hdrs)
        target = path + ("?" + qs if qs else "")
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more
            conn = session.conn()
            try:
                conn.request(method, target, headers=hdrs)
                resp = conn.getresponse()
                body = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                session.drop()
                if attempt:
                    raise RawError(f"error sending request: connection reset: {e}") from None
            except TimeoutError:
                session.drop()
                raise RawError("error sending request: operation timed out") from None
            except ConnectionRefusedError:
                session.drop()
                raise RawError("error sending request: tcp connect error: connection "
                               "refused") from None  # fmt: skip
            except (http.client.IncompleteRead, http.client.HTTPException) as e:
                session.drop()
                raise RawError(f"body error: incompletebody: {e!r}") from None
            except OSError as e:
                session.drop()
                raise RawError(f"error sending request: connect error: {e}") from None
        got = {k.lower(): v for k, v in resp.getheaders()}
        if resp.status >= 300:
            code = ""
            if body.startswith(b"<?xml") or body.startswith(b"<Error"):
                with contextlib.suppress(ET.ParseError):
                    code = ET.fromstring(body).findtext("Code") or ""
            if resp.status == 404 and code != "NoSuchBucket":
                raise FileNotFoundError(f"status 404 {code or 'Not Found'}: {key}")
            raise RawError(f"status {resp.status} {code}: {method} {target}", resp.status, code)
        return resp.status, got, body

    def _sign(self, method: str, path: str, qs: str, hdrs: dict[str, str]) -> None:
        """AWS Signature Version 4 on ``hdrs`` (adds x-amz-date, the payload hash, the
        token, authorization)."""
        assert self.keys is not None
        access, secret, token = self.keys
        now = datetime.datetime.now(datetime.timezone.utc)
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        hdrs["x-amz-date"] = stamp
        hdrs["x-amz-content-sha256"] = _EMPTY_SHA256
        if token:
            hdrs["x-amz-security-token"] = token
        names = sorted(hdrs)
        canonical = "\n".join([
            method, path, qs, *(f"{n}:{hdrs[n].strip()}" for n in names), "",
            ";".join(names), _EMPTY_SHA256,
        ])  # fmt: skip
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])  # fmt: skip
        k = f"AWS4{secret}".encode()
        for part in (day, self.region, "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        hdrs["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, "
                                 f"SignedHeaders={';'.join(names)}, Signature={sig}")  # fmt: skip

    # --- what obstore cannot do ----------------------------------------------------------

    def list_page(self, prefix: str, token: str | None = None, delimiter: str | None = None,
                  session: Session | None = None
                  ) -> tuple[list[dict[str, Any]], list[str], str | None]:  # fmt: skip
        """One page (up to 1,000 keys) of the keys under ``prefix``, each as stored:
        ``(objects, common prefixes, the next page's token or None)``; an object as
        obstore's metadata dict (``path``, ``size``, ``e_tag``, ``last_modified``)."""
        query = {"list-type": "2", "encoding-type": "url", "max-keys": "1000"}
        if prefix:
            query["prefix"] = prefix
        if token:
            query["continuation-token"] = token
        if delimiter:
            query["delimiter"] = delimiter
        _, _, body = self.request("GET", None, query, session=session)
        root = ET.fromstring(body)
        encoded = (root.findtext(_NS + "EncodingType") or root.findtext("EncodingType")) == "url"

        def text(el: ET.Element, name: str) -> str:
            return el.findtext(_NS + name) or el.findtext(name) or ""

        def dec(s: str) -> str:
            return urllib.parse.unquote_plus(s, errors="surrogateescape") if encoded else s

        objects = []
        for el in root.iter(_NS + "Contents"):
            objects.append({
                "path": dec(text(el, "Key")), "size": int(text(el, "Size") or 0),
                "e_tag": text(el, "ETag") or None,
                "last_modified": _when(text(el, "LastModified")), "version": None,
            })  # fmt: skip
        prefixes = [dec(text(el, "Prefix")) for el in root.iter(_NS + "CommonPrefixes")]
        more = text(root, "IsTruncated") == "true"
        return objects, prefixes, (text(root, "NextContinuationToken") or None) if more else None

    def get(self, key: str, start: int | None = None, end: int | None = None,
            etag: str | None = None) -> bytes:  # fmt: skip
        """The object ``key`` (bytes ``[start, end)`` where given), which must still have
        ``etag`` (412: a RawError of status 412)."""
        headers = {}
        if start is not None:
            headers["range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if etag:
            headers["if-match"] = etag
        return self.request("GET", key, headers=headers)[2]

    def head(self, key: str) -> dict[str, Any]:
        """The object's metadata, as obstore's dict."""
        _, h, _ = self.request("HEAD", key)
        return {"path": key, "size": int(h.get("content-length", 0)), "e_tag": h.get("etag"),
                "last_modified": _http_when(h.get("last-modified")),
                "version": h.get("x-amz-version-id")}  # fmt: skip


class Session:
    """One connection of a :class:`RawS3`, made at its first request, made again after a
    failure."""

    def __init__(self, raw: RawS3) -> None:
        self.raw = raw
        self._conn: http.client.HTTPConnection | None = None

    def conn(self) -> http.client.HTTPConnection:
        if self._conn is None:
            raw = self.raw
            if raw.https:
                ctx = ssl.create_default_context()
                if not raw.verify:
                    ctx.check_hostname = False
                    ctx.verify_mode = ssl.CERT_NONE
                self._conn = http.client.HTTPSConnection(
                    raw.host, raw.port, timeout=raw.timeout, context=ctx
                )
            else:
                self._conn = http.client.HTTPConnection(raw.host, raw.port, timeout=raw.timeout)
        return self._conn

    def drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _when(iso: str) -> datetime.datetime | None:
    """A listing's LastModified (``2026-11-28T09:00:00.000Z``)."""
    if not iso:
        return None
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))


def _http_when(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    import email.utils

    return email.utils.parsedate_to_datetime(value)
