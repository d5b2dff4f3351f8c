"""Edges that cannot be poisoned, that say when their origin is gone, and S3 clients
that must sign: real edge processes in front of a real store folder of signed documents."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcdn import sdk
from kvcdn.errors import StoreError
from kvcdn.keys import latest_key, manifest_key
from kvcdn.publish import publish
from kvcdn.signing import TrustPolicy
from tests.conftest import free_port, payload, signed_store
from tests.edge_helpers import EdgeProcess, get

LEVEL = "int8"
IMMUTABLE = "public, max-age=31536000, immutable"
REVALIDATE = "public, max-age=5, must-revalidate"


@pytest.fixture(scope="module")
def pristine(model, sed_text, tmp_path_factory):
    """A store with one signed document in two versions, its trust file, and v1's pointer."""
    root, key, trust_file = signed_store(tmp_path_factory, model, [("guide", sed_text[:2000])])
    old_pointer = (root / latest_key("guide")).read_bytes()
    publish(text=sed_text[:2400], name="guide", model=model, store=str(root), levels=LEVEL,
            sign_keys=[key])  # fmt: skip
    return root, key, trust_file, old_pointer


@pytest.fixture
def origin(pristine, tmp_path):
    root, key, trust_file, old_pointer = pristine
    copy = tmp_path / "origin"
    shutil.copytree(root, copy)
    return copy, key, trust_file, old_pointer


def test_signed_manifests_are_kept_for_good_and_unsigned_ones_refused(origin, tmp_path):
    root, _, trust_file, _ = origin
    trusting = EdgeProcess(str(root), tmp_path / "a", None, "--trust", str(trust_file)).start()
    plain = EdgeProcess(str(root), tmp_path / "b", None).start()
    try:
        v1 = manifest_key("guide", 1)
        status, headers, body = get(f"{trusting.url}/{v1}")
        assert status == 200 and body == (root / v1).read_bytes()
        assert headers["Cache-Control"] == IMMUTABLE
        # The edge without trust keys cannot tell a forgery: it only revalidates.
        status, headers, _ = get(f"{plain.url}/{v1}")
        assert status == 200 and headers["Cache-Control"] == REVALIDATE

        v2 = root / manifest_key("guide", 2)
        forged = payload(v2.read_bytes())
        forged["created_at"] = "2020-01-01T00:00:00+00:00"
        v2.write_text(json.dumps(forged))  # unsigned: written by someone without the key
        status, _, body = get(f"{trusting.url}/{manifest_key('guide', 2)}")
        assert status == 502 and b"is not signed" in body
        assert trusting.metrics()["kvcdn_edge_verify_failures_total"] == 1
    finally:
        trusting.kill()
        plain.kill()


def test_the_edge_never_goes_back_to_an_older_signed_pointer(origin, tmp_path):
    root, _, trust_file, old_pointer = origin
    node = EdgeProcess(str(root), tmp_path / "cache", None, "--trust", str(trust_file),
                       "--pointer-ttl", "1").start()  # fmt: skip
    try:
        url = f"{node.url}/{latest_key('guide')}"
        status, headers, body = get(url)
        assert payload(body)["version"] == 2
        assert headers["Cache-Control"] == "public, max-age=1, must-revalidate"
        (root / latest_key("guide")).write_bytes(old_pointer)  # a replayed, validly signed v1
        time.sleep(1.2)  # the edge reuses a pointer for --pointer-ttl, then asks the origin
        assert payload(get(url)[2])["version"] == 2
        assert node.metrics()["kvcdn_edge_rollbacks_refused_total"] == 1
    finally:
        node.kill()


def test_origin_down_pointers_stale_misses_say_origin_unavailable(origin, model, tmp_path):
    root, key, trust_file, _ = origin
    node = EdgeProcess(str(root), tmp_path / "cache", None, "--trust", str(trust_file),
                       "--pointer-ttl", "1").start()  # fmt: skip
    try:
        trust = TrustPolicy([key.public])
        ctx = sdk.load_context("guide", model=model, edges=[node.url], quality=LEVEL, trust=trust)
        assert ctx.manifest.version == 2
        root.rename(root.with_name("gone"))  # the origin disappears
        time.sleep(1.2)  # past the pointer's freshness (--pointer-ttl)
        status, headers, _ = get(f"{node.url}/{latest_key('guide')}")
        assert status == 200 and headers["Warning"] == '110 - "Response is Stale"'
        # What the edge already holds still loads: the pointer stale, the rest cached.
        again = sdk.load_context("guide", model=model, edges=[node.url], quality=LEVEL, trust=trust)
        assert again.manifest.version == 2 and again.token_ids == ctx.token_ids
        # What it does not hold is "origin unavailable", never "not found".
        status, _, body = get(f"{node.url}/{latest_key('other')}")
        assert status == 502 and b"origin unavailable" in body
        with pytest.raises(StoreError, match="origin unavailable"):
            sdk.load_context("other", model=model, edges=[node.url], trust=trust)
        # After a restart the stale pointer comes from the edge's disk.
        node.kill()
        node = EdgeProcess(str(root), tmp_path / "cache", None, "--trust", str(trust_file))
        root.with_name("gone").rename(root)
        node.start()
        root.rename(root.with_name("gone"))
        status, headers, _ = get(f"{node.url}/{latest_key('guide')}")
        assert status == 200 and "Warning" in headers
    finally:
        node.kill()


