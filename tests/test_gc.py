"""`kvcdn rm` and `kvcdn gc` on a local folder, moto and Ceph RGW: exactly the
unreferenced objects are freed, and a publish running beside gc stays readable.

Documents are published for real (the embedded model, int8 and fp16 levels);
times are the store's own, so the grace period is exercised by waiting past it.
"""

from __future__ import annotations

import time

import pytest

from kvcdn import sdk
from kvcdn.catalog import find_by_prefix, find_by_source, read_manifest, read_pointer, versions
from kvcdn.document import source_digest
from kvcdn.errors import InputError, NotFound
from kvcdn.gc import ReferencesUnknown, collect, remove
from kvcdn.keys import latest_key, parse_key, prefix_index_key, source_index_key
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.conftest import all_intact

LEVELS = "int8,fp16"
LADDER = "default,fp16"  # a ladder level: the store holds the model's codec profile too
#: S3 stamps modification times in whole seconds: a grace period of a few of them,
#: and waits past it, keep the tests exact on every store.
GRACE_S = 2.0
AGED_S = GRACE_S + 1.5


def _objects(manifest) -> set[str]:
    return {ref.key for c in manifest.chunks for ref in c.objects.values()}


def _stored_objects(store) -> dict[str, int]:
    return {
        k: n for k, n in store.list_sizes("objects/").items() if parse_key(k) is not None
    }  # fmt: skip


def test_store_keys_pages_times_and_deletes(store):
    names = ["a", "a-b", "a.c", "ab", "b", "ü"]
    for n in names:
        store.put(f"docs/{n}/versions/000001.json", b"{}")
        store.put(f"docs/{n}/latest.json", b"{}")
    everything = sorted(k for k in store.list("docs/"))
    assert list(store.iter_keys("docs/")) == everything  # S3's order, on every store
    assert list(store.iter_keys("docs/a")) == [k for k in everything if k.startswith("docs/a")]
    after = "docs/a/versions/000001.json"
    assert list(store.iter_keys("docs/", after=after)) == [k for k in everything if k > after]
    assert list(store.iter_keys("docs/zz")) == []

    key = "docs/a/latest.json"
    before = store.stat(key)
    assert abs(store.now() - before.modified) < 5
    time.sleep(1.2)  # S3 times have whole seconds
    store.freshen(key)
    after_stat = store.stat(key)
    assert after_stat.modified > before.modified and after_stat.size == before.size == 2
    assert store.get(key) == b"{}"
    store.delete(key)
    store.delete(key)  # a missing key is no error
    with pytest.raises(NotFound):
        store.stat(key)
    with pytest.raises(NotFound):
        store.freshen(key)


