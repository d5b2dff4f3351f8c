"""The same pipeline over real S3 HTTP endpoints: moto, and Ceph RGW where installed."""

from __future__ import annotations

import time
import uuid

import boto3
import pytest

from kvcdn import sdk
from kvcdn.errors import NotFound, StoreError
from kvcdn.keys import latest_key, manifest_key
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.edge_helpers import (
    EdgeProcess,
    MisbehavingPresignedGets,
    RefusingQuerySignatures,
    chunk_object,
    get,
    recorded_gets,
    start_recording,
    stop_recording,
)


def test_store_primitives(s3):
    store = open_store(s3.url("p"), endpoint_url=s3.endpoint)
    store.put("a/b", b"one")
    assert store.get("a/b") == b"one"
    assert store.put_new("a/c", b"first") is True
    assert store.put_new("a/c", b"second") is False  # If-None-Match: * was honoured
    assert store.get("a/c") == b"first"
    assert store.list("a/") == ["a/b", "a/c"]
    with pytest.raises(NotFound):
        store.get("a/missing")


def test_publish_and_load_over_s3(s3, model, short_text, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # the standard AWS variable
    url = s3.url()
    first = publish(text=short_text, name="sed-intro", model=model, store=url, levels="fp16,int8")
    keys = {o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]}
    assert f"kv/{manifest_key('sed-intro', 1)}" in keys
    assert f"kv/{latest_key('sed-intro')}" in keys
    assert sum(k.endswith(".kvc") for k in keys) == first.chunks * 2
    ctx = sdk.load_context("sed-intro", store=url, model=model, quality="fp16")
    local = sdk.load_context(short_text, store=url, model=model, quality="fp16")
    assert ctx.token_ids == local.token_ids
    assert ctx.plan.bytes == first.level_bytes["fp16"]
    again = publish(text=short_text, name="sed-intro", model=model, store=url, levels="fp16,int8")
    assert again.unchanged and again.uploaded_objects == 0


def test_missing_bucket_is_reported(s3):
    with pytest.raises(NotFound, match="bucket 'no-such-bucket-kvcdn' does not exist"):
        open_store("s3://no-such-bucket-kvcdn/x", endpoint_url=s3.endpoint)


def test_unreachable_endpoint_is_reported():
    from tests.conftest import free_port

    with pytest.raises(StoreError, match="failed"):
        open_store("s3://bucket/x", endpoint_url=f"http://127.0.0.1:{free_port()}")


@pytest.mark.ceph
def test_bad_credentials_are_reported(ceph_endpoint, monkeypatch):
    import boto3

    boto3.client(
        "s3",
        endpoint_url=ceph_endpoint.endpoint,
        region_name="us-east-1",
        aws_access_key_id=ceph_endpoint.access_key,
        aws_secret_access_key=ceph_endpoint.secret_key,
    ).create_bucket(Bucket="kvcdn-auth")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ceph_endpoint.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(StoreError, match="access denied|credentials|SignatureDoesNotMatch"):
        open_store("s3://kvcdn-auth/x", endpoint_url=ceph_endpoint.endpoint)


def test_an_edge_reads_a_miss_with_one_presigned_get(s3, tmp_path):
    """An edge's miss is one query-signed GET made on its own event loop (not through
    s3fs's threads), on moto and on Ceph RGW, and the signature never reaches its log."""
    objects = dict(chunk_object(seed) for seed in (41, 42))
    for key, data in objects.items():
        s3.client.put_object(Bucket=s3.bucket, Key=f"kv/{key}", Body=data)
    if s3.server == "moto":
        start_recording(s3.endpoint)
    edge = EdgeProcess(s3.url(), tmp_path / "cache", s3.endpoint).start()
    try:
        for key, data in objects.items():
            assert get(f"{edge.url}/{key}")[2] == data
        assert edge.metrics()["kvcdn_edge_origin_errors_total"] == 0
        if s3.server == "moto":
            got = [u for u in recorded_gets(s3.endpoint) if f"/{s3.bucket}/kv/" in u]
            stop_recording(s3.endpoint)
            assert len(got) == len(objects)
            assert all("X-Amz-Signature=" in u and "X-Amz-Expires=900" in u for u in got)
    finally:
        edge.kill()
    output = edge.output()
    assert "store's client" not in output  # presigning was never given up
    assert "X-Amz-Signature" not in output and "X-Amz-Credential" not in output


