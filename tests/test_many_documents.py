"""A store of 10,000 documents: `kvcdn ls` pages through it reading one page of keys
at a time and no manifest; gc reads every manifest once and frees exactly the orphans.

The manifests are generated (real manifests of one published document, under
other names, each naming objects of its own), so no prefill is needed; the store
is a real folder and moto's S3 server over HTTP.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from kvcdn.catalog import list_documents
from kvcdn.gc import collect
from kvcdn.keys import latest_key, manifest_key, object_key
from kvcdn.manifest import ObjectRef, pointer_bytes
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.cli_json import parsed
from tests.conftest import s3_target
from tests.test_cli import run

DOCUMENTS = 10_000
OTHERS = 50  # named outside the "man-" prefix
ORPHANS = 200  # objects no manifest names


@pytest.fixture(scope="module")
def template(model, short_text):
    """A real manifest (one int8 chunk) to clone under many names."""
    store = open_store("memory://many-documents-template")
    publish(text=short_text[:600], name="template", model=model, store=store, levels="int8")
    from kvcdn.catalog import read_manifest

    return read_manifest(store, "template")


class Generated(dict):
    """Every key of the generated store and its bytes; ``objects[(name, version)]`` is
    the object that version names, ``orphans`` the objects none names."""

    objects: dict[tuple[str, int], str]
    orphans: set[str]


def _generated(template) -> Generated:
    """Manifests (two versions for every 100th document), pointers, one real chunk
    container per version (int8 of one token: edges check what they cache), and
    orphan containers."""
    import torch

    from kvcdn.codec import FIXED_LEVELS, encode_chunk
    from kvcdn.container import pack_sections, unpack

    level = FIXED_LEVELS["int8"]
    layout = template.kv_layout
    kv = torch.zeros((layout["layers"], 2, layout["kv_heads"], 1, layout["head_dim"]))
    files = Generated()
    files.objects, files.orphans = {}, set()
    # Every container holds the same KV: encode its sections once and pack them under
    # each chunk's own header (encoding 10,000 times took a minute of the suite).
    header, body = unpack(encode_chunk(level, kv, "0" * 64))
    sections = [bytes(body.sections[i]) for i in sorted(body.sections)]

    def container(seed: bytes) -> tuple[str, ObjectRef, bytes]:
        chunk_hash = hashlib.sha256(b"chunk " + seed).hexdigest()
        data = pack_sections(dataclasses.replace(header, chunk_hash=chunk_hash), sections)
        sha = hashlib.sha256(data).hexdigest()
        return chunk_hash, ObjectRef(object_key(chunk_hash, level.id, sha), len(data), sha), data

    def version(name: str, v: int) -> None:
        chunk_hash, ref, data = container(f"{name}@{v}".encode())
        chunk = dataclasses.replace(template.chunks[0], hash=chunk_hash, objects={"int8": ref})
        m = dataclasses.replace(template, name=name, version=v, chunks=[chunk])
        files[manifest_key(name, v)] = m.dumps()
        files[ref.key] = data
        files.objects[name, v] = ref.key

    names = [f"man-{i:05d}" for i in range(DOCUMENTS)] + [f"zz-{i}" for i in range(OTHERS)]
    for i, name in enumerate(names):
        last = 2 if i % 100 == 0 else 1
        for v in range(1, last + 1):
            version(name, v)
        files[latest_key(name)] = pointer_bytes(name, last)
    for i in range(ORPHANS):
        _, ref, data = container(f"orphan {i}".encode())
        files[ref.key] = data
        files.orphans.add(ref.key)
    return files


@pytest.fixture(scope="module")
def files(template) -> Generated:
    return _generated(template)


@pytest.fixture(scope="module")
def local_many(files, tmp_path_factory):
    """The generated store as a real folder, written straight to disk (setting it up
    is not what is tested; reading it is), every file dated long ago."""
    root = tmp_path_factory.mktemp("many") / "store"
    old = 1_000_000_000  # older than any grace period
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (old, old))
    return open_store(str(root))


@pytest.fixture(scope="module")
def moto_many(files, request):
    """The generated store in a bucket of moto's S3 server, put straight into its backend."""
    from moto.s3.models import s3_backends

    for target in s3_target(request, "moto"):
        backend = next(iter(s3_backends.values()))["global"]
        for key, data in files.items():
            backend.put_object(target.bucket, f"kv/{key}", data)
        yield open_store(target.url(), endpoint_url=target.endpoint)


class _Counting:
    """Counts a store's reads of whole keys and its listing requests."""

    def __init__(self, store, monkeypatch) -> None:
        self.gets = 0
        self.list_requests = 0
        get = store.get

        def counted_get(*args, **kwargs):
            self.gets += 1
            return get(*args, **kwargs)

        monkeypatch.setattr(store, "get", counted_get)
        if hasattr(store.fs, "call_s3"):
            call = store.fs.call_s3

            def counted_call(method, *args, **kwargs):
                self.list_requests += method == "list_objects_v2"
                return call(method, *args, **kwargs)

            monkeypatch.setattr(store.fs, "call_s3", counted_call)


