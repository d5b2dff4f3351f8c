"""kvcdn's presigned GETs (kvcdn/sigv4.py) are botocore's, byte for byte, and servers
take them: moto here, Ceph RGW (which checks every signature) where installed."""

from __future__ import annotations

import datetime
import urllib.error
import urllib.request
from urllib.parse import quote

import botocore.auth
import pytest
from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from kvcdn.sigv4 import PresignedGetSigner, host_header
from kvcdn.store import open_store

BASES = [
    "http://127.0.0.1:9000/kvcdn-bucket/",  # path style, a port
    "https://kvcdn-bucket.s3.eu-west-1.amazonaws.com/",  # virtual-host style
    "https://s3.us-east-1.amazonaws.com:443/kvcdn-bucket/",  # the default port, written
    "http://[::1]:7480/kvcdn-bucket/",  # IPv6
    "http://RGW.Example.Internal/kvcdn-bucket/",  # upper case, http's default port
]
PATHS = [
    "kv/objects/3f/3fa9.kvc",
    "kv/docs/sed%20manual/latest.json",
    "prefix/with~tilde/a.b-c_d",
]
AT = datetime.datetime(2026, 12, 4, 23, 59, 58, tzinfo=datetime.timezone.utc)


def botocore_url(monkeypatch, base: str, path: str, creds: Credentials, region: str,
                 expires: int, when: datetime.datetime) -> str:  # fmt: skip
    """What botocore's own query signer makes of the same request at ``when``."""
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: when)
    request = AWSRequest(method="GET", url=base + path)
    S3SigV4QueryAuth(creds, "s3", region, expires=expires).add_auth(request)
    return request.prepare().url


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzE/temporary+token=="])
def test_urls_are_botocores_byte_for_byte(monkeypatch, base, token):
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    signer = PresignedGetSigner(base, "eu-west-1", creds)
    for path in PATHS:
        for expires in (1, 900, 604800):
            ours = signer.url(path, expires, now=AT.timestamp())
            assert ours == botocore_url(monkeypatch, base, path, creds, "eu-west-1", expires, AT)


def test_a_new_day_or_refreshed_credentials_sign_with_a_new_key(monkeypatch):
    """The signing key is kept for a day and a secret: a URL signed after midnight, or
    after botocore refreshed the credentials, is still botocore's."""

    class Refreshing:  # what a refreshable botocore Credentials gives each signature
        def __init__(self) -> None:
            self.now = Credentials("AKID1", "secret-one", "token-one")

        def get_frozen_credentials(self) -> Credentials:
            return self.now

    creds = Refreshing()
    base = BASES[0]
    signer = PresignedGetSigner(base, "us-east-1", creds)
    next_day = AT + datetime.timedelta(seconds=3)
    for when in (AT, next_day):
        assert signer.url(PATHS[0], 900, now=when.timestamp()) == botocore_url(
            monkeypatch, base, PATHS[0], creds.now, "us-east-1", 900, when
        )
    creds.now = Credentials("AKID2", "secret-two", None)
    assert signer.url(PATHS[0], 900, now=next_day.timestamp()) == botocore_url(
        monkeypatch, base, PATHS[0], creds.now, "us-east-1", 900, next_day
    )


def test_hosts_are_signed_as_sent():
    assert host_header("http://127.0.0.1:80/b/") == "127.0.0.1"
    assert host_header("https://h.example:8443/") == "h.example:8443"
    assert host_header("http://[::1]:7480/b/") == "[::1]:7480"
    with pytest.raises(ValueError, match="cannot sign"):
        PresignedGetSigner("ftp://host/b/", "us-east-1", None)
    with pytest.raises(ValueError, match="cannot sign"):
        PresignedGetSigner("http://host/b/?x=1", "us-east-1", None)


def test_a_store_presigns_gets_its_server_takes(s3):
    """A store's presigned GET reads the object from a real S3 server; on Ceph RGW, which
    checks signatures, one altered byte of the signature is refused."""
    store = open_store(s3.url("p"), endpoint_url=s3.endpoint)
    key = "objects/ab/some key~1.kvc"
    store.put(key, b"the object's bytes")
    url = store.presigned_get(key)
    assert url is not None and "X-Amz-Signature=" in url
    assert quote(key, safe="/~") in url
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.read() == b"the object's bytes"
    if s3.server == "ceph":  # moto takes any signature
        sig = url[-1]
        altered = url[:-1] + ("0" if sig != "0" else "1")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(altered, timeout=10)
        assert refused.value.code == 403