@pytest.mark.parametrize("status", [403, 307])
def test_an_edge_whose_store_refuses_presigned_gets_reads_through_the_store_client(
    moto_endpoint, tmp_path, status
):
    """A store that refuses query signatures (403), or redirects them elsewhere (307,
    never followed), costs one refused GET: that miss is read again through the
    store's client, and so is every later one."""
    objects = dict(chunk_object(seed) for seed in (43, 44, 45))
    url = _bucket_of(moto_endpoint, objects)
    with RefusingQuerySignatures(moto_endpoint, status) as store:
        edge = EdgeProcess(url, tmp_path / "cache", store.url).start()
        try:
            for key, data in objects.items():
                assert get(f"{edge.url}/{key}")[2] == data
            assert store.refused == 1 and store.followed == 0
            assert edge.metrics()["kvcdn_edge_origin_errors_total"] == 0
        finally:
            edge.kill()
    output = edge.output()
    assert output.count("through the store's client from now on") == 1
    assert "X-Amz-Signature" not in output


@pytest.mark.parametrize("mode", ["endless", "extra"])
def test_presigned_answers_the_edge_cannot_take_whole_still_serve_the_object(
    moto_endpoint, tmp_path, mode
):
    """``endless``: a 200 whose body has no length (chunked, never ending) is not read
    at all on the edge's own loop; that miss is read through the store's client, which
    gets the object. ``extra``: the object, then bytes past its ``Content-Length``: the
    object (its announced bytes, verified) is served, and the connection is not used
    again. Either way the next miss is a presigned GET again, on a new connection."""
    objects = dict(chunk_object(seed) for seed in ((51, 52) if mode == "endless" else (53, 54)))
    url = _bucket_of(moto_endpoint, objects)
    (first, first_data), (second, second_data) = objects.items()
    with MisbehavingPresignedGets(moto_endpoint, mode) as store:
        edge = EdgeProcess(url, tmp_path / "cache", store.url).start()
        try:
            assert get(f"{edge.url}/{first}")[2] == first_data
            assert store.signed_gets == 1
            store.mode = "idle-close"
            assert get(f"{edge.url}/{second}")[2] == second_data
            assert store.signed_gets == 2 and store.connections == 2
            assert edge.metrics()["kvcdn_edge_origin_errors_total"] == 0
        finally:
            edge.kill()
    output = edge.output()
    assert "from now on" not in output  # presigned GETs were not given up
    assert "X-Amz-Signature" not in output


def _bucket_of(moto_endpoint: str, objects: dict[str, bytes]) -> str:
    """A new bucket on moto holding ``objects`` under ``kv/``; its ``s3://`` URL."""
    bucket = f"kvcdn-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=f"kv/{key}", Body=data)
    return f"s3://{bucket}/kv"


def test_an_edge_keeps_store_connections_and_redials_one_the_store_closed(moto_endpoint, tmp_path):
    """Misses one after another share one kept-alive connection to the store; one the
    store closed while it sat idle is dialled again, and the miss is served, not
    failed."""
    objects = dict(chunk_object(seed) for seed in (46, 47, 48, 49))
    url = _bucket_of(moto_endpoint, objects)
    with MisbehavingPresignedGets(moto_endpoint, "idle-close", keepalive_timeout=0.5) as store:
        edge = EdgeProcess(url, tmp_path / "cache", store.url).start()
        try:
            keys = list(objects)
            for key in keys[:3]:
                assert get(f"{edge.url}/{key}")[2] == objects[key]
            assert store.signed_gets == 3 and store.connections == 1
            time.sleep(1.5)  # the store closes the idle connection
            assert get(f"{edge.url}/{keys[3]}")[2] == objects[keys[3]]
            assert store.signed_gets == 4 and store.connections == 2
            assert edge.metrics()["kvcdn_edge_origin_errors_total"] == 0
        finally:
            edge.kill()


@pytest.mark.parametrize(
    ("mode", "status", "timeout_s"),
    [("too-long", 502, 120), ("short", 502, 120), ("hang", 504, 2)],
)
def test_presigned_gets_that_never_end_are_given_up(
    moto_endpoint, tmp_path, mode, status, timeout_s
):
    """A store whose GET announces a body past the object's limit, sends less than it
    announced, or never answers: the miss fails (502 at once for the length, and for
    a short body; 504 at the origin timeout), nothing is cached, no spool is left, and
    the edge serves the next miss from a store that answers. (The timeout is long
    where the length, not the clock, must stop the miss, even on a busy machine.)"""
    key, data = chunk_object(50)
    url = _bucket_of(moto_endpoint, {key: data})
    with MisbehavingPresignedGets(moto_endpoint, mode) as store:
        edge = EdgeProcess(url, tmp_path / "cache", store.url, "--origin-timeout",
                           str(timeout_s)).start()  # fmt: skip
        try:
            start = time.monotonic()
            assert get(f"{edge.url}/{key}")[0] == status
            assert time.monotonic() - start < (timeout_s if status == 504 else 0) + 8
            assert edge.metrics()["kvcdn_edge_cache_objects"] == 0
            assert not [p for p in (tmp_path / "cache").rglob(".*") if p.is_file()]
            store.mode = "idle-close"  # the store recovers: the same key is served
            assert get(f"{edge.url}/{key}")[2] == data
        finally:
            edge.kill()
    assert "X-Amz-Signature" not in edge.output()
