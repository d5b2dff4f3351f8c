"""Incremental publishing: a new version prefills only from its first changed token,
after the unchanged prefix's KV read back from the store, and falls back to a full
prefill (saying why) when that KV cannot be used.

The real model on real man pages; the tolerance checked here is the one
docs/incremental.md states.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcdn import sdk
from kvcdn.catalog import read_manifest
from kvcdn.codec import decode_chunk
from kvcdn.keys import manifest_key
from kvcdn.publish import publish
from kvcdn.store import open_store

#: Relative error (Frobenius) of the new chunks' KV, continued after a prefix read
#: back at fp16, against a full prefill's: docs/incremental.md.
FP16_PREFIX_REL_ERR = 1e-3
QUESTION = "Which option makes sed edit files in place?"


def _edited(sed_text: str, chars: int = 6000) -> tuple[str, str]:
    """A document of about 1,500 tokens (of ``chars`` characters), and the same with its
    last tenth rewritten."""
    doc = sed_text[:chars]
    cut = int(len(doc) * 0.9)
    return doc, doc[:cut] + sed_text[9000 : 9000 + len(doc) - cut]


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_an_edited_tail_prefills_only_what_changed(tmp_path, model, sed_text):
    store = open_store(str(tmp_path / "store"))
    doc, edited = _edited(sed_text)
    first = publish(text=doc, name="sed", model=model, store=store, levels="fp16,int8")
    assert first.prefilled_tokens == first.token_count and first.prefix_from is None

    second = publish(text=edited, name="sed", model=model, store=store, levels="fp16,int8")
    old_ids, new_ids = model.document_ids(doc), model.document_ids(edited)
    unchanged = _same_prefix(old_ids, new_ids)
    assert second.version == 2 and second.prefix_from == "sed@1 fp16"
    assert second.prefilled_tokens == len(new_ids) - unchanged  # counted tokens
    assert second.prefilled_tokens < len(new_ids) // 4
    assert second.full_prefill_reason is None
    # only the chunks from the first changed token on were encoded and uploaded
    v1, v2 = read_manifest(store, "sed", 1), read_manifest(store, "sed", 2)
    kept = unchanged // v2.chunk_tokens
    assert [c.objects for c in v2.chunks[:kept]] == [c.objects for c in v1.chunks[:kept]]
    assert second.uploaded_objects == 2 * (len(v2.chunks) - kept)

    # the new chunks' KV against a full prefill of the new version
    exact = model.prefill(new_ids)
    for chunk in v2.chunks[kept:]:
        ref = chunk.objects["fp16"]
        _, kv = decode_chunk(store.get(ref.key, check=ref.check))
        want = exact[:, :, :, chunk.start : chunk.end]
        err = float((kv.float() - want).norm() / want.norm())
        assert err < FP16_PREFIX_REL_ERR, (chunk.index, err)

    # and the answer from it is the answer after a full prefill
    ctx = sdk.load_context("sed", model=model, store=store, quality="fp16")
    assert ctx.token_ids == new_ids
    answer = ctx.generate(QUESTION, max_new_tokens=24)
    assert answer.token_ids == ctx.answer_with_prefill(QUESTION, max_new_tokens=24).token_ids


def test_a_prefix_read_at_a_lossy_level(tmp_path, model, sed_text):
    store = open_store(str(tmp_path / "store"))
    doc, edited = _edited(sed_text)
    publish(text=doc, name="sed", model=model, store=store, levels="int8")
    second = publish(text=edited, name="sed", model=model, store=store, levels="int8")
    assert second.prefix_from == "sed@1 int8"
    ctx = sdk.load_context("sed", model=model, store=store, quality="int8")
    answer = ctx.generate(QUESTION, max_new_tokens=24)
    exact = ctx.answer_with_prefill(QUESTION, max_new_tokens=24)
    assert answer.token_ids[0] == exact.token_ids[0]


def test_what_cannot_be_continued_is_prefilled_whole_and_says_why(tmp_path, model, sed_text):
    doc, edited = _edited(sed_text, 3000)  # ~700 tokens: a prefix chunk and the edited one
    n_tokens = len(model.document_ids(edited))

    # a level the unchanged chunks lack
    store = open_store(str(tmp_path / "levels"))
    publish(text=doc, name="sed", model=model, store=store, levels="int8")
    r = publish(text=edited, name="sed", model=model, store=store, levels="int8,fp16")
    assert r.prefix_from is None and "lack a level" in r.full_prefill_reason
    assert r.prefilled_tokens == n_tokens

    # a prefix less exact than a level asked for: the chunk holding the edit would be
    # re-encoded at fp16 from int8-rounded KV
    store = open_store(str(tmp_path / "exact"))
    short = sed_text[:700]
    publish(text=short, name="sed", model=model, store=store, levels="int8")
    r = publish(text=short + " And more.", name="sed", model=model, store=store, levels="fp16")
    assert r.prefix_from is None and "less exact than fp16" in r.full_prefill_reason

    # a stored object that fails its check: prefilled whole, and the object stored anew
    store = open_store(str(tmp_path / "damaged"))
    publish(text=doc, name="sed", model=model, store=store, levels="fp16")
    ref = read_manifest(store, "sed").chunks[0].objects["fp16"]
    damaged = bytearray(store.get(ref.key))
    damaged[-1] ^= 1
    store.put(ref.key, bytes(damaged))
    r = publish(text=edited, name="sed", model=model, store=store, levels="fp16")
    assert r.prefix_from is None and "cannot be used" in r.full_prefill_reason
    assert r.prefilled_tokens == n_tokens
    store.get(ref.key, check=ref.check)  # whole again
    ctx = sdk.load_context("sed", model=model, store=store, quality="fp16")
    assert set(ctx.plan.chunk_levels) == {"fp16"}

    # the previous version is another model's KV
    store = open_store(str(tmp_path / "model"))
    publish(text=doc, name="sed", model=model, store=store, levels="fp16")
    m = read_manifest(store, "sed")
    other = dataclasses.replace(m, model_fingerprint="0" * 64, model_name="another-model")
    store.put(manifest_key("sed", 1), other.dumps())
    r = publish(text=edited, name="sed", model=model, store=store, levels="fp16")
    assert r.prefix_from is None and "another model" in r.full_prefill_reason
    assert r.prefilled_tokens == n_tokens

    # a manifest whose tokens are not the ones its chunk hashes chain: its objects
    # could hold another text's KV
    store = open_store(str(tmp_path / "forged"))
    publish(text=doc, name="sed", model=model, store=store, levels="fp16")
    m = read_manifest(store, "sed")
    second = m.chunks[1]
    forged = dataclasses.replace(second, tokens=[*second.tokens[:5], second.tokens[5] + 1,
                                                 *second.tokens[6:]])  # fmt: skip
    chunks = [m.chunks[0], forged, *m.chunks[2:]]
    store.put(manifest_key("sed", 1), dataclasses.replace(m, chunks=chunks).dumps())
    r = publish(text=edited, name="sed", model=model, store=store, levels="fp16")
    assert r.prefix_from is None and "do not follow from its tokens" in r.full_prefill_reason

    # asked for
    store = open_store(str(tmp_path / "asked"))
    publish(text=doc, name="sed", model=model, store=store, levels="fp16")
    r = publish(text=edited, name="sed", model=model, store=store, levels="fp16",
                incremental=False)  # fmt: skip
    assert r.prefix_from is None and r.prefilled_tokens == n_tokens


@pytest.mark.parametrize("change", ["cut", "grown"])
def test_cut_or_grown_documents(tmp_path, model, sed_text, change):
    store = open_store(str(tmp_path / "store"))
    doc = sed_text[:4000]
    publish(text=doc, name="sed", model=model, store=store, levels="fp16")
    new = doc[:3000] if change == "cut" else doc + sed_text[4000:4600]
    r = publish(text=new, name="sed", model=model, store=store, levels="fp16")
    ids = model.document_ids(new)
    assert r.prefix_from == "sed@1 fp16"
    assert r.prefilled_tokens == len(ids) - _same_prefix(model.document_ids(doc), ids)
    ctx = sdk.load_context("sed", model=model, store=store, quality="fp16")
    assert (
        ctx.generate(QUESTION, max_new_tokens=8).token_ids
        == ctx.answer_with_prefill(QUESTION, max_new_tokens=8).token_ids
    )