def test_rm_then_gc_frees_exactly_what_no_version_names(store, model, sed_text):
    base = sed_text[:2600]
    publish(text=base, name="doc", model=model, store=store, levels=LADDER)
    publish(text=base[:1500] + sed_text[6000:6800], name="doc", model=model, store=store,
            levels=LADDER)  # fmt: skip
    publish(text=sed_text[9000:11000], name="other", model=model, store=store, levels=LADDER)
    v1, v2, other = (read_manifest(store, "doc", 1), read_manifest(store, "doc", 2),
                     read_manifest(store, "other"))  # fmt: skip
    assert _objects(v1) & _objects(v2)  # the unchanged first chunk is shared
    stored = _stored_objects(store)
    assert set(stored) == _objects(v1) | _objects(v2) | _objects(other)
    time.sleep(1.1)  # older than the store's current second: a grace of 0 lets them go

    # everything is named: nothing goes, however old
    assert collect(store, grace_s=0).deleted == []

    removal = remove(store, "doc", 1)
    assert removal.versions == ["doc@1"]
    assert versions(store, "doc") == [2] and read_pointer(store, "doc").version == 2
    only_v1 = _objects(v1) - _objects(v2) - _objects(other)
    assert only_v1
    # index entries that named doc@1 are gone; a reader asking by its text finds nothing
    assert find_by_source(store, model.fingerprint, v1.source_sha256) is None

    dry = collect(store, grace_s=0, dry_run=True)
    assert set(dry.deleted) == only_v1
    assert dry.freed_bytes == sum(stored[k] for k in only_v1)
    assert set(_stored_objects(store)) == set(stored)  # a dry run deletes nothing

    young = collect(store, grace_s=3600)
    assert young.deleted == [] and young.kept_young == len(only_v1)

    done = collect(store, grace_s=0)
    assert set(done.deleted) == only_v1
    assert done.freed_bytes == sum(stored[k] for k in only_v1)
    assert set(_stored_objects(store)) == set(stored) - only_v1
    assert all_intact(store, model) == 2  # doc@2 and other load, every object whole

    # the whole document: its pointer and index entries go, then its own objects
    removal = remove(store, "other")
    assert removal.versions == ["other@1"]
    assert latest_key("other") in removal.keys
    assert source_index_key(model.fingerprint, other.source_sha256) in removal.keys
    assert prefix_index_key(model.fingerprint, other.chunks[0].hash) in removal.keys
    with pytest.raises(NotFound):
        read_manifest(store, "other")
    done = collect(store, grace_s=0)
    assert set(done.deleted) == _objects(other) - _objects(v2)
    assert set(_stored_objects(store)) == _objects(v2)
    assert read_manifest(store, "doc").version == 2
    # the model's codec profile is kept: doc@2 and the model's pointer name it
    assert v2.codec_profile is not None and store.stat(v2.codec_profile.key).size > 0

    # a removed version's number is never given again
    again = publish(text=sed_text[9000:11000], name="other", model=model, store=store,
                    levels=LADDER)  # fmt: skip
    assert again.version == 2 and versions(store, "other") == [2]

    with pytest.raises(NotFound, match="has no version 7"):
        remove(store, "doc", 7)
    with pytest.raises(NotFound, match="no document named 'nothing'"):
        remove(store, "nothing")


def test_keep_removes_older_versions(store, model, sed_text):
    texts = [sed_text[:900], sed_text[:900] + sed_text[3000:3400], sed_text[5000:6000]]
    for text in texts:
        publish(text=text, name="doc", model=model, store=store, levels="int8")
    time.sleep(1.1)
    report = collect(store, keep=1, grace_s=0)
    assert report.removal.versions == ["doc@1", "doc@2"]
    assert versions(store, "doc") == [3]
    assert set(_stored_objects(store)) == _objects(read_manifest(store, "doc"))
    with pytest.raises(InputError):
        collect(store, keep=0)


def test_a_publish_beside_gc_stays_readable(store, model, short_text):
    publish(text=short_text, name="doc", model=model, store=store, levels=LEVELS)
    named = _objects(read_manifest(store, "doc"))
    remove(store, "doc")
    time.sleep(AGED_S)  # its objects are now unreferenced and older than the grace period

    # gc has chosen them all; before its first delete, the same text is published again
    # (it finds every object stored and reuses it) and completes
    republished = []

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "delete" and not republished:
            republished.append(
                publish(text=short_text, name="doc", model=model, store=store, levels=LEVELS)
            )

    report = collect(store, grace_s=GRACE_S, progress=progress)
    assert republished and republished[0].uploaded_objects == 0  # every object was reused
    assert report.kept_freshened == len(named) and report.deleted == []
    assert _objects(read_manifest(store, "doc")) == named
    assert all_intact(store, model) == 1

    # a publish held with its objects stored and its manifest not yet created: gc,
    # which sees no version naming them, keeps them because the publish freshened them
    remove(store, "doc")
    time.sleep(AGED_S)
    held = []

    def gc_while_held(stage: str, done: int, total: int) -> None:
        if stage == "upload" and done == total and not held:
            held.append(collect(store, grace_s=GRACE_S))

    publish(text=short_text, name="doc", model=model, store=store, levels=LEVELS,
            progress=gc_while_held)  # fmt: skip
    assert held[0].deleted == [] and held[0].kept_young >= len(named)
    assert all_intact(store, model) == 1
    ctx = sdk.load_context("doc", model=model, store=store, quality="int8")
    assert ctx.token_ids == model.document_ids(short_text)


