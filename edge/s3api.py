"""The slice of the S3 REST API an edge speaks, so S3 clients read through it unchanged.

boto3, s3fs or the AWS CLI pointed at an edge (``endpoint_url``, path-style
addressing) read kvcdn objects as if from the bucket behind it:

* ``GET``/``HEAD /{bucket}/{key}`` (with ``Range``, ``If-Match``,
  ``If-None-Match``), where ``{key}`` is the store key under the origin's
  prefix: an origin ``s3://kv/prod`` is bucket ``kv`` and
  ``docs/a/latest.json`` is key ``prod/docs/a/latest.json``, the same names
  as at the origin itself;
* ``HEAD /{bucket}`` (HeadBucket) and ``GET /{bucket}?list-type=2``
  (ListObjectsV2 with ``prefix``, ``delimiter``, ``max-keys``,
  ``start-after``, ``continuation-token`` and ``encoding-type=url``).

Listings hold keys and sizes only. They carry no ETag because the edge names
an object by the sha256 of its bytes, which it knows only once it holds
them; a listed ETag that differed from the served one would make s3fs's
``If-Match`` reads fail. Errors are S3's XML documents, so clients map them
to their usual exceptions (``NoSuchKey`` is ``FileNotFoundError`` in s3fs).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from urllib.parse import quote
from xml.sax.saxutils import escape

MAX_KEYS = 1000
_NS = "http://s3.amazonaws.com/doc/2006-03-01/"


class S3RequestError(Exception):
    """A request the S3 API answers with an error document."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class BucketView:
    """How store keys appear to S3 clients: ``{bucket}/{prefix}{store key}``."""

    bucket: str
    prefix: str = ""  # empty, or ends with "/"

    @classmethod
    def for_origin(cls, origin_url: str, bucket: str | None = None) -> BucketView:
        """An ``s3://bucket/prefix`` origin keeps its names; anything else is ``kvcdn``."""
        scheme, _, rest = origin_url.partition("://")
        if scheme in ("s3", "s3a") and rest.strip("/"):
            name, _, prefix = rest.strip("/").partition("/")
            return cls(bucket or name, f"{prefix}/" if prefix else "")
        return cls(bucket or "kvcdn", "")

    def store_key(self, s3_key: str) -> str | None:
        """The store key an S3 key names, or None when it is outside the view."""
        if not s3_key.startswith(self.prefix):
            return None
        return s3_key[len(self.prefix) :] or None

    def store_prefix(self, s3_prefix: str) -> str | None:
        """The store prefix to list for an S3 prefix; None when nothing can match."""
        if s3_prefix.startswith(self.prefix):
            return s3_prefix[len(self.prefix) :]
        if self.prefix.startswith(s3_prefix):
            return ""
        return None


@dataclass(frozen=True)
class ListRequest:
    prefix: str
    delimiter: str
    max_keys: int
    start_after: str
    token: str | None
    url_encoded: bool

    @classmethod
    def parse(cls, query: dict[str, str]) -> ListRequest:
        if query.get("list-type") != "2":
            raise S3RequestError(
                501, "NotImplemented", "only ListObjectsV2 (list-type=2) is served"
            )
        raw_max = query.get("max-keys", str(MAX_KEYS))
        if not raw_max.isdigit():
            raise S3RequestError(400, "InvalidArgument", f"max-keys must be a number: {raw_max!r}")
        token = query.get("continuation-token")
        if token is not None:
            try:
                decode_token(token)
            except ValueError:
                raise S3RequestError(
                    400, "InvalidArgument", "the continuation token is not valid"
                ) from None
        encoding = query.get("encoding-type")
        if encoding not in (None, "url"):
            raise S3RequestError(400, "InvalidArgument", f"unknown encoding-type {encoding!r}")
        return cls(
            prefix=query.get("prefix", ""),
            delimiter=query.get("delimiter", ""),
            max_keys=min(int(raw_max), MAX_KEYS),
            start_after=query.get("start-after", ""),
            token=token,
            url_encoded=encoding == "url",
        )


@dataclass(frozen=True)
class ListPage:
    contents: list[tuple[str, int]]  # (key, size)
    common_prefixes: list[str]
    next_token: str | None


def list_page(sizes: dict[str, int], request: ListRequest) -> ListPage:
    """One page of a listing of ``sizes`` (S3 keys to sizes), as S3 pages it."""
    after = request.start_after
    if request.token is not None:
        after = max(after, decode_token(request.token))
    contents: list[tuple[str, int]] = []
    prefixes: list[str] = []
    last = ""
    truncated = False
    for key in sorted(k for k in sizes if k.startswith(request.prefix) and k > after):
        group = None
        if request.delimiter:
            cut = key.find(request.delimiter, len(request.prefix))
            if cut >= 0:
                group = key[: cut + len(request.delimiter)]
        if group is not None and prefixes and prefixes[-1] == group:
            continue  # keys are sorted, so one group's keys are adjacent
        if group is not None and group <= after:
            continue  # a group already returned on an earlier page
        if len(contents) + len(prefixes) == request.max_keys:
            truncated = True
            break
        if group is None:
            contents.append((key, sizes[key]))
            last = key
        else:
            prefixes.append(group)
            last = group + "\U0010ffff"  # the next page starts after the whole group
    return ListPage(contents, prefixes, encode_token(last) if truncated else None)


def encode_token(after: str) -> str:
    return base64.urlsafe_b64encode(after.encode()).decode()


def decode_token(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ValueError("bad continuation token") from None


def list_xml(bucket: str, request: ListRequest, page: ListPage) -> bytes:
    def enc(value: str) -> str:
        return escape(quote(value, safe="/") if request.url_encoded else value)

    parts = [
        f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="{_NS}">',
        f"<Name>{escape(bucket)}</Name>",
        f"<Prefix>{enc(request.prefix)}</Prefix>",
        f"<KeyCount>{len(page.contents) + len(page.common_prefixes)}</KeyCount>",
        f"<MaxKeys>{request.max_keys}</MaxKeys>",
        f"<IsTruncated>{'true' if page.next_token else 'false'}</IsTruncated>",
    ]
    if request.delimiter:
        parts.append(f"<Delimiter>{enc(request.delimiter)}</Delimiter>")
    if request.url_encoded:
        parts.append("<EncodingType>url</EncodingType>")
    if request.start_after:
        parts.append(f"<StartAfter>{enc(request.start_after)}</StartAfter>")
    if request.token is not None:
        parts.append(f"<ContinuationToken>{escape(request.token)}</ContinuationToken>")
    if page.next_token:
        parts.append(f"<NextContinuationToken>{escape(page.next_token)}</NextContinuationToken>")
    for key, size in page.contents:
        parts.append(
            f"<Contents><Key>{enc(key)}</Key><Size>{size}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
        )
    for prefix in page.common_prefixes:
        parts.append(f"<CommonPrefixes><Prefix>{enc(prefix)}</Prefix></CommonPrefixes>")
    parts.append("</ListBucketResult>\n")
    return "".join(parts).encode()


def error_xml(code: str, message: str, resource: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource></Error>\n"
    ).encode()


#: The S3 error code for each status an edge answers with.
ERROR_CODES = {
    304: "NotModified",
    400: "InvalidArgument",
    401: "AccessDenied",
    403: "AccessDenied",
    404: "NoSuchKey",
    412: "PreconditionFailed",
    416: "InvalidRange",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}
