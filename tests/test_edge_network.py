"""The delivery network: S3 clients through edges, warming, placement, SDK failover.

Edges are real processes in front of moto's S3 server; the document is a real
publication of the sed manual by the embedded model.
"""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvcdn.errors import StoreError
from kvcdn.keys import manifest_key
from kvcdn.sdk import load_context
from kvcdn.sdk.edges import EdgeStore, plan_warm, rendezvous
from tests.cli_json import parsed
from tests.edge_helpers import EdgeProcess, MotoOrigin, get, post_json

PREFIX = "kv"
LEVELS = "fp16,int8"


@pytest.fixture(scope="module")
def published(moto_endpoint, model, short_text):
    """The sed manual's first ~700 tokens, published to a fresh moto bucket."""
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    o = MotoOrigin(moto_endpoint, PREFIX)
    store = open_store(o.url, endpoint_url=moto_endpoint)
    result = publish(text=short_text, name="sed-intro", model=model, store=store, levels=LEVELS)
    from kvcdn.catalog import read_manifest

    o.store = store
    o.manifest = read_manifest(store, result.name, result.version)
    yield o
    o.stop_recording()


def _wait_job(edge: EdgeProcess, job: dict, headers: dict[str, str]) -> dict:
    deadline = time.monotonic() + 60
    while job["state"] == "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        status, _, body = get(f"{edge.url}/warm/{job['id']}", headers)
        assert status == 200
        job = json.loads(body)
    return job


# ---- S3 clients ------------------------------------------------------------------


def test_s3fs_and_boto3_read_kvcdn_objects_through_an_edge(published, tmp_path):
    import boto3
    import botocore.exceptions
    import s3fs

    node = EdgeProcess(published.url, tmp_path / "cache", published.endpoint).start()
    try:
        manifest = published.manifest
        fs = s3fs.S3FileSystem(
            anon=True,
            client_kwargs={"endpoint_url": node.url, "region_name": "us-east-1"},
            use_listings_cache=False,
            skip_instance_cache=True,
        )
        base = f"{published.bucket}/{PREFIX}"
        raw = fs.cat_file(f"{base}/{manifest_key(manifest.name, manifest.version)}")
        assert json.loads(raw)["document"]["name"] == "sed-intro"
        ref = manifest.chunks[1].objects["int8"]
        data = fs.cat_file(f"{base}/{ref.key}")
        assert len(data) == ref.bytes and hashlib.sha256(data).hexdigest() == ref.sha256
        with fs.open(f"{base}/{ref.key}", "rb", block_size=1 << 16) as f:  # ranged, If-Match
            f.seek(1000)
            assert f.read(5000) == data[1000:6000]
        assert fs.info(f"{base}/{ref.key}")["size"] == ref.bytes
        assert fs.ls(f"{base}/docs/", detail=False) == [f"{base}/docs/sed-intro"]
        with pytest.raises(FileNotFoundError):
            fs.cat_file(f"{base}/docs/sed-intro/versions/000099.json")

        s3 = boto3.client("s3", endpoint_url=node.url, region_name="us-east-1")
        direct = published.client.list_objects_v2(Bucket=published.bucket, Prefix=f"{PREFIX}/")
        expected = {o["Key"]: o["Size"] for o in direct["Contents"]}
        listed: dict[str, int] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=published.bucket, Prefix=f"{PREFIX}/", PaginationConfig={"PageSize": 3}
        ):
            assert page["KeyCount"] <= 3
            listed.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        assert listed == expected  # every kvcdn key, with its size, over several pages
        head = s3.head_object(Bucket=published.bucket, Key=f"{PREFIX}/{ref.key}")
        assert head["ContentLength"] == ref.bytes
        with pytest.raises(botocore.exceptions.ClientError) as missing:
            s3.get_object(Bucket=published.bucket, Key=f"{PREFIX}/objects/ab/nothing.kvc")
        assert missing.value.response["Error"]["Code"] == "NoSuchKey"
        with pytest.raises(botocore.exceptions.ClientError) as other:
            s3.head_bucket(Bucket="another-bucket")
        assert other.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    finally:
        node.kill()


# ---- warming ---------------------------------------------------------------------


