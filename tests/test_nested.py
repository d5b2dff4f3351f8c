"""The nested ladder codec of channels (kvcdn-nested-v1) on the embedded model's real
profile (its transform taken off): every tier as its specification says, bit for bit;
a reader of tier k fetches the base and refinements 1..k and nothing else; damage is
caught before use."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn.codec import (
    decode_chunk,
    decode_into,
    encode_chunk,
    nested_level,
    object_ref,
    read_part,
    tier_bytes,
)
from kvcdn.codec_profile import NESTED_TIERS, parse_profile
from kvcdn.codecs import TensorDest
from kvcdn.container import Part, pack_sections, parse_index, unpack
from kvcdn.errors import FormatError, IntegrityError

HASH = "cd" * 32


@pytest.fixture(scope="module")
def profile(channels_profile):
    """The codec tested here is the channels' (tests/conftest.py); the embedded profile as
    shipped is tested in tests/test_nested_transform.py."""
    return channels_profile


@pytest.fixture(scope="module")
def doc_kv(model, sed_text):
    return model.prefill(model.document_ids(sed_text)[:512]).float()


@pytest.fixture(scope="module")
def nested_object(profile, doc_kv) -> bytes:
    level = nested_level("default", profile)
    return encode_chunk(level, doc_kv[:, :, :, 256:512].contiguous(), HASH, profile=profile,
                        start=256)  # fmt: skip


def _spec_values(profile, kv: torch.Tensor, k: int) -> np.ndarray:
    """docs/format.md's definition of tier k's values, in numpy (float32 as specified)."""
    mean, fine, depth, lo, size, *_ = profile.nested_arrays()
    groups = mean.shape[0]
    x = kv.float().numpy().reshape(groups, kv.shape[3], kv.shape[4])
    top = depth[-1]
    up = 3**top
    half = (up - 1) // 2
    q = np.rint((x - mean[:, None]) / fine[:, None])
    q = np.clip(q, (lo * up - half)[:, None], ((lo + size - 1) * up + half)[:, None])
    up_k = 3 ** (top - depth[k])
    n = np.floor_divide(q.astype(np.int64) + (up_k[:, None] - 1) // 2, up_k[:, None])
    return (mean[:, None] + (n * up_k[:, None]).astype(np.float32) * fine[:, None]).astype(
        np.float32
    )


def test_every_tier_decodes_to_its_specified_values(profile, doc_kv, nested_object) -> None:
    chunk = doc_kv[:, :, :, 256:512]
    for k in range(len(NESTED_TIERS)):
        _, out = decode_chunk(nested_object, profile=profile, tiers=k + 1, chunk_hash=HASH)
        assert np.array_equal(out.numpy().reshape(-1), _spec_values(profile, chunk, k).ravel())
    # the first chunk keeps the document's sinks exact, in the base's sections only
    first = encode_chunk(nested_level("low", profile), doc_kv[:, :, :, :256].contiguous(), HASH,
                         profile=profile, start=0)  # fmt: skip
    _, out = decode_chunk(first, profile=profile, tiers=1)
    s = profile.sinks
    assert torch.equal(out[:, :, :, :s], doc_kv[:, :, :, :s].half().float())
    # the same values into every kind of place: float16 (staged), a window of a larger
    # float32 tensor (staged), a float32 tensor (written by the kernel itself)
    for k in (0, 3, len(NESTED_TIERS) - 1):
        _, whole = decode_chunk(first, profile=profile, tiers=k + 1)
        assert np.array_equal(whole[:, :, :, s:].numpy().ravel(), _spec_values(
            profile, doc_kv[:, :, :, :256], k).reshape(*whole.shape)[:, :, :, s:].ravel())
        part = Part.whole(whole.shape[0], whole.shape[2], k + 1)
        half = torch.empty(whole.shape, dtype=torch.float16)
        decode_into(first, TensorDest(half), profile=profile, part=part)
        assert torch.equal(half, whole.half())
        wide = torch.zeros(*whole.shape[:3], 300, whole.shape[4])
        decode_into(first, TensorDest(wide[:, :, :, 20:276]), profile=profile, part=part)
        assert torch.equal(wide[:, :, :, 20:276], whole) and not wide[:, :, :, :20].any()
        # bfloat16, cast by kvcdn's kernel as torch casts (a tensor, a window of a larger
        # one) or by torch (a few heads of a larger one: not one array)
        expected = whole.to(torch.bfloat16)
        brain = torch.empty(whole.shape, dtype=torch.bfloat16)
        decode_into(first, TensorDest(brain), profile=profile, part=part)
        assert torch.equal(brain.view(torch.int16), expected.view(torch.int16))
        wide = torch.zeros(*whole.shape[:3], 300, whole.shape[4], dtype=torch.bfloat16)
        decode_into(first, TensorDest(wide[:, :, :, 20:276]), profile=profile, part=part)
        assert torch.equal(wide[:, :, :, 20:276].view(torch.int16), expected.view(torch.int16))
        assert not wide[:, :, :, :20].any() and not wide[:, :, :, 276:].any()
        heads = torch.zeros(whole.shape[0], 2, 5, *whole.shape[3:], dtype=torch.bfloat16)
        decode_into(first, TensorDest(heads[:, :, 1:4]), profile=profile, part=part)
        assert torch.equal(heads[:, :, 1:4].view(torch.int16), expected.view(torch.int16))
    index = parse_index(first)
    per_tier = len(index.lengths) // index.tiers
    assert index.tiers == len(NESTED_TIERS)
    assert min(index.lengths[:per_tier]) > max(index.lengths[per_tier : 2 * per_tier]) // 4


def _without_previous_token(profile):
    """The profile as kvcdn wrote nested profiles before their tables depended on the
    previous token: one base table a stream, a refinement table per parent context
    (here each context's table for a previous symbol of 0), serialised and parsed."""
    spec = profile.nested
    old = dataclasses.replace(spec, base_table=spec.base_table[:1],
                              refine_table=spec.refine_table[:, 0::3])  # fmt: skip
    return parse_profile(dataclasses.replace(profile, nested=old).to_bytes())


def test_a_profile_without_previous_token_contexts_still_codes_as_specified(profile, doc_kv
                                                                            ) -> None:  # fmt: skip
    assert profile.nested.previous_token
    old = _without_previous_token(profile)
    assert not old.nested.previous_token and old.sha256 != profile.sha256
    chunk = doc_kv[:, :, :, 256:512].contiguous()
    data = encode_chunk(nested_level("default", old), chunk, HASH, profile=old, start=256)
    for k in range(len(NESTED_TIERS)):
        _, out = decode_chunk(data, profile=old, tiers=k + 1, chunk_hash=HASH)
        assert np.array_equal(out.numpy().reshape(-1), _spec_values(old, chunk, k).ravel())
    # the same values either way; the previous token as context makes every tier smaller
    ours = encode_chunk(nested_level("default", profile), chunk, HASH, profile=profile,
                        start=256)  # fmt: skip
    for k in range(len(NESTED_TIERS)):
        assert tier_bytes(ours, k + 1) < tier_bytes(data, k + 1), NESTED_TIERS[k]


def test_profiles_with_contexts_that_do_not_fit_are_refused(profile) -> None:
    import json
    import struct

    from safetensors.numpy import load, save

    data = profile.to_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + header_len])["__metadata__"]
    nested_meta = json.loads(meta["kvcdn"])

    def parse(arrays, contexts) -> None:
        nested_meta["nested"]["contexts"] = contexts
        parse_profile(save(arrays, metadata={"kvcdn": json.dumps(nested_meta)}))

    arrays = load(data)
    with pytest.raises(FormatError, match="nested.contexts must be"):
        parse(arrays, "next-token")
    old_shapes = dict(arrays, **{"nested.base_table": arrays["nested.base_table"][0]})
    with pytest.raises(FormatError, match="nested.base_table"):
        parse(old_shapes, "previous-token")
    # a stream whose base tables span different ranges in two contexts
    base = arrays["nested.base_table"].copy()
    lo = parse_profile(data).table_lo
    first = base[0].reshape(-1)
    other = int(np.flatnonzero(lo[base[1].reshape(-1)] != lo[first[0]])[0])
    base[1].reshape(-1)[0] = base[1].reshape(-1)[other]
    with pytest.raises(FormatError, match="same range in every context"):
        parse(dict(arrays, **{"nested.base_table": base}), "previous-token")
    # the kernels find a context's table by its offset from the first: two swapped
    refine = arrays["nested.refine_table"].copy()
    split = np.flatnonzero(refine[0, 0].reshape(-1) != refine[0, 1].reshape(-1))[0]
    first, second = (refine[0, c].reshape(-1) for c in (0, 1))
    first[split], second[split] = second[split], first[split]
    with pytest.raises(FormatError, match="must be consecutive"):
        parse(dict(arrays, **{"nested.refine_table": refine}), "previous-token")