def _kvcdn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    "origin_arg, message",
    [
        ("/no/such/folder", "there is no store at /no/such/folder"),
        ("ftp://host/path", "unsupported store 'ftp://host/path'"),
        ("s3://", "names no bucket"),
        ("s3:/bucket", "did you mean s3://bucket"),
    ],
)
def test_edge_serve_refuses_origins_that_cannot_work(tmp_path, origin_arg, message):
    result = _kvcdn("edge", "serve", "--origin", origin_arg, "--cache-dir", str(tmp_path / "c"),
                    "--listen", f"127.0.0.1:{free_port()}")  # fmt: skip
    assert result.returncode in (2, 4), result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_edge_serve_on_a_port_in_use(origin, tmp_path):
    root = origin[0]
    node = EdgeProcess(str(root), tmp_path / "a", None).start()
    try:
        result = _kvcdn("edge", "serve", "--origin", str(root), "--cache-dir", str(tmp_path / "b"),
                        "--listen", f"127.0.0.1:{node.port}")  # fmt: skip
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("error: cannot listen on 127.0.0.1:") and "in use" in lines[-1]
        assert "Traceback" not in result.stderr
    finally:
        node.kill()


# ---- S3 clients with keys ----------------------------------------------------------


@pytest.fixture
def s3_edge(origin, tmp_path):
    keys = tmp_path / "clients.keys"
    keys.write_text("# reader keys\nAKIDREADER reader-secret-123 team-a\n")
    node = EdgeProcess(str(origin[0]), tmp_path / "cache", None, "--s3-keys", str(keys)).start()
    yield node
    node.kill()


def _client(url: str, key: str, secret: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=url, region_name="eu-west-1",
        aws_access_key_id=key, aws_secret_access_key=secret,
        config=Config(signature_version="s3v4"),  # presigned URLs too (boto3 presigns V2)
    )  # fmt: skip


def test_s3_clients_must_sign_with_a_known_key(s3_edge, origin):
    import botocore.exceptions
    import s3fs

    root = origin[0]
    v1 = manifest_key("guide", 1)
    good = _client(s3_edge.url, "AKIDREADER", "reader-secret-123")
    assert good.get_object(Bucket="kvcdn", Key=v1)["Body"].read() == (root / v1).read_bytes()
    listed = good.list_objects_v2(Bucket="kvcdn", Prefix="docs/guide/versions/")
    assert [o["Key"] for o in listed["Contents"]] == [v1, manifest_key("guide", 2)]
    fs = s3fs.S3FileSystem(
        key="AKIDREADER", secret="reader-secret-123", skip_instance_cache=True,
        client_kwargs={"endpoint_url": s3_edge.url, "region_name": "us-east-1"},
    )  # fmt: skip
    assert fs.cat_file(f"kvcdn/{v1}") == (root / v1).read_bytes()

    for client, code in (
        (_client(s3_edge.url, "AKIDREADER", "wrong-secret-456"), "SignatureDoesNotMatch"),
        (_client(s3_edge.url, "AKIDOTHER", "reader-secret-123"), "InvalidAccessKeyId"),
    ):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            client.get_object(Bucket="kvcdn", Key=v1)
        assert refused.value.response["Error"]["Code"] == code
    status, _, body = get(f"{s3_edge.url}/kvcdn/{v1}")  # no signature at all
    assert status == 403 and b"AccessDenied" in body