def test_warm_fetches_each_object_once_in_the_background_and_is_idempotent(published, tmp_path):
    admin = tmp_path / "admin"
    admin.write_text("admin-secret\n")
    node = EdgeProcess(
        published.url, tmp_path / "cache", published.endpoint, "--admin-token-file", str(admin)
    ).start()
    try:
        keys = [ref.key for chunk in published.manifest.chunks for ref in chunk.objects.values()]
        headers = {"Authorization": "Bearer admin-secret"}
        assert post_json(f"{node.url}/warm", {"keys": keys})[0] == 401
        bad = post_json(f"{node.url}/warm", {"keys": ["../../etc/passwd"]}, headers)
        assert bad[0] == 400 and "not kvcdn keys" in bad[1]
        assert post_json(f"{node.url}/warm", {"nothing": 1}, headers)[0] == 400

        published.start_recording()
        status, job = post_json(f"{node.url}/warm", {"keys": keys}, headers)
        assert status == 202 and job["total"] == len(keys)
        again_status, again = post_json(f"{node.url}/warm", {"keys": keys}, headers)
        assert again["id"] == job["id"]  # the same keys are the same job
        job = _wait_job(node, job, headers)
        if again_status == 200:  # it found the first run still running, and joined it
            assert (job["state"], job["fetched"], job["failed"]) == ("done", len(keys), 0)
            assert job["bytes_fetched"] == sum(
                ref.bytes for chunk in published.manifest.chunks for ref in chunk.objects.values()
            )
        else:  # the first run had finished: a second run found everything cached
            assert again_status == 202
            assert (job["state"], job["cached"], job["failed"]) == ("done", len(keys), 0)
        assert all(published.origin_gets(k) == 1 for k in keys)  # counted by the origin

        status, rerun = post_json(f"{node.url}/warm", {"keys": keys}, headers)
        rerun = _wait_job(node, rerun, headers)
        assert (rerun["cached"], rerun["fetched"]) == (len(keys), 0)
        assert all(published.origin_gets(k) == 1 for k in keys)  # nothing fetched again
        m = node.metrics()
        assert m["kvcdn_edge_cache_objects"] == len(keys)
    finally:
        node.kill()