def test_a_reader_of_tier_k_fetches_the_base_and_refinements_up_to_k_only(
    profile, nested_object, tmp_path
) -> None:
    """Counted at the store: the index, then tiers 0..k of the reader's heads; an upgrade
    from tier k to k+1 (decoding what was fetched plus refinement k+1) equals a direct
    read of tier k+1."""
    from kvcdn.store import open_store

    store = open_store(str(tmp_path / "store"))
    ref = object_ref("objects/nested", nested_object)
    store.put(ref.key, nested_object)
    index = parse_index(nested_object)
    layers, heads = 30, 3
    per_tier = layers * heads
    seen: list[int] = []
    for k in range(len(NESTED_TIERS)):
        for part in (Part((0, 30), (0, 3), k + 1), Part((0, 30), (1, 2), k + 1)):
            read = read_part(store, ref, part, name="x", on_bytes=seen.append)
            ids = part.section_ids(layers, heads, index.tiers)
            assert max(ids) < (k + 1) * per_tier
            assert read.nbytes == sum(seen) == index.size + sum(index.lengths[i] for i in ids)
            seen.clear()
            out = torch.empty(part.shape((30, 2, 3, 256, 64)))
            decode_into(read, TensorDest(out), profile=profile, part=part, chunk_hash=HASH)
            _, whole = decode_chunk(nested_object, profile=profile, tiers=k + 1)
            assert torch.equal(out, whole[:, :, part.heads[0] : part.heads[1]])
        assert tier_bytes(nested_object, k + 1) == index.size + sum(
            index.lengths[: (k + 1) * per_tier]
        )