def test_a_publish_reusing_a_collected_object_uploads_it_again(tmp_path, model, sed_text):
    store = open_store(str(tmp_path / "store"))
    publish(text=sed_text[:2600], name="doc", model=model, store=store, levels="int8")
    first = read_manifest(store, "doc")
    gone = first.chunks[0].objects["int8"].key
    store.delete(gone)  # as a gc that ran between this publisher's reads would
    result = publish(text=sed_text[:2600] + sed_text[5000:5600], name="doc", model=model,
                     store=store, levels="int8")  # fmt: skip
    assert result.version == 2
    assert store.stat(gone).size == first.chunks[0].objects["int8"].bytes
    assert all_intact(store, model) == 2  # doc@2 whole, and doc@1 again


def test_gc_refuses_to_guess_past_an_unreadable_manifest(tmp_path, model, short_text):
    store = open_store(str(tmp_path / "store"))
    publish(text=short_text, name="doc", model=model, store=store, levels="int8")
    store.put("docs/broken/versions/000001.json", b"{not json")
    time.sleep(0.1)
    before = _stored_objects(store)
    with pytest.raises(ReferencesUnknown, match="kvcdn rm"):
        collect(store, grace_s=0)
    assert _stored_objects(store) == before
    remove(store, "broken")  # an unreadable version can still be removed
    assert collect(store, grace_s=0).deleted == []
    assert source_digest(short_text) == read_manifest(store, "doc").source_sha256


def test_removing_the_newest_version_hands_its_index_entries_down(tmp_path, model, sed_text):
    store = open_store(str(tmp_path / "store"))
    publish(text=sed_text[:2600], name="doc", model=model, store=store, levels="int8")
    publish(text=sed_text[:2600] + sed_text[5000:5600], name="doc", model=model, store=store,
            levels="int8")  # fmt: skip
    v1 = read_manifest(store, "doc", 1)
    assert find_by_prefix(store, model.fingerprint, v1.chunks[0].hash).version == 2
    remove(store, "doc", 2)
    assert find_by_prefix(store, model.fingerprint, v1.chunks[0].hash).version == 1
    assert read_pointer(store, "doc").version == 1
    assert publish(text=sed_text[:900], name="doc", model=model, store=store,
                   levels="int8").version == 3  # fmt: skip


def test_an_unchanged_republish_restores_an_object_gone_meanwhile(tmp_path, model, short_text):
    store = open_store(str(tmp_path / "store"))
    publish(text=short_text, name="doc", model=model, store=store, levels="int8")
    ref = read_manifest(store, "doc").chunks[-1].objects["int8"]
    store.delete(ref.key)  # a gc beside the publish that made doc@1 (docs/gc.md)
    again = publish(text=short_text, name="doc", model=model, store=store, levels="int8")
    assert not again.unchanged and again.version == 2 and again.uploaded_objects == 1
    store.get(ref.key, check=ref.check)
    assert publish(text=short_text, name="doc", model=model, store=store,
                   levels="int8").unchanged  # fmt: skip


def test_gc_stops_at_a_versions_key_it_does_not_know(tmp_path, model, short_text):
    store = open_store(str(tmp_path / "store"))
    publish(text=short_text, name="doc", model=model, store=store, levels="int8")
    store.put("docs/doc/versions/v7.json", b"{}")  # a newer kvcdn's, say
    before = _stored_objects(store)
    with pytest.raises(ReferencesUnknown, match="not a manifest key"):
        collect(store, grace_s=0)
    assert _stored_objects(store) == before