def test_kvcdn_warm_places_documents_where_the_sdk_reads_them(published, model, tmp_path):
    nodes = [
        EdgeProcess(published.url, tmp_path / f"cache{i}", published.endpoint).start()
        for i in range(3)
    ]
    try:
        urls = [n.url for n in nodes]
        cmd = [sys.executable, "-m", "kvcdn.cli.main", "warm", "sed-intro", "--levels", "int8"]
        for url in urls:
            cmd += ["--edge", url]
        cmd += ["--store", published.url, "--endpoint-url", published.endpoint, "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        report = parsed("warm", done.stdout)
        assert report["ok"]
        home = rendezvous(urls, published.manifest.chain_hash)[0]
        (row,) = [r for r in report["edges"] if r["documents"]]
        assert row["edge"] == home and row["failed"] == 0
        assert row["fetched"] + row["cached"] == row["objects"]

        before = {n.url: n.metrics() for n in nodes}
        ref = f"sed-intro@{published.manifest.version}"  # no pointer read: all warmed
        ctx = load_context(ref, model=model, edges=urls, quality="int8")
        assert ctx.plan.chunk_sources == [home] * len(published.manifest.chunks)
        after = {n.url: n.metrics() for n in nodes}
        # every chunk object was a hit on its edge: warming put it where the SDK looked
        new_misses = (
            after[home]["kvcdn_edge_misses_total"] - before[home]["kvcdn_edge_misses_total"]
        )
        assert new_misses == 0
        assert after[home]["kvcdn_edge_hits_total"] - before[home]["kvcdn_edge_hits_total"] >= len(
            published.manifest.chunks
        )

        bad = subprocess.run(
            [*cmd[:5], "--levels", "nonexistent", "--edge", urls[0], "--store", published.url,
             "--endpoint-url", published.endpoint],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and "no stored level nonexistent" in bad.stderr
        assert "Traceback" not in bad.stderr
    finally:
        for n in nodes:
            n.kill()


# ---- placement and failover ------------------------------------------------------


def test_rendezvous_moves_only_the_new_edges_share():
    edges = [f"http://edge-{i}:8080" for i in range(4)]
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4000)]
    before = {k: rendezvous(edges, k)[0] for k in keys}
    after = {k: rendezvous([*edges, "http://edge-4:8080"], k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "http://edge-4:8080" for k in moved)  # only to the new edge
    assert 0.15 < len(moved) / len(keys) < 0.25  # about 1/5 of the keys
    counts = [list(before.values()).count(e) / len(keys) for e in edges]
    assert all(0.2 < c < 0.3 for c in counts)  # spread evenly
    assert rendezvous(edges, keys[0]) == rendezvous(list(reversed(edges)), keys[0])


def test_plan_warm_keeps_a_documents_objects_together(published):
    edges = ["http://a:1", "http://b:1", "http://c:1"]
    plan = plan_warm([published.manifest], edges, ["int8"], replicas=2)
    holders = [p.edge for p in plan if p.documents]
    assert holders == sorted(rendezvous(edges, published.manifest.chain_hash)[:2], key=edges.index)
    for p in plan:
        if p.documents:
            objects = [k for k in p.keys if k.startswith("objects/")]
            assert len(objects) == len(published.manifest.chunks)


def test_sdk_fails_over_to_the_next_edge_then_to_the_origin(published, model, tmp_path):
    a = EdgeProcess(published.url, tmp_path / "a", published.endpoint).start()
    b = EdgeProcess(published.url, tmp_path / "b", published.endpoint).start()
    try:
        edges = [a.url, b.url]
        first, second = rendezvous(edges, published.manifest.chain_hash)
        chunks = len(published.manifest.chunks)
        reference = load_context("sed-intro", model=model, store=published.store, quality="int8")

        ctx = load_context("sed-intro", model=model, edges=edges, quality="int8")
        assert ctx.plan.chunk_sources == [first] * chunks

        # The preferred edge answers 502 (its origin is gone): the next edge serves.
        home = a if first == a.url else b
        home.kill()
        broken = EdgeProcess(
            "http://127.0.0.1:9", tmp_path / "broken", None, port=home.port
        ).start()
        try:
            ctx = load_context("sed-intro", model=model, edges=edges, quality="int8")
            assert ctx.plan.chunk_sources == [second] * chunks
        finally:
            broken.kill()

        # The preferred edge is gone altogether: the next edge serves.
        ctx = load_context("sed-intro", model=model, edges=edges, quality="int8")
        assert ctx.plan.chunk_sources == [second] * chunks
        assert _same_cache(ctx, reference)

        # No edge answers: the origin serves, when the SDK has one.
        (b if home is a else a).kill()
        ctx = load_context(
            "sed-intro", model=model, edges=edges, store=published.store, quality="int8"
        )
        assert ctx.plan.chunk_sources == ["origin"] * chunks
        assert _same_cache(ctx, reference)
        with pytest.raises(StoreError, match="no edge could serve"):
            load_context("sed-intro", model=model, edges=edges, quality="int8")
    finally:
        a.kill()
        b.kill()


def test_sdk_fails_over_when_an_edge_hangs(published, model, tmp_path):
    """An edge that accepts connections and never answers costs one read timeout."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel accepts; nobody ever reads or answers
    hung = f"http://127.0.0.1:{silent.getsockname()[1]}"
    node = EdgeProcess(published.url, tmp_path / "ok", published.endpoint).start()
    try:
        reader = EdgeStore([hung, node.url], read_timeout_s=0.5)
        started = time.monotonic()
        ctx = load_context("sed-intro", model=model, store=reader, quality="int8")
        assert set(ctx.plan.chunk_sources) == {node.url}
        assert time.monotonic() - started < 10
    finally:
        node.kill(signal.SIGTERM)
        silent.close()


def _same_cache(ctx, reference) -> bool:
    import torch

    return all(
        torch.equal(ctx.cache.layers[i].keys, reference.cache.layers[i].keys)
        and torch.equal(ctx.cache.layers[i].values, reference.cache.layers[i].values)
        for i in range(len(reference.cache.layers))
    )


def test_tiered_edges_fetch_from_the_parent_once(published, tmp_path):
    token = tmp_path / "token"
    token.write_text("read-token\n")
    auth = {"Authorization": "Bearer read-token"}
    parent = EdgeProcess(
        published.url, tmp_path / "parent", published.endpoint, "--token-file", str(token)
    ).start()
    children = [  # their own origin is dead: what they serve came through the parent
        EdgeProcess(
            "http://127.0.0.1:9",
            tmp_path / f"child{i}",
            None,
            "--bucket",
            published.bucket,
            "--parent",
            parent.url,
            "--token-file",
            str(token),
        ).start()
        for i in range(2)
    ]
    try:
        ref = published.manifest.chunks[0].objects["fp16"]
        published.start_recording()
        for child in children:
            status, _, body = get(f"{child.url}/{ref.key}", auth)
            assert status == 200 and hashlib.sha256(body).hexdigest() == ref.sha256
        assert published.origin_gets(ref.key) == 1  # the parent fetched it once for both
        pm = parent.metrics()
        assert pm["kvcdn_edge_misses_total"] == 1
        # the second child's request found the object cached, or still being written
        assert pm["kvcdn_edge_hits_total"] + pm["kvcdn_edge_coalesced_waiters_total"] == 1
        # Listings pass through the parent too (GET /?list-type=2 at its root).
        status, _, body = get(
            f"{children[0].url}/{published.bucket}?list-type=2&prefix=docs/", auth
        )
        assert status == 200 and b"<Key>docs/sed-intro/latest.json</Key>" in body
    finally:
        for node in (*children, parent):
            node.kill()