def test_a_damaged_refinement_is_caught_and_the_tiers_below_still_load(
    profile, nested_object, tmp_path
) -> None:
    from kvcdn.store import open_store

    index = parse_index(nested_object)
    per_tier = 90
    store = open_store(str(tmp_path / "store"))
    ref = object_ref("objects/nested", nested_object)
    damaged = bytearray(nested_object)
    victim = 3 * per_tier + 40  # tier 3 ("default"), head 1, layer 10
    damaged[index.offsets[victim] + index.lengths[victim] // 2] ^= 0x10
    store.put(ref.key, bytes(damaged))
    for k in range(3):  # tiers below the damage read and decode as ever
        read = read_part(store, ref, Part((0, 30), (0, 3), k + 1), name="x")
        out = torch.empty(30, 2, 3, 256, 64)
        decode_into(read, TensorDest(out), profile=profile, part=read.part)
        _, whole = decode_chunk(nested_object, profile=profile, tiers=k + 1)
        assert torch.equal(out, whole)
    with pytest.raises(IntegrityError, match=f"section {victim}"):
        read_part(store, ref, Part((0, 30), (0, 3), 4), name="x")
    # a publisher that wrote bad refinement words itself: sha256s agree, the stream check
    # refuses the tier (and never the base)
    header, body = unpack(nested_object)
    sections = [bytes(body.sections[i]) for i in range(len(body.sections))]
    raw = bytearray(sections[victim])
    raw[-1] ^= 0x5A
    sections[victim] = bytes(raw)
    evil = pack_sections(header, sections)
    decode_chunk(evil, profile=profile, tiers=3)
    with pytest.raises(FormatError, match="does not end where it should|out of range"):
        decode_chunk(evil, profile=profile, tiers=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_publisher_s_hostile_sections_are_refused_or_decode_to_their_shape(
    profile, nested_object, data
) -> None:
    """Sections whose checksums are right but whose contents a hostile publisher chose
    (counts, states, words, sinks changed, sections cut or grown): every tier is refused
    with a FormatError or decodes to the chunk's shape; nothing reads outside them (the
    kernels run without bounds checks: what the parser lets through must be safe)."""
    header, body = unpack(nested_object)
    sections = [bytes(body.sections[i]) for i in range(len(body.sections))]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(sections) - 1))
        raw = bytearray(sections[i])
        edit = data.draw(st.sampled_from(["byte", "count", "cut", "grow"]))
        if len(raw) < 12:  # cut short by an earlier edit: only growing applies
            edit = "grow"
        if edit == "byte":
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        elif edit == "count":  # S, words of K or words of V
            at = 4 * data.draw(st.integers(0, 2))
            raw[at : at + 4] = data.draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little")
        elif edit == "cut":
            del raw[data.draw(st.integers(0, len(raw) - 1)) :]
        else:
            raw += bytes(data.draw(st.integers(1, 64)))
        sections[i] = bytes(raw)
    hostile = pack_sections(header, sections)
    tiers = data.draw(st.integers(1, len(NESTED_TIERS)))
    try:
        _, out = decode_chunk(hostile, profile=profile, tiers=tiers)
    except FormatError:
        return
    assert tuple(out.shape) == header.shape


