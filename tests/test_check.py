"""`kvcdn check`: a store verified as `git fsck` verifies a repository, on a folder, on
moto's S3 server and on Ceph RGW (where installed), with real publications."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvcdn.catalog import index_keys, read_manifest
from kvcdn.check import check_store
from kvcdn.gc import remove
from kvcdn.keys import latest_key, manifest_key
from kvcdn.manifest import pointer_bytes
from kvcdn.publish import publish
from tests.cli_json import parsed

LEVEL = "int8"


def _check(store, *args: str) -> subprocess.CompletedProcess:
    endpoint = store.fs.client_kwargs.get("endpoint_url") if store.url.startswith("s3") else None
    return subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "check", *args, "--store", store.url,
         *(["--endpoint-url", endpoint] if endpoint else []), "--json"],
        capture_output=True, text=True, timeout=300, env=os.environ.copy(),
    )  # fmt: skip


def _object_of(store, name: str, version: int, chunk: int) -> str:
    manifest = json.loads(store.get(manifest_key(name, version)))
    return manifest["chunks"][chunk]["objects"][LEVEL]["key"]


def test_check_finds_missing_and_damaged_objects_and_lists_orphans(store, model, short_text):
    publish(text=short_text, name="guide", model=model, store=store, levels=LEVEL)
    edited = short_text[:1500] + "\nAn edit.\n" + short_text[1500:]
    publish(text=edited, name="guide", model=model, store=store, levels=LEVEL)
    publish(text=short_text[::-1], name="other", model=model, store=store, levels=LEVEL)

    done = _check(store)
    assert done.returncode == 0, done.stderr
    report = parsed("check", done.stdout)
    assert report["ok"] and report["orphans"] == []
    # guide@1's text still finds guide@1 (the edit left its first chunk, and so the
    # prefix entry, to guide@2): a notice, not a failure
    first = read_manifest(store, "guide", 1)
    [old_text] = set(index_keys(first)) - set(index_keys(read_manifest(store, "guide", 2)))
    assert [(p["key"], p["kind"]) for p in report["problems"]] == [(old_text, "superseded")]
    assert "names guide@1, older than guide@2" in report["problems"][0]["detail"]
    # an entry rewritten to name a version it does not index is damage (readers refuse
    # it), and a manifest that does not read is no newer version
    [new_text] = set(index_keys(read_manifest(store, "guide", 2))) - set(index_keys(first))
    store.put(new_text, pointer_bytes("guide", 1))
    store.put(manifest_key("guide", 9), b"{}")
    done = _check(store)
    assert done.returncode == 5, done.stderr
    problems = {p["key"]: p["kind"] for p in parsed("check", done.stdout)["problems"]}
    assert problems == {new_text: "damaged", manifest_key("guide", 9): "damaged",
                        old_text: "superseded"}  # fmt: skip
    store.put(new_text, pointer_bytes("guide", 2))
    store.delete(manifest_key("guide", 9))
    assert (report["documents"], report["versions"]) == (2, 3)
    unique = {
        ref["key"]
        for name, v in (("guide", 1), ("guide", 2), ("other", 1))
        for c in json.loads(store.get(manifest_key(name, v)))["chunks"]
        for ref in c["objects"].values()
    }
    assert report["objects"] == len(unique)  # shared objects are read once

    gone = _object_of(store, "guide", 1, 0)  # the first chunk: shared by both versions
    store.delete(gone)
    damaged = _object_of(store, "other", 1, 1)
    data = bytearray(store.get(damaged))
    data[len(data) // 2] ^= 0x01
    store.put(damaged, bytes(data))
    store.put(latest_key("other"), pointer_bytes("other", 7))  # names no stored version

    done = _check(store)
    assert done.returncode == 5, done.stderr
    report = parsed("check", done.stdout)
    problems = {p["key"]: p for p in report["problems"]}
    assert problems[gone]["kind"] == "missing"
    assert problems[gone]["used_by"] == ["guide@1", "guide@2"]
    assert problems[damaged]["kind"] == "damaged" and problems[damaged]["used_by"] == ["other@1"]
    assert problems[latest_key("other")]["kind"] == "dangling"
    assert not report["ok"] and len(problems) == 4  # and the superseded entry

    # an entry the store fails on (a looping link, no permission) is reported; the rest of
    # the store is still checked
    if not store.url.startswith("s3"):
        looping = _object_of(store, "other", 1, 0)
        path = Path(store.root) / looping
        path.unlink()
        path.symlink_to(path.name)
        report = parsed("check", _check(store).stdout)
        problems = {p["key"]: p for p in report["problems"]}
        assert problems[looping]["kind"] == "unreadable" and len(problems) == 5
        assert report["objects"] == len(unique)  # every other object was read too
        path.unlink()
        store.put(looping, b"")  # republishing below restores its bytes

    # one document (or version) at a time; orphans are a whole-store matter
    only = parsed("check", _check(store, "guide@2").stdout)
    assert [p["key"] for p in only["problems"]] == [gone] and not only["whole_store"]
    unknown = _check(store, "nothing")
    assert unknown.returncode == 4 and "nothing is not in" in unknown.stderr

    # what a removed version leaves is orphaned, not damaged
    store.put(gone, b"")  # a placeholder, then the real bytes: republishing restores it
    publish(text=short_text, name="guide", model=model, store=store, levels=LEVEL)
    remove(store, "other")
    report = check_store(store)
    assert report.ok and report.exit_code == 0
    assert damaged in report.orphans and report.orphan_bytes > 0


def test_check_with_trust_refuses_what_no_trusted_key_signed(tmp_path, model, short_text):
    from kvcdn.signing import SigningKey
    from kvcdn.store import open_store

    store = open_store(str(tmp_path / "store"))
    key = SigningKey.generate("publisher")
    key.save(tmp_path / "publisher.key")
    publish(text=short_text, name="signed", model=model, store=store, levels=LEVEL,
            sign_keys=[key])  # fmt: skip
    trust = str(tmp_path / "publisher.key.pub")
    assert _check(store, "--trust", trust).returncode == 0
    publish(text=short_text[:2000], name="plain", model=model, store=store, levels=LEVEL)
    done = _check(store, "--trust", trust)
    assert done.returncode == 6, done.stderr  # all that is wrong is trust
    kinds = {p["key"]: p["kind"] for p in parsed("check", done.stdout)["problems"]}
    assert kinds == {manifest_key("plain", 1): "untrusted", latest_key("plain"): "untrusted"}