@pytest.mark.parametrize("where", ["local_many", "moto_many"])
def test_ls_pages_through_ten_thousand_documents(where, request, monkeypatch):
    store = request.getfixturevalue(where)
    counting = _Counting(store, monkeypatch)
    names, after, pages = [], None, 0
    while True:
        page = list_documents(store, prefix="man-", after=after, limit=1000)
        if not page:
            break
        names += [d.name for d in page]
        after, pages = page[-1].name, pages + 1
    assert names == [f"man-{i:05d}" for i in range(DOCUMENTS)]  # each once, in order
    assert pages == 10
    assert counting.gets == 0  # no manifest read
    if store.url.startswith("s3://"):
        # a page of 1,000 documents is ~2,020 keys: 3 listing requests, and one more
        # for the page that finds nothing
        assert counting.list_requests <= pages * 3 + 1

    page = list_documents(store, prefix="man-0010", limit=5)
    assert [(d.name, d.versions, d.latest) for d in page] == [
        ("man-00100", [1, 2], 2), ("man-00101", [1], 1), ("man-00102", [1], 1),
        ("man-00103", [1], 1), ("man-00104", [1], 1),
    ]  # fmt: skip
    assert [d.name for d in list_documents(store, prefix="zz-")] == sorted(
        f"zz-{i}" for i in range(OTHERS)
    )
    assert list_documents(store, prefix="nothing") == []


def test_ls_cli_pages(local_many):
    store = local_many
    args = ["ls", "man-099", "--limit", "4", "--after", "man-09990", "--store", store.url]
    result = run(*args, "--json")
    assert [d["name"] for d in parsed("ls", result.stdout)] == [
        "man-09991", "man-09992", "man-09993", "man-09994",
    ]  # fmt: skip
    shown = run(*args)
    assert "man-09994" in shown.stdout and "--after man-09994" in shown.stdout


def test_gc_over_ten_thousand_documents_frees_exactly_the_orphans(local_many, files):
    # on a folder: through moto's server, reading 10,000 manifests takes a minute here
    store = local_many
    orphans = files.orphans
    report = collect(store, grace_s=3600, dry_run=True)
    assert set(report.deleted) == orphans
    versions = [k for k in files if "/versions/" in k]
    seconds = [k for k in versions if k.endswith("/000002.json")]
    assert len(versions) == DOCUMENTS + OTHERS + len(seconds)
    assert report.manifests == len(versions)
    assert report.freed_bytes == sum(len(files[k]) for k in orphans)

    report = collect(store, keep=1, grace_s=3600)
    assert len(report.removal.versions) == len(seconds)  # the first of every pair
    removed_objects = {
        files.objects[name, int(v)] for name, v in (r.split("@") for r in report.removal.versions)
    }
    assert set(report.deleted) == orphans | removed_objects
    left = set(store.list("objects/"))
    assert left == {k for k in files if k.startswith("objects/")} - orphans - removed_objects
    assert json.loads(store.get(latest_key("man-00100")))["version"] == 2
    assert Path(store.root, manifest_key("man-00100", 1)).exists() is False


def test_warm_a_prefix_of_many_documents_through_a_real_edge(local_many, tmp_path):
    from kvcdn.catalog import read_manifest
    from kvcdn.sdk.edges import warm_edges
    from tests.edge_helpers import EdgeProcess

    edge = EdgeProcess(local_many.url, tmp_path / "cache", None).start()
    try:
        # the CLI finds the documents by listing and reads their manifests 16 at a time
        result = run("warm", "--prefix", "man-00", "--edge", edge.url, "--store", local_many.url,
                     "--json")  # fmt: skip
        assert result.returncode == 0, result.stderr
        report = parsed("warm", result.stdout)
        assert report["ok"] and len(report["edges"]) == 1
        row = report["edges"][0]
        assert len(row["documents"]) == 1000  # man-00000 .. man-00999, latest versions
        assert row["state"] == "done" and row["failed"] == 0
        assert row["objects"] == 2000 and row["fetched"] == 2000  # a manifest and an object each

        # a corpus larger than one job: one job per batch of keys, every one done
        manifests = [read_manifest(local_many, f"man-01{i:03d}") for i in range(300)]
        outcomes = warm_edges(manifests, [edge.url], batch_keys=64)
        assert len(outcomes) == -(-600 // 64)
        assert all(o.state == "done" and len(o.assignment.keys) <= 64 for o in outcomes)
        assert sum(o.job.fetched for o in outcomes) == 600
    finally:
        edge.kill()