def test_nested_objects_refuse_what_does_not_fit(profile, nested_object) -> None:
    header, body = unpack(nested_object)
    with pytest.raises(FormatError, match="not within"):
        decode_chunk(nested_object, profile=profile, tiers=len(NESTED_TIERS) + 1)
    other = dataclasses.replace(header, params={**header.params, "tiers": ["minimal", "low"]})
    sections = [bytes(body.sections[i]) for i in range(len(body.sections))]
    with pytest.raises(FormatError, match="tiers"):
        decode_chunk(pack_sections(other, sections), profile=profile)
    with pytest.raises(FormatError, match="sections for"):
        pack_sections(header, sections[:-1])


def test_objects_hold_their_codec_s_tiers_of_sections_and_chunks_their_tokens(
    profile, nested_object
) -> None:
    """A container whose every checksum is right but which holds more tiers of sections
    than its codec codes (bytes no reader would decode: padding a publisher could add)
    is refused, whole or read in part from a store, and so is a header of more tokens
    than a chunk has (a decode into a new tensor would allocate them)."""
    from kvcdn.codec import FIXED_LEVELS
    from kvcdn.store import open_store

    header, body = unpack(nested_object)
    sections = [bytes(body.sections[i]) for i in range(len(body.sections))]
    per_tier = header.shape[0] * header.shape[2]
    padded = pack_sections(header, sections + sections[-per_tier:])
    with pytest.raises(FormatError, match="7 tiers of sections"):
        decode_chunk(padded, profile=profile)
    store = open_store("memory://tiers-of-sections")
    store.put("objects/padded.kvc", padded)
    ref = object_ref("objects/padded.kvc", padded, tiers=2)
    with pytest.raises(FormatError, match="7 tiers of sections"):
        read_part(store, ref, None, name="padded")
    kv = torch.randn(2, 2, 1, 8, 64)
    fp16 = encode_chunk(FIXED_LEVELS["fp16"], kv, HASH)
    h, b = unpack(fp16)
    doubled = pack_sections(h, [bytes(b.sections[i]) for i in range(2)] * 2)
    with pytest.raises(FormatError, match="2 tiers of sections"):
        decode_chunk(doubled)
    assert torch.equal(decode_chunk(fp16)[1].float(), kv.half().float())
    long = dataclasses.replace(h, shape=(2, 2, 1, 65537, 64))
    with pytest.raises(FormatError, match="more than 65536 tokens"):
        unpack(pack_sections(long, [bytes(b.sections[i]) for i in range(2)]))


