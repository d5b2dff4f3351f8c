"""Who may read from an edge, and who may administer it.

Readers send the bearer token of ``--token-file``; with ``--s3-keys``, S3
clients sign instead (AWS Signature V4, checked by :mod:`.s3auth`). The
admin endpoints take the admin token, or the read token when there is none;
with neither, they are open only on an edge that listens on loopback
(``admin_open``), and refused (403) otherwise. Tokens are compared in
constant time.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from .s3auth import S3Keys


class Access:
    """An edge's tokens and S3 keys; each check raises when the request may not pass."""

    def __init__(
        self,
        read_token: str | None = None,
        admin_token: str | None = None,
        s3_keys: S3Keys | None = None,
        *,
        admin_open: bool = True,
    ) -> None:
        self.read_token = read_token
        # Without an admin token, warming is as open as reading (it fetches
        # nothing a reader could not make the edge fetch) ...
        self.admin_token = admin_token if admin_token is not None else read_token
        self.s3_keys = s3_keys
        # ... but only where just this machine can reach it: warm jobs and link
        # shaping change what the edge does for everyone.
        self.admin_open = admin_open

    def check_admin(self, request: web.Request) -> None:
        """``HTTPUnauthorized`` unless the request carries the admin token;
        ``HTTPForbidden`` when there is none and the admin endpoints are closed."""
        if self.admin_token is None and not self.admin_open:
            raise web.HTTPForbidden(
                text="this edge listens beyond loopback: its admin endpoints need an admin "
                "token (start it with --admin-token-file)\n"
            )
        _require_bearer(request, self.admin_token)

    def reads_plainly(self, authorization: str | None) -> bool:
        """Whether a read with this ``Authorization`` header (None: none) passes on
        that header alone: an open edge, or the read token. (With S3 keys and no
        token, only :meth:`check_read` can tell.)"""
        if self.read_token is None:
            return self.s3_keys is None
        given = (authorization or "").encode()
        return hmac.compare_digest(given, f"Bearer {self.read_token}".encode())

    def check_read(self, request: web.Request) -> None:
        """Any read (a store key, an S3 path, a listing): the bearer token, or with S3 keys
        an AWS Signature V4 by one of them; open when the edge has neither.
        ``HTTPUnauthorized`` or :class:`~.s3api.S3RequestError` (403) otherwise."""
        if self.s3_keys is None:
            _require_bearer(request, self.read_token)
            return
        if self.read_token is not None:
            given = request.headers.get("Authorization", "").encode()
            if hmac.compare_digest(given, f"Bearer {self.read_token}".encode()):
                return
        self.s3_keys.verify(request.method, request.host, request.raw_path, request.headers)


def _require_bearer(request: web.Request, token: str | None) -> None:
    if token is None:
        return
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise web.HTTPUnauthorized(
            text="a valid bearer token is required\n",
            headers={"WWW-Authenticate": 'Bearer realm="kvcdn-edge"'},
        )
