"""AWS Signature Version 4 for the edge's S3 API: per-client keys, verified by botocore.

With ``edge serve --s3-keys FILE``, every S3 request (``/{bucket}...`` and the
root listing) must be signed with one of the file's access keys, as boto3,
s3fs or the AWS CLI sign for S3: an ``Authorization: AWS4-HMAC-SHA256 ...``
header, or a presigned URL (``X-Amz-Signature`` in the query). The expected
signature is computed by botocore's own signer from the request as received
(the SigV4 algorithm is never written here), then compared in constant time.

The keys file holds one client per line: ``ACCESS_KEY_ID SECRET_ACCESS_KEY
[comment]``; blank lines and ``#`` comments are skipped.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import parse_qsl

from kvcdn.errors import InputError
from kvcdn.signing import read_bounded

from .s3api import S3RequestError

MAX_SKEW = timedelta(minutes=15)  # as S3's RequestTimeTooSkewed
MAX_PRESIGNED_EXPIRY_S = 7 * 24 * 3600
_AUTH = re.compile(
    r"^AWS4-HMAC-SHA256\s+Credential=([^,\s]+),\s*SignedHeaders=([^,\s]+),\s*Signature=([0-9a-f]{64})$"
)
_ACCESS_KEY = re.compile(r"^[A-Za-z0-9._-]{3,128}$")


class S3Keys:
    """The access keys an edge accepts, each with its secret."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            raise InputError("an S3 keys file must name at least one access key")
        self._secrets = dict(keys)  # bounded by the keys file, read up to 1 MiB

    @classmethod
    def from_file(cls, path: str | Path) -> S3Keys:
        path = Path(path)
        try:
            text = read_bounded(path, 1 << 20, "S3 keys file").decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"the S3 keys file {path} is not UTF-8 text") from None
        keys: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) < 2 or not _ACCESS_KEY.match(parts[0]) or len(parts[1]) < 8:
                raise InputError(
                    f"{path}, line {number}: expected 'ACCESS_KEY_ID SECRET_ACCESS_KEY [comment]'"
                )
            keys[parts[0]] = parts[1]
        return cls(keys)

    def verify(self, method: str, host: str, raw_path: str, headers: Mapping[str, str]) -> str:
        """The access key that signed this request; :class:`S3RequestError` (403) otherwise."""
        path, _, query = raw_path.partition("?")
        params = parse_qsl(query, keep_blank_values=True)
        if any(name == "X-Amz-Signature" for name, _ in params):
            return self._verify_presigned(method, host, path, params)
        header = headers.get("Authorization", "")
        if header.startswith("AWS ") or any(name == "AWSAccessKeyId" for name, _ in params):
            raise S3RequestError(
                403,
                "AccessDenied",
                "AWS Signature Version 2 is not accepted; sign with version 4 (boto3: "
                "Config(signature_version='s3v4'))",
            )
        match = _AUTH.match(header.strip())
        if match is None:
            raise S3RequestError(
                403,
                "AccessDenied",
                "this edge requires requests signed with AWS Signature Version 4",
            )
        credential, signed, given = match.groups()
        when = headers.get("X-Amz-Date", "")
        access_key, region = self._scope(credential, when)
        names = signed.split(";")
        if "host" not in names or "x-amz-date" not in names:
            raise S3RequestError(
                403, "AccessDenied", "the signature must cover host and x-amz-date"
            )
        signing = {name: ",".join(_all(headers, name)) for name in names}
        if any(not value for name, value in signing.items() if name != "host"):
            raise S3RequestError(403, "AccessDenied", "a signed header is missing")
        signing["host"] = host
        from botocore.auth import S3SigV4Auth

        expected = self._signature(
            S3SigV4Auth, access_key, region, method, host, path, params, signing, when, names
        )
        if not hmac.compare_digest(expected, given):
            raise S3RequestError(
                403, "SignatureDoesNotMatch", "the request signature does not match"
            )
        return access_key

    def _verify_presigned(
        self, method: str, host: str, path: str, params: list[tuple[str, str]]
    ) -> str:
        query = dict(params)
        if query.get("X-Amz-Algorithm") != "AWS4-HMAC-SHA256":
            raise S3RequestError(403, "AccessDenied", "only AWS4-HMAC-SHA256 is accepted")
        when = query.get("X-Amz-Date", "")
        access_key, region = self._scope(query.get("X-Amz-Credential", ""), when, presigned=True)
        expires = query.get("X-Amz-Expires", "")
        if not expires.isdigit() or not 1 <= int(expires) <= MAX_PRESIGNED_EXPIRY_S:
            raise S3RequestError(403, "AccessDenied", "X-Amz-Expires is missing or invalid")
        signed_at = _timestamp(when)
        now = datetime.now(timezone.utc)
        if signed_at > now + MAX_SKEW:  # dated in the future: it would outlive its expiry
            raise S3RequestError(403, "AccessDenied", "the presigned URL is not valid yet")
        if now > signed_at + timedelta(seconds=int(expires)):
            raise S3RequestError(403, "AccessDenied", "the presigned URL has expired")
        names = query.get("X-Amz-SignedHeaders", "").split(";")
        if names != ["host"]:
            raise S3RequestError(403, "AccessDenied", "a presigned URL must sign exactly host")
        given = query["X-Amz-Signature"]
        rest = [(k, v) for k, v in params if k != "X-Amz-Signature"]
        from botocore.auth import S3SigV4QueryAuth

        expected = self._signature(
            S3SigV4QueryAuth, access_key, region, method, host, path, rest, {"host": host},
            when, names,
        )  # fmt: skip
        if not hmac.compare_digest(expected, given):
            raise S3RequestError(
                403, "SignatureDoesNotMatch", "the request signature does not match"
            )
        return access_key

    def _scope(self, credential: str, when: str, presigned: bool = False) -> tuple[str, str]:
        """(access key, region) from a credential scope; checks the key and the clock."""
        parts = credential.split("/")
        if len(parts) != 5 or parts[3] != "s3" or parts[4] != "aws4_request":
            raise S3RequestError(403, "AuthorizationHeaderMalformed", "invalid credential scope")
        access_key, day, region = parts[0], parts[1], parts[2]
        if access_key not in self._secrets:
            raise S3RequestError(403, "InvalidAccessKeyId", "this edge does not know that key")
        signed_at = _timestamp(when)
        if day != when[:8]:
            raise S3RequestError(403, "AuthorizationHeaderMalformed", "the scope's date differs")
        if not presigned and abs(datetime.now(timezone.utc) - signed_at) > MAX_SKEW:
            raise S3RequestError(
                403, "RequestTimeTooSkewed", "the request time differs from the edge's by too much"
            )
        return access_key, region

    def _signature(
        self,
        signer_class: type,
        access_key: str,
        region: str,
        method: str,
        host: str,
        path: str,
        params: list[tuple[str, str]],
        headers: dict[str, str],
        when: str,
        names: list[str],
    ) -> str:
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        signer = signer_class(Credentials(access_key, self._secrets[access_key]), "s3", region)
        request = AWSRequest(method=method, url=f"http://{host}{path}", headers=headers)
        request.params = params
        request.context["timestamp"] = when
        if signer.signed_headers(signer.headers_to_sign(request)).split(";") != names:
            raise S3RequestError(
                403, "SignatureDoesNotMatch", "the signed headers cannot be verified here"
            )
        canonical = signer.canonical_request(request)
        return signer.signature(signer.string_to_sign(request, canonical), request)


def _timestamp(when: str) -> datetime:
    try:
        return datetime.strptime(when, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise S3RequestError(403, "AccessDenied", "X-Amz-Date is missing or invalid") from None


def _all(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    values = getall(name, []) if getall is not None else [headers.get(name, "")]
    return [v for v in values if v]