def test_a_nested_publication_is_one_object_a_chunk_and_each_level_reads_its_tiers(
    model, sed_text, tmp_path
) -> None:
    """Published with ``levels="nested"`` (the ladder the embedded profile holds, of KLT
    coefficients): every level of a chunk names one object; an edge warms it once for
    all levels; a load at a level fetches exactly the index and that level's tiers of
    each chunk (counted by a real edge) and holds what decoding those tiers gives."""
    from kvcdn.catalog import read_manifest
    from kvcdn.models import kv_from_cache
    from kvcdn.profile_store import load_profile
    from kvcdn.publish import publish
    from kvcdn.sdk import load_context
    from kvcdn.sdk.edges import warm_keys
    from kvcdn.store import open_store
    from tests.edge_helpers import EdgeProcess, post_json

    root = tmp_path / "store"
    text = sed_text[:6000]
    result = publish(text=text, name="sed-nested", model=model, store=str(root), levels="nested")
    store = open_store(str(root))
    manifest = read_manifest(store, "sed-nested", None)
    profile = load_profile(store, manifest.codec_profile)
    assert [n for n in manifest.levels if n != "text"] == list(NESTED_TIERS)
    chunks = manifest.chunks
    assert result.uploaded_objects == len(chunks) and result.reused_objects == 0
    for c in chunks:
        refs = [c.objects[t] for t in NESTED_TIERS]
        assert len({r.key for r in refs}) == 1
        assert [r.tiers.count for r in refs] == list(range(1, len(NESTED_TIERS) + 1))
        assert [r.tiers.bytes for r in refs] == sorted(r.tiers.bytes for r in refs)
        assert refs[-1].tiers.bytes == refs[-1].bytes  # the top level reads it all
    keys, size = warm_keys(manifest)
    assert len(keys) == len(chunks) + 1  # the objects and the codec profile, once each
    _hostile_tiers_are_refused(manifest)
    # an adaptive load of it refines, so its first pass leaves quality to refinement
    # rather than recompute (docs/streaming.md, "Refinement"); without refining, the
    # planner's own
    from kvcdn.sdk.loader import default_policy
    from kvcdn.sdk.planner import fetch_first, plan

    assert default_policy(manifest, refine=True) is fetch_first
    assert default_policy(manifest, refine=False) is plan
    edge = EdgeProcess(str(root), tmp_path / "cache", None).start()
    try:
        status, _ = post_json(f"{edge.url}/warm", {"keys": keys})
        assert status in (200, 202)
        edge.wait_cached(len(keys), timeout_s=60)
        overhead = []  # what the edge served besides the tiers: manifest, pointer, profile
        for level in ("minimal", "default", "nearlossless"):
            before = edge.metrics()["kvcdn_edge_bytes_served_total"]
            ctx = load_context("sed-nested", model=model, edges=[edge.url], quality=level)
            served = edge.metrics()["kvcdn_edge_bytes_served_total"] - before
            tiers = sum(c.objects[level].tiers.bytes for c in chunks)
            assert ctx.plan.chunk_levels == [level] * len(chunks)
            overhead.append(served - tiers)
            assert sum(r.bytes for r in ctx.plan.chunks) == tiers
            kv = kv_from_cache(ctx.cache)
            c = chunks[1]
            data = store.get(c.objects[level])
            _, want = decode_chunk(data, profile=profile, tiers=c.objects[level].tiers.count)
            got = kv[:, :, :, c.start : c.end]
            assert torch.equal(got, want.to(got.dtype))
        # the same manifest and pointer each time (and the profile, once): not a byte of a
        # tier above the level's was served
        assert overhead[1] == overhead[2] < 64 << 10
        assert overhead[0] - overhead[1] in (0, manifest.codec_profile.bytes)
        _refinements_fetch_only_the_tiers_they_lack(model, profile, store, manifest, edge,
                                                    overhead[1])  # fmt: skip
    finally:
        edge.kill()
    # a refinement damaged in the store: the levels that read it lose that chunk (it is
    # recomputed), the levels below still load it from their intact tiers
    victim = chunks[2]
    ref = victim.objects["default"]
    path = root / ref.key
    raw = bytearray(path.read_bytes())
    original = bytes(raw)
    index = parse_index(bytes(raw))
    section = 3 * 90 + 17  # tier 3 (default), head 0, layer 17
    raw[index.offsets[section] + 8] ^= 0x01
    path.write_bytes(bytes(raw))
    ctx = load_context("sed-nested", model=model, store=str(root), quality="default")
    report = ctx.plan.chunks[2]
    assert report.level == "text" and "section" in " ".join(report.failed)
    assert ctx.plan.chunk_levels.count("default") == len(chunks) - 1
    ctx = load_context("sed-nested", model=model, store=str(root), quality="low")
    assert ctx.plan.chunk_levels == ["low"] * len(chunks)
    # refining into the damaged tier fails its check before use: that chunk keeps the
    # level it holds (what its intact tiers decode to), the others are raised past it
    from kvcdn.models import kv_from_cache
    from kvcdn.sdk.planner import base_first

    ctx = load_context("sed-nested", model=model, store=str(root), deadline_s=60,
                       policy=base_first)  # fmt: skip
    report = ctx.plan.chunks[2]
    assert report.level in NESTED_TIERS[:3] and ctx.plan.refinements_dropped >= 1
    assert "section" in " ".join(report.failed)
    held = victim.objects[report.level]
    _, want = decode_chunk(original, profile=profile, tiers=held.tiers.count)
    assert torch.equal(kv_from_cache(ctx.cache)[:, :, :, victim.start : victim.end], want)
    assert ctx.plan.chunk_levels.count(NESTED_TIERS[-1]) == len(chunks) - 1