def test_store_keys_need_a_signature_or_the_token_too(origin, tmp_path):
    root = origin[0]
    keys = tmp_path / "clients.keys"
    keys.write_text("AKIDREADER reader-secret-123\n")
    token = tmp_path / "read.token"
    token.write_text("sdk-token\n")
    node = EdgeProcess(str(root), tmp_path / "cache", None, "--s3-keys", str(keys),
                       "--token-file", str(token)).start()  # fmt: skip
    try:
        v1 = manifest_key("guide", 1)
        assert get(f"{node.url}/{v1}")[0] == 403  # no bearer, no signature
        assert get(f"{node.url}/{v1}", {"Authorization": "Bearer wrong"})[0] == 403
        status, _, body = get(f"{node.url}/{v1}", {"Authorization": "Bearer sdk-token"})
        assert status == 200 and body == (root / v1).read_bytes()
        client = _client(node.url, "AKIDREADER", "reader-secret-123")
        assert client.get_object(Bucket="kvcdn", Key=v1)["Body"].read() == body
    finally:
        node.kill()


def test_presigned_urls_work_until_they_expire_or_are_altered(s3_edge, origin):
    root = origin[0]
    v1 = manifest_key("guide", 1)
    client = _client(s3_edge.url, "AKIDREADER", "reader-secret-123")
    url = client.generate_presigned_url(
        "get_object", Params={"Bucket": "kvcdn", "Key": v1}, ExpiresIn=60
    )
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.read() == (root / v1).read_bytes()
    altered = url.replace(manifest_key("guide", 1), manifest_key("guide", 2))
    assert get(altered)[0] == 403
    expired = client.generate_presigned_url(
        "get_object", Params={"Bucket": "kvcdn", "Key": v1}, ExpiresIn=1
    )
    time.sleep(2)
    status, _, body = get(expired)
    assert status == 403 and b"expired" in body
    import boto3

    v2_style = boto3.client(  # boto3's default presigning on a custom endpoint: version 2
        "s3", endpoint_url=s3_edge.url, region_name="us-east-1",
        aws_access_key_id="AKIDREADER", aws_secret_access_key="reader-secret-123",
    )  # fmt: skip
    legacy = v2_style.generate_presigned_url("get_object", Params={"Bucket": "kvcdn", "Key": v1})
    status, _, body = get(legacy)
    assert status == 403 and b"Signature Version 2 is not accepted" in body


def test_a_presigned_url_dated_in_the_future_is_refused(s3_edge, monkeypatch):
    import datetime

    import botocore.auth

    client = _client(s3_edge.url, "AKIDREADER", "reader-secret-123")
    later = datetime.datetime(2036, 1, 1, tzinfo=datetime.timezone.utc)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: later)
    url = client.generate_presigned_url(
        "get_object", Params={"Bucket": "kvcdn", "Key": manifest_key("guide", 1)}, ExpiresIn=604800
    )
    status, _, body = get(url)
    assert status == 403 and b"not valid yet" in body


def test_a_parent_cannot_make_the_edge_inflate_a_bomb(origin, tmp_path):
    import psutil

    from tests.test_hostile_edge import Hostile

    root = origin[0]
    parent = Hostile(root, free_port(), "gzip-bomb")
    node = EdgeProcess(str(root), tmp_path / "cache", None, "--parent", parent.url).start()
    try:
        before = psutil.Process(node.proc.pid).memory_info().rss
        keys = [f"objects/ab/{'ab' * 32}/fp16-0123456789ab.{i:064x}.kvc" for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda k: get(f"{node.url}/{k}"), keys))
        # taken as sent, the 2 MB fail verification, and the store (asked next) has nothing
        assert all(status == 404 for status, _, _ in answers), [a[0] for a in answers]
        grown = psutil.Process(node.proc.pid).memory_info().rss - before
        assert grown < 200 << 20, f"the edge grew by {grown >> 20} MiB"
        assert node.metrics()["kvcdn_edge_verify_failures_total"] == 4
    finally:
        node.kill()
        parent.stop()


def test_a_range_of_five_thousand_digits_is_ignored_not_a_500(origin, tmp_path):
    node = EdgeProcess(str(origin[0]), tmp_path / "cache", None).start()
    try:
        url = f"{node.url}/{manifest_key('guide', 1)}"
        for spec in (f"bytes={'9' * 5000}-", f"bytes=-{'9' * 5000}"):
            status, _, body = get(url, {"Range": spec})
            assert status == 200 and body == (origin[0] / manifest_key("guide", 1)).read_bytes()
    finally:
        node.kill()


def test_the_edge_never_imports_torch_even_with_trust_and_s3_keys():
    code = (
        "import sys, kvcdn.edge.server, kvcdn.edge.s3auth, kvcdn.signing, kvcdn.manifest; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=os.environ.copy())
