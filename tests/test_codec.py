"""The KV codec ladder: rANS properties, real round trips, hostile payloads, profiles."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcdn.codec import decode_chunk, encode_chunk, ladder_level, parse_levels, warm_up
from kvcdn.codec_profile import LADDER, parse_profile
from kvcdn.container import ChunkHeader, pack, unpack
from kvcdn.errors import FingerprintMismatch, FormatError, InputError, KvcdnError
from kvcdn.kernels import rans, rans_numba

HASH = "ab" * 32


# ---- rANS: properties of the coder itself -------------------------------------------


@st.composite
def tables_and_symbols(draw):
    """Random frequency tables (degenerate ones included) and streams drawn from them."""
    n_tables = draw(st.integers(1, 4))
    tables = []
    for _ in range(n_tables):
        kind = draw(st.sampled_from(["random", "single", "full", "spiky"]))
        if kind == "single":  # one symbol with all 4096 of the probability
            n = draw(st.integers(1, 8))
            counts = np.zeros(n)
            counts[draw(st.integers(0, n - 1))] = 1
        elif kind == "full":  # all 256 symbols
            counts = np.array(draw(st.lists(st.integers(0, 50), min_size=256, max_size=256)))
        elif kind == "spiky":  # one symbol near 4095/4096, the rest at frequency 1
            n = draw(st.integers(2, 40))
            counts = np.zeros(n)
            counts[0] = 1e9
        else:
            counts = np.array(draw(st.lists(st.integers(0, 1000), min_size=1, max_size=64)))
        tables.append(rans.normalize_freqs(counts))
    width = max(len(t) for t in tables)
    freqs = np.zeros((n_tables, width), dtype=np.uint32)
    for i, t in enumerate(tables):
        freqs[i, : len(t)] = t
    G = draw(st.integers(1, 3))
    T = draw(st.integers(1, 12))
    D = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    tid = rng.integers(0, n_tables, size=(G, D))
    sym = np.zeros((G, T, D), dtype=np.uint8)
    for g in range(G):
        for d in range(D):
            p = freqs[tid[g, d]] / 4096.0
            if draw(st.booleans()):  # typical streams
                sym[g, :, d] = rng.choice(len(p), size=T, p=p)
            else:  # adversarial: only the rarest symbols
                rare = np.flatnonzero(p == p[p > 0].min())
                sym[g, :, d] = rng.choice(rare, size=T)
    return freqs, tid, sym


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables_and_symbols())
def test_rans_round_trip_reference_and_numba_bit_exact(case):
    freqs, tid, sym = case
    states, words, word_start = rans.encode_ref(sym, tid, freqs)
    n_states, n_words, n_start = rans_numba.encode(sym, tid, freqs)
    assert np.array_equal(states, n_states)
    assert np.array_equal(words, n_words)
    assert np.array_equal(word_start, n_start)
    lut = rans.build_decode_table(freqs)
    G, T, D = sym.shape
    one = np.ones((G, D), np.float32)
    zero = np.zeros((G, D), np.float32)
    ref = np.full((G, T, D), np.nan, np.float32)
    fast = np.full((G, T + 2, D), np.nan, np.float32)[:, 1:-1]  # a strided view
    rans.decode_ref(words, word_start, states, lut, tid, one, zero, ref)
    rans_numba.decode(words, word_start, states, lut, tid, one, zero, fast)
    assert np.array_equal(ref, sym.astype(np.float32))
    assert np.array_equal(fast, ref)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e12, allow_nan=False), min_size=1, max_size=256))
def test_normalised_frequencies_sum_to_4096_and_keep_every_symbol(counts):
    freqs = rans.normalize_freqs(np.array(counts))
    assert freqs.sum() == rans.PROB_SCALE
    assert freqs.min() >= 1


def test_rans_codes_near_the_entropy():
    """Static-table rANS costs little over the ideal (cross-)entropy."""
    rng = np.random.default_rng(1)
    p = np.exp(-np.abs(np.arange(-8, 9)) / 1.5)
    freqs = rans.normalize_freqs(p * 1e6)[None, :]
    sym = rng.choice(17, size=(4, 2048, 16), p=p / p.sum()).astype(np.uint8)
    _, words, _ = rans_numba.encode(sym, np.zeros((4, 16), int), freqs)
    q = freqs[0] / 4096.0
    ideal = -np.log2(q[sym]).sum()
    overhead_bits = 4 * 16 * 32  # the final states
    assert words.size * 16 <= 1.01 * ideal + overhead_bits


def test_corrupted_rans_stream_is_detected():
    rng = np.random.default_rng(2)
    freqs = rans.normalize_freqs(np.exp(-np.arange(12)))[None, :]
    sym = rng.choice(12, size=(2, 64, 8), p=freqs[0] / 4096).astype(np.uint8)
    tid = np.zeros((2, 8), int)
    states, words, ws = rans_numba.encode(sym, tid, freqs)
    lut = rans.build_decode_table(freqs)
    out = np.empty(sym.shape, np.float32)
    one, zero = np.ones((2, 8), np.float32), np.zeros((2, 8), np.float32)
    short = ws.copy()
    short[-1] -= 1
    for args in [(words, short, states), (words, ws, states ^ np.uint32(1 << 20))]:
        with pytest.raises(rans.RansError):
            rans_numba.decode(*args, lut, tid, one, zero, out)
        with pytest.raises(rans.RansError):
            rans.decode_ref(*args, lut, tid, one, zero, out)


def test_invalid_tables_are_refused():
    with pytest.raises(rans.RansError):
        rans.build_decode_table(np.array([[4095, 0]], np.uint32))
    with pytest.raises(rans.RansError):
        rans.normalize_freqs(np.zeros(300))


# ---- the ladder on the real model ----------------------------------------------------


@pytest.fixture(scope="module")
def real_kv(model, sed_text):
    return model.prefill(model.document_ids(sed_text)[:512]).float()


def test_profile_has_the_ladder_with_measured_quality(profile, model):
    assert list(profile.levels) == list(LADDER)
    assert profile.model_fingerprint == model.fingerprint
    bits = [profile.levels[n].quality["bits_per_element"] for n in LADDER]
    kls = [profile.levels[n].quality["kl"] for n in LADDER]
    assert bits == sorted(bits, reverse=True), "the ladder must get smaller level by level"
    assert kls == sorted(kls), "and worse level by level"
    assert profile.levels["nearlossless"].quality["kl"] <= 0.002
    assert bits[-1] < 3.0 and bits[0] <= 5.0
    # the profile's own serialisation round-trips through the strict parser
    again = parse_profile(profile.to_bytes())
    assert again.sha256 == profile.sha256
    assert np.array_equal(again.levels["default"].step, profile.levels["default"].step)


@pytest.mark.parametrize("level", list(LADDER))
def test_every_level_round_trips_with_bounded_error(profile, real_kv, level):
    lv = ladder_level(level, profile)
    spec = profile.levels[level]
    for start in (0, 256):  # the first chunk keeps its first tokens exact
        chunk = real_kv[:, :, :, start : start + 256]
        data = encode_chunk(lv, chunk, HASH, profile=profile, start=start)
        header, out = decode_chunk(data, profile=profile)
        assert header.level == level and header.params["profile"] == profile.sha256
        err = (out - chunk).abs()
        sinks = profile.sinks if start == 0 else 0
        if sinks:
            assert torch.allclose(
                out[:, :, :, :sinks], chunk[:, :, :, :sinks], rtol=1e-3, atol=1e-3
            )
        step = torch.from_numpy(spec.step)[:, :, :, None, :]
        # Within half a step except where a value was clipped to its table's range.
        within = (err[:, :, :, sinks:] <= step / 2 * 1.0001).float().mean().item()
        assert within > 0.9995
        assert 8 * len(data) / chunk.numel() < 16 * 0.4


def test_decoded_symbols_are_bit_exact_across_kernels(profile, real_kv):
    """Decode one real payload with the numpy reference and with numba."""
    lv = ladder_level("default", profile)
    data = encode_chunk(lv, real_kv[:, :, :, 256:512], HASH, profile=profile, start=256,
                        version=1)  # fmt: skip
    header, body = unpack(data)
    payload = body.payload
    G = 30 * 2 * 3
    fields = np.frombuffer(payload, "<u4", count=4 + G + 1)
    ws = fields[4:].astype(np.int64)
    states = np.frombuffer(payload, "<u4", count=G * 64, offset=16 + 4 * (G + 1)).reshape(G, 64)
    words = np.frombuffer(payload, "<u2", offset=16 + 4 * (G + 1) + 4 * G * 64)
    tid, scale, offset = profile.dequant("default")
    lut = profile.decode_tables()
    ref = np.empty((G, 256, 64), np.float32)
    rans.decode_ref(words, ws, states, lut, tid, scale, offset, ref)
    _, fast = decode_chunk(data, profile=profile)
    assert np.array_equal(fast.numpy().reshape(G, 256, 64), ref)


@pytest.mark.parametrize("level", ["nearlossless", "lowest"])
def test_fused_quantise_encode_equals_reference_quantiser_then_encoder(profile, real_kv, level):
    x = real_kv[:, :, :, 100:356].numpy()
    idx = profile.quantise(level, x)
    tid, _, _ = profile.dequant(level)
    reference = rans_numba.encode(idx, tid, profile.freqs)
    G = idx.shape[0]
    fused = rans_numba.quantise_encode(
        x.reshape(G, 256, 64), *profile.quantiser(level), profile.freqs
    )
    for a, b in zip(reference, fused, strict=True):
        assert np.array_equal(a, b)


def test_decode_writes_into_a_slice_of_a_larger_tensor(profile, real_kv):
    lv = ladder_level("low", profile)
    big = torch.zeros(30, 2, 3, 512, 64)
    for start in (0, 256):
        data = encode_chunk(
            lv, real_kv[:, :, :, start : start + 256], HASH, profile=profile, start=start
        )
        _, out = decode_chunk(data, profile=profile, out=big[:, :, :, start : start + 256])
        assert out.data_ptr() == big[:, :, :, start:].data_ptr()
    _, alone = decode_chunk(data, profile=profile)
    assert torch.equal(big[:, :, :, 256:], alone)
    # some heads of a wider tensor: its groups are not one dimension of it
    wide = torch.zeros(30, 2, 5, 256, 64)
    decode_chunk(data, profile=profile, out=wide[:, :, 1:4])
    assert torch.equal(wide[:, :, 1:4], alone) and not wide[:, :, 0].any()
    # bfloat16: cast by kvcdn's kernel, bit for bit as torch casts (a slice of tokens),
    # or by torch (some heads of a wider tensor: not one array)
    warm_up("cpu", torch.bfloat16)  # what a client of a bfloat16 model does first
    for start in (0, 256):
        data = encode_chunk(
            lv, real_kv[:, :, :, start : start + 256], HASH, profile=profile, start=start
        )
        _, alone = decode_chunk(data, profile=profile)
        expected = alone.to(torch.bfloat16).view(torch.int16)
        brain = torch.zeros(30, 2, 3, 512, 64, dtype=torch.bfloat16)
        decode_chunk(data, profile=profile, out=brain[:, :, :, start : start + 256])
        assert torch.equal(brain[:, :, :, start : start + 256].view(torch.int16), expected)
        assert not brain[:, :, :, 256 - start : 512 - start].any()
        heads = torch.zeros(30, 2, 5, 256, 64, dtype=torch.bfloat16)
        decode_chunk(data, profile=profile, out=heads[:, :, 1:4])
        assert torch.equal(heads[:, :, 1:4].view(torch.int16), expected)


# ---- hostile containers and profiles ------------------------------------------------------


@pytest.fixture(scope="module")
def default_object(profile, real_kv):
    lv = ladder_level("default", profile)
    return encode_chunk(lv, real_kv[:, :, :, 256:512], HASH, profile=profile, start=256)


@pytest.fixture(scope="module")
def default_object_v1(profile, real_kv):
    lv = ladder_level("default", profile)
    return encode_chunk(lv, real_kv[:, :, :, 256:512], HASH, profile=profile, start=256,
                        version=1)  # fmt: skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_payloads_raise_clear_errors(profile, default_object_v1, data):
    """Payload bytes mutated, re-packed with a valid checksum: the rANS parser must catch it."""
    header, body = unpack(default_object_v1)
    raw = bytearray(body.payload)
    mode = data.draw(st.sampled_from(["flip", "truncate", "extend", "preamble", "offsets"]))
    if mode == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
    elif mode == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif mode == "extend":
        raw += bytes(data.draw(st.integers(1, 64)))
    elif mode == "preamble":
        field = data.draw(st.integers(0, 3))
        value = data.draw(st.integers(0, 2**32 - 1))
        struct.pack_into("<I", raw, 4 * field, value)
    else:
        i = data.draw(st.integers(0, 180))
        struct.pack_into("<I", raw, 16 + 4 * i, data.draw(st.integers(0, 2**32 - 1)))
    try:
        _, out = decode_chunk(pack(header, bytes(raw)), profile=profile)
    except FormatError:
        return  # the expected outcome for nearly every mutation
    # A flip inside the words can decode to other valid symbols (rANS has no
    # redundancy); that is what the container's sha256 and the manifest's
    # checksum are for. It must still be a well-formed tensor of the right shape.
    assert out.shape == (30, 2, 3, 256, 64) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d[:-1],  # truncated
        lambda d: d[:100],
        lambda d: d + b"\0",  # oversized
        lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:],  # a flipped bit anywhere
        lambda d: d[:16] + struct.pack("<Q", 1 << 60) + d[24:],  # absurd payload length
    ],
)
def test_damaged_containers_are_refused(profile, default_object, mutate):
    with pytest.raises(FormatError):
        decode_chunk(mutate(default_object), profile=profile)


def test_profile_for_another_model_is_refused(profile, default_object, model):
    with pytest.raises(FingerprintMismatch, match="only fits the model it was measured on"):
        profile.check_model("f" * 64)
    other = parse_profile(profile.to_bytes())
    other.model_fingerprint = "f" * 64
    other.changed()
    with pytest.raises(FormatError, match="another codec profile"):
        decode_chunk(default_object, profile=other)
    with pytest.raises(FormatError, match="needs a codec profile"):
        decode_chunk(default_object)


@pytest.mark.parametrize("cut", [0, 7, 8, 100, 5000, -1])
def test_truncated_or_damaged_profiles_are_refused(profile, cut):
    data = profile.to_bytes()
    with pytest.raises(FormatError):
        parse_profile(data[:cut] if cut >= 0 else data[:-1] + bytes([data[-1] ^ 0xFF]) + b"x")


def test_profile_with_inconsistent_tables_is_refused(profile):
    from safetensors.numpy import load, save

    arrays = load(profile.to_bytes())
    header_len = struct.unpack("<Q", profile.to_bytes()[:8])[0]
    import json

    meta = json.loads(profile.to_bytes()[8 : 8 + header_len])["__metadata__"]
    arrays["freqs"] = arrays["freqs"].copy()
    arrays["freqs"][0, 0] += 1  # no longer sums to 4096
    with pytest.raises(FormatError, match="sum to 4096"):
        parse_profile(save(arrays, metadata=meta))


def test_level_names_are_checked(profile):
    with pytest.raises(InputError, match="unknown level"):
        parse_levels("default,best", profile)
    with pytest.raises(InputError, match="needs the model's codec profile"):
        parse_levels("default")
    assert [lv.name for lv in parse_levels("text,fp16,low", profile)] == ["fp16", "low"]
    assert issubclass(FingerprintMismatch, KvcdnError)


def test_container_header_names_codec_profile_and_level(default_object, profile):
    header, _ = unpack(default_object)
    assert isinstance(header, ChunkHeader)
    assert header.codec == "kvcdn-rans-v1"
    assert header.params == {"profile": profile.sha256, "level": "default"}


def _paged_cache(dtype, layers=30, heads=3, dim=64, blocks=24, block_size=64, seed=0):
    """A vLLM-like CPU cache [L, blocks, H, 2, block_size * D], a random permutation of
    each block's elements, and a random order of the request's blocks."""
    rng = np.random.default_rng(seed)
    cache = np.zeros((layers, blocks, heads, 2, block_size * dim), dtype=dtype)
    k_pos = rng.permutation(block_size * dim)
    v_pos = rng.permutation(block_size * dim)
    return cache, rng.permutation(blocks).astype(np.int64), k_pos, v_pos


@pytest.mark.parametrize("level", ["fp16", "int8", *LADDER])
@pytest.mark.parametrize("dtype", [np.uint16, np.float32])  # bfloat16 bits, float32
def test_decoding_into_paged_blocks_equals_decoding_then_writing(profile, real_kv, level, dtype):
    """kvcdn's fused decoders (rANS and fp16 straight into vLLM's CPU blocks) write
    exactly what decoding to float32 and then writing with the reference write
    kernel does: every level, the exact first tokens of a document's first chunk,
    a claim that starts and ends inside the chunk, and fp16 specials."""
    from dataclasses import replace

    from kvcdn.codec import FIXED_LEVELS, decode_into
    from kvcdn.codecs import BlocksDest
    from kvcdn.kernels.paged_cpu import write_permuted
    from kvcdn.kernels.permuted import PermutedBlocks

    lv = FIXED_LEVELS[level] if level in FIXED_LEVELS else ladder_level(level, profile)
    kv = real_kv.clone()
    if level == "fp16":  # infinities, a subnormal, a negative zero, a NaN
        kv[0, 0, 0, 10, :5] = torch.tensor([float("inf"), -float("inf"), 3e-6, -0.0, float("nan")])
    for start, lo, hi in ((0, 0, 256), (256, 3, 200), (0, 1, 2)):  # chunk-relative lo..hi
        data = encode_chunk(lv, kv[:, :, :, start : start + 256], HASH, profile=profile,
                            start=start)  # fmt: skip
        fused, blocks, k_pos, v_pos = _paged_cache(dtype)
        reference = fused.copy()
        into = PermutedBlocks(fused, blocks, start, lo, hi, k_pos, v_pos, 256, 64)
        header = decode_into(data, BlocksDest(into), profile=profile, chunk_hash=HASH)
        assert header.level == level
        _, decoded = decode_chunk(data, profile=profile)
        write_permuted(np.ascontiguousarray(decoded.float().numpy()),
                       PermutedBlocks(reference, blocks, start, lo, hi, k_pos, v_pos, 256,
                                      64))  # fmt: skip
        assert np.array_equal(fused.view(np.uint8), reference.view(np.uint8)), (start, lo, hi)
        assert fused.any()
    with pytest.raises(FormatError, match="another chunk"):
        decode_into(data, BlocksDest(into), profile=profile, chunk_hash="cd" * 32)
    # a chunk of another shape (half the lanes would double the block size the
    # kernels compute, and land in blocks the claim does not own) is refused
    with pytest.raises(FormatError, match="tokens"):
        decode_into(data, BlocksDest(replace(into, tokens=128)), profile=profile)
    if level in FIXED_LEVELS:
        halved = encode_chunk(lv, kv[:, :, :, :512].reshape(30, 2, 3, 512, 64)[..., :32], HASH)
        with pytest.raises(FormatError, match="lanes"):
            decode_into(halved, BlocksDest(replace(into, tokens=512)), profile=profile)


def test_a_corrupt_stream_decoded_into_blocks_is_an_error(profile, real_kv):
    from kvcdn.codec import decode_into
    from kvcdn.codecs import BlocksDest
    from kvcdn.kernels.permuted import PermutedBlocks

    data = bytearray(encode_chunk(ladder_level("default", profile), real_kv[:, :, :, 256:512],
                                  HASH, profile=profile, start=256, version=1))  # fmt: skip
    header, parsed = unpack(bytes(data))
    body = bytearray(parsed.payload)
    body[-9] ^= 0x5A  # a word of the last group's stream
    cache, blocks, k_pos, v_pos = _paged_cache(np.uint16)
    into = PermutedBlocks(cache, blocks, 256, 0, 256, k_pos, v_pos, 256, 64)
    with pytest.raises(FormatError, match="corrupt"):
        decode_into(pack(header, bytes(body)), BlocksDest(into), profile=profile, chunk_hash=HASH)


# ---- version-2 objects: sections a rank reads in part -------------------------------------


@pytest.mark.parametrize("level", ["fp16", "int8", *LADDER])
def test_sectioned_objects_decode_as_whole_ones_and_in_part(profile, real_kv, level):
    """A version-2 object decodes bit for bit as the version-1 object of the same KV; a
    part (the layers and heads a rank holds) decodes as that slice of the whole."""
    from kvcdn.codec import FIXED_LEVELS, decode_into
    from kvcdn.codecs import TensorDest
    from kvcdn.container import Part

    lv = FIXED_LEVELS[level] if level in FIXED_LEVELS else ladder_level(level, profile)
    for start in (0, 256):
        kv = real_kv[:, :, :, start : start + 256]
        v1 = encode_chunk(lv, kv, HASH, profile=profile, start=start, version=1)
        v2 = encode_chunk(lv, kv, HASH, profile=profile, start=start)
        assert unpack(v2)[1].version == 2
        _, whole1 = decode_chunk(v1, profile=profile)
        _, whole2 = decode_chunk(v2, profile=profile)
        assert torch.equal(whole1, whole2)
        for part in (Part((0, 30), (1, 2)), Part((7, 19), (0, 3)), Part((29, 30), (2, 3))):
            for data in (v1, v2):  # a version-1 object is read whole, its part kept
                out = torch.full(part.shape(whole2.shape), float("nan"))
                decode_into(data, TensorDest(out), profile=profile, part=part)
                (l0, l1), (h0, h1) = part.layers, part.heads
                assert torch.equal(out, whole2[l0:l1, :, h0:h1].float())


def test_an_index_is_small_beside_its_object(profile, real_kv):
    """Target of the issue: index (preamble, header, table) <= 2% of a default object of
    a 256-token chunk of the embedded model."""
    from kvcdn.codec import object_ref

    data = encode_chunk(ladder_level("default", profile), real_kv[:, :, :, 256:512], HASH,
                        profile=profile, start=256)  # fmt: skip
    ref = object_ref("k", data)
    assert ref.index is not None
    assert ref.index.bytes <= 0.02 * len(data), (ref.index.bytes, len(data))


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_sections_raise_clear_errors(profile, default_object, data):
    """A section's bytes mutated and the object re-packed with valid checksums: the
    section parser refuses it, or it decodes to finite values of the right shape."""
    from kvcdn.codec import decode_into
    from kvcdn.codecs import TensorDest
    from kvcdn.container import Part, pack_sections

    header, body = unpack(default_object)
    sections = [bytes(body.sections[i]) for i in range(len(body.sections))]
    i = data.draw(st.integers(0, len(sections) - 1))
    raw = bytearray(sections[i])
    mode = data.draw(st.sampled_from(["flip", "truncate", "extend", "counts"]))
    if mode == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            j = data.draw(st.integers(0, len(raw) - 1))
            raw[j] ^= data.draw(st.integers(1, 255))
    elif mode == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif mode == "extend":
        raw += bytes(data.draw(st.integers(1, 64)))
    else:
        struct.pack_into("<I", raw, 4 * data.draw(st.integers(0, 2)),
                         data.draw(st.integers(0, 2**32 - 1)))  # fmt: skip
    sections[i] = bytes(raw)
    damaged = pack_sections(header, sections)
    head = i // 30
    part = Part((0, 30), (head, head + 1))
    try:
        _, out = decode_chunk(damaged, profile=profile)
        one = torch.empty(part.shape(header.shape))
        decode_into(damaged, TensorDest(one), profile=profile, part=part)
    except FormatError:
        return
    assert out.shape == (30, 2, 3, 256, 64) and torch.isfinite(out).all()


def _stored_chunk(profile, real_kv, tmp_path, level: str = "default"):  # type: ignore[no-untyped-def]
    """Tokens 256-511 of the real KV at ``level`` in a folder store: (store, the object's
    bytes, its ref, its whole decode)."""
    from kvcdn.codec import object_ref
    from kvcdn.store import open_store

    store = open_store(str(tmp_path / "store"))
    data = encode_chunk(ladder_level(level, profile), real_kv[:, :, :, 256:512], HASH,
                        profile=profile, start=256)  # fmt: skip
    ref = object_ref("objects/x", data)
    store.put(ref.key, data)
    return store, data, ref, decode_chunk(data, profile=profile)[1]


def test_a_rank_reads_its_part_verified_and_no_more(profile, real_kv, tmp_path):
    """read_part fetches the index and the part's sections only (one run for a head),
    each checked: a damaged section of another rank's part does not touch this one's
    read; a damaged section of its own is caught before decoding."""
    from kvcdn.codec import decode_into, read_part
    from kvcdn.codecs import TensorDest
    from kvcdn.container import Part, parse_index
    from kvcdn.errors import IntegrityError

    store, data, ref, whole = _stored_chunk(profile, real_kv, tmp_path)
    index = parse_index(data)
    seen: list[int] = []
    total = 0
    for head in range(3):
        part = Part((0, 30), (head, head + 1))
        read = read_part(store, ref, part, name="x", on_bytes=seen.append)
        own = sum(index.lengths[i] for i in part.section_ids(30))
        # exactly the index and this head's sections: heads differ in entropy, so a
        # third of the object each within a few percent
        assert read.nbytes == sum(seen) == ref.index.bytes + own
        assert own <= 1.05 * (len(data) - index.size) / 3
        total += own
        seen.clear()
        out = torch.empty(part.shape(whole.shape))
        decode_into(read, TensorDest(out), profile=profile, part=part, chunk_hash=HASH)
        assert torch.equal(out, whole[:, :, head : head + 1])
    assert total == len(data) - index.size
    damaged = bytearray(data)
    damaged[index.offsets[2 * 30 + 5] + 40] ^= 1  # head 2, layer 5
    store.put(ref.key, bytes(damaged))
    read_part(store, ref, Part((0, 30), (0, 2)), name="x")  # heads 0-1 are intact
    with pytest.raises(IntegrityError, match="section 65"):
        read_part(store, ref, Part((0, 30), (2, 3)), name="x")
    from kvcdn.manifest import IndexRef

    other = IndexRef(ref.index.bytes, "0" * 64)  # an index the object does not have
    with pytest.raises(IntegrityError, match="index"):
        read_part(store, dataclasses.replace(ref, index=other), Part((0, 30), (0, 1)), name="x")


def test_a_reader_of_several_parts_fetches_each_index_once(profile, real_kv, tmp_path):
    """A layer-ordered load reads each object once per group of layers: with an
    IndexCache the index is fetched and checked once, found again only for the same
    key, size and index digest, and the cache holds at most its bytes."""
    from kvcdn.codec import IndexCache, decode_into, object_ref, read_part
    from kvcdn.codecs import TensorDest
    from kvcdn.container import Part

    store, data, ref, whole = _stored_chunk(profile, real_kv, tmp_path)
    indexes = IndexCache()
    groups = [(0, 8), (8, 15), (15, 23), (23, 30)]
    fetched = []
    for first, end in groups:
        part = Part((first, end), (0, 3))
        seen: list[int] = []
        read = read_part(store, ref, part, name="x", indexes=indexes, on_bytes=seen.append)
        assert read.nbytes == sum(seen)
        fetched.append(read.nbytes)
        out = torch.empty(part.shape(whole.shape))
        decode_into(read, TensorDest(out), profile=profile, part=part, chunk_hash=HASH)
        assert torch.equal(out, whole[first:end])
    assert sum(fetched) == len(data)  # each section once, the index once
    assert fetched[0] > ref.index.bytes and len(indexes) == 1
    # another object at the same key (a changed ref) is not this index
    other = encode_chunk(ladder_level("low", profile), real_kv[:, :, :, 256:512], HASH,
                         profile=profile, start=256)  # fmt: skip
    other_ref = object_ref("objects/x", other)
    store.put(other_ref.key, other)
    seen = []
    read_part(store, other_ref, Part((0, 8), (0, 3)), name="x", indexes=indexes,
              on_bytes=seen.append)  # fmt: skip
    assert len(indexes) == 2 and sum(seen) > other_ref.index.bytes
    # bounded by bytes: room for one index, the least recently used goes
    small = IndexCache(max_bytes=max(ref.index.bytes, other_ref.index.bytes))
    for r in (ref, other_ref):
        store.put(r.key, data if r is ref else other)
        read_part(store, r, Part((0, 1), (0, 1)), name="x", indexes=small)
    assert len(small) == 1 and small.get(other_ref) is not None and small.get(ref) is None