def _refinements_fetch_only_the_tiers_they_lack(model, profile, store, manifest, edge,
                                                overhead: int) -> None:  # fmt: skip
    """Base first, then refinement: every chunk loads its base, then refinements raise
    chunks while the deadline allows, each fetching only the tiers the chunk lacks. A
    chunk ends holding exactly what a direct read of its final level decodes to, and
    the edge served each chunk's index and tiers once."""
    from kvcdn.models import kv_from_cache
    from kvcdn.sdk import load_context
    from kvcdn.sdk.planner import base_first

    chunks = manifest.chunks
    before = edge.metrics()["kvcdn_edge_bytes_served_total"]
    ctx = load_context("sed-nested", model=model, edges=[edge.url], deadline_s=60,
                       policy=base_first)  # fmt: skip
    served = edge.metrics()["kvcdn_edge_bytes_served_total"] - before
    plan = ctx.plan
    assert plan.refined >= len(chunks) and plan.refinements_dropped == 0
    kv = kv_from_cache(ctx.cache)
    for report, c in zip(plan.chunks, chunks, strict=True):
        assert report.refined_from[:1] == [NESTED_TIERS[0]]  # its base came first
        order = [NESTED_TIERS.index(lv) for lv in [*report.refined_from, report.level]]
        assert order == sorted(set(order))  # each refinement raised it
        ref = c.objects[report.level]
        assert report.bytes == ref.tiers.bytes  # the index and tiers 0..k, each once
        _, want = decode_chunk(store.get(ref), profile=profile, tiers=ref.tiers.count)
        assert torch.equal(kv[:, :, :, c.start : c.end], want.to(kv.dtype))
    assert served - sum(r.bytes for r in plan.chunks) == overhead


def _hostile_tiers_are_refused(manifest) -> None:
    """A manifest whose tiers point outside the object, lack an index, or name a key that
    is not the nested object's own is refused whole."""
    import copy

    from kvcdn.manifest import manifest_from_json

    raw = manifest.to_json()
    manifest_from_json(copy.deepcopy(raw), name="m")  # as published, it parses
    obj = raw["chunks"][0]["objects"]["default"]
    for change in (
        lambda o: o["tiers"].update(bytes=o["bytes"] + 1),
        lambda o: o["tiers"].update(bytes=o["index"]["bytes"]),
        lambda o: o["tiers"].update(count=17),
        lambda o: o.pop("index"),
        lambda o: o.update(key=o["key"].replace("/nested-", "/default-")),
    ):
        bad = copy.deepcopy(raw)
        change(bad["chunks"][0]["objects"]["default"])
        with pytest.raises(FormatError):
            manifest_from_json(bad, name="m")
    assert obj["tiers"]["count"] == NESTED_TIERS.index("default") + 1
