"""The nested ladder with a transform (kvcdn-nested-klt-v1): each head's KLT coefficients,
keys taken back before RoPE, coded where the channels were. Every tier decodes to the
values docs/format.md specifies, to the bit; a tensor- or pipeline-parallel rank's
part decodes as the whole does; objects say where they start, and a reader refuses
what does not fit its profile; the embedded profile (this ladder, as `kvcdn calibrate`
makes by default) holds measured tiers, and the calibration that makes the transform
meets its targets with fewer bits than the channels' (tests/test_calibrate.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcdn.codec import decode_chunk, decode_into, encode_chunk, nested_level
from kvcdn.codec_profile import LADDER, NESTED_TIERS, parse_profile
from kvcdn.codecs import TensorDest
from kvcdn.container import Part, pack_sections, unpack
from kvcdn.errors import FormatError, InputError
from kvcdn.kernels import transform as tf

HASH = "ab" * 32


@pytest.mark.parametrize(("T", "D"), [(37, 64), (1, 64), (36, 128), (37, 40)])
def test_the_inverse_kernel_is_the_specified_arithmetic_bit_for_bit(T: int, D: int) -> None:
    """Head dimensions that are a multiple of the kernel's block take its vector path,
    four tokens at a time (37 leaves one, 1 leaves it all); others (40) the scalar one.
    Both round each of the sum's terms once, as an FMA does: the same sums with each
    product rounded apart give other bits."""
    rng = np.random.default_rng(7)
    G = 12
    y = (rng.standard_normal((G, T, D)) * 3).astype(np.float32)
    mt = (rng.standard_normal((G, D, D)) / 8).astype(np.float32)
    rotate = np.arange(G) % 3 == 0
    inv_freq = 10000.0 ** (-np.arange(0, D, 2) / D)
    cos, sin = tf.rope_tables(inv_freq, 1000, T)
    expected = tf.synthesise_reference(y, mt, rotate, cos, sin)
    out = np.empty_like(y)
    tf.synthesise(y, mt, rotate, cos, sin, out)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
    in_place = y.copy()
    tf.synthesise(in_place, mt, rotate, cos, sin, in_place)
    assert np.array_equal(in_place.view(np.uint32), expected.view(np.uint32))
    unfused = np.zeros_like(y)
    for j in range(D):
        unfused = unfused + mt[:, None, j, :] * y[:, :, j, None]
    fused = expected[~rotate]  # groups that are not turned: the sums themselves
    assert not np.array_equal(unfused[~rotate].view(np.uint32), fused.view(np.uint32))
    # the encoder's analysis inverts it (float64, up to float32 rounding)
    analysis = np.linalg.inv(np.swapaxes(mt, 1, 2).astype(np.float64))
    back = tf.analyse(expected, analysis, rotate, cos, sin)
    assert np.allclose(back, y, atol=1e-3 * np.abs(y).max())
    with pytest.raises(ValueError, match="do not fit"):
        tf.synthesise(y, mt[:, : D // 2], rotate, cos, sin, out)
    with pytest.raises(ValueError, match="float32"):
        tf.synthesise(y, mt, rotate, cos, sin, out.astype(np.float64))
    # rows 258 bytes apart (a view of a byte buffer): written element by element, the
    # same bits (the 16-at-a-time writes count from each row's first element)
    raw = np.zeros(G * T * (D * 4 + 2) + 16, np.uint8)
    flat = raw[2 : 2 + (len(raw) - 16) // 4 * 4].view(np.float32)
    odd = np.lib.stride_tricks.as_strided(flat, shape=(G, T, D),
                                          strides=(T * (D * 4 + 2), D * 4 + 2, 4))  # fmt: skip
    tf.synthesise(y, mt, rotate, cos, sin, odd)
    assert np.array_equal(np.ascontiguousarray(odd).view(np.uint32), expected.view(np.uint32))


def _rounded_once(exact: Fraction) -> np.float32:
    """The float32 nearest ``exact``, ties to even (no overflow in these cases)."""
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess,
                  np.nextafter(guess, np.float32(np.inf))]  # fmt: skip
    return min(candidates, key=lambda f: (abs(Fraction(float(f)) - exact),
                                          int(np.array(f).view(np.uint32)) & 1))  # fmt: skip


def test_the_reference_fma_rounds_once() -> None:
    """numpy's stand-in for an FMA against exact rational arithmetic: random terms,
    and sums built to sit at a float32 tie, where rounding the float64 sum to float32
    would round twice."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(4000) * np.exp2(rng.integers(-20, 20, 4000))).astype(np.float32)
    b = (rng.standard_normal(4000) * np.exp2(rng.integers(-20, 20, 4000))).astype(np.float32)
    c = (rng.standard_normal(4000) * np.exp2(rng.integers(-30, 30, 4000))).astype(np.float32)
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24, a float32 tie: 2^-60 more or less decides it,
    # which float64 drops (a sum rounded to float64, then to float32, rounds twice);
    # with -1 the product's rounding apart loses the 2^-24
    tie_a = np.full(3, 1 + 2**-12, dtype=np.float32)
    tie_c = np.array([2**-60, -(2**-60), -1], dtype=np.float32)
    a, b, c = np.concatenate([a, tie_a]), np.concatenate([b, tie_a]), np.concatenate([c, tie_c])
    got = tf.fma_reference(a, b, c)
    want = np.array([_rounded_once(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c, strict=True)], dtype=np.float32)  # fmt: skip
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    twice = (a[-3:].astype(np.float64) * b[-3:] + c[-3:]).astype(np.float32)
    assert got[-3] != twice[0] and got[-2] == twice[1]  # the tie broken up, then down
    assert got[-1] != np.float32(a[-1] * b[-1]) + c[-1]  # not a multiply, then an add


def test_keys_are_taken_back_before_rope_as_the_model_turned_them(model) -> None:
    """A key the model's RoPE turned to position p (kvcdn.kernels.rope, tested against
    the model's own keys for CacheBlend) comes back to the unturned key: the
    transform takes keys back, it does not turn them further."""
    from kvcdn.calibrate import _rotary_frequencies
    from kvcdn.kernels.rope import rotate_keys

    D = model.layout.head_dim
    inv_freq = _rotary_frequencies(model, D)
    assert inv_freq is not None and inv_freq.shape == (D // 2,)
    keys = torch.randn(2, 40, D, generator=torch.Generator().manual_seed(1))
    turned = rotate_keys(keys, torch.arange(900, 940), torch.from_numpy(inv_freq).float())
    cos, sin = tf.rope_tables(inv_freq, 900, 40)
    identity = np.broadcast_to(np.eye(D), (2, D, D))
    back = tf.analyse(turned.numpy(), identity, np.array([True, False]), cos, sin)
    assert np.allclose(back[0], keys[0].numpy(), atol=1e-4)
    assert np.array_equal(back[1], turned[1].numpy())  # a group not turned stays as it is


@pytest.fixture(scope="module")
def klt(profile) -> object:
    """The embedded profile, whose nested ladder codes KLT coefficients (`make
    embedded-profile`, as `kvcdn calibrate` makes profiles by default)."""
    assert profile.nested is not None and profile.nested.transform is not None
    return profile


def test_the_profile_holds_a_nested_ladder_with_measured_tiers(klt) -> None:
    profile = klt
    spec = profile.nested
    assert spec is not None and spec.tiers == NESTED_TIERS
    q = spec.quality
    bits = [q[t]["bits_per_element"] for t in spec.tiers]
    kls = [q[t]["kl"] for t in spec.tiers]
    assert bits == sorted(bits) and kls == sorted(kls, reverse=True)  # each tier adds
    assert bits[0] <= 1.6  # the rung below lowest, for the slowest links
    for tier in spec.tiers[1:]:
        # each refinement is as good as the independent level of its name, measured on
        # real objects (10% for the steps' rounding to 4 significant bits after planning)
        independent = profile.levels[tier].quality
        assert q[tier]["kl"] <= 1.1 * min(independent["kl"], LADDER[tier]), (tier, q[tier])
        # and costs at most 10% more than it (the price of nesting)
        assert q[tier]["bits_per_element"] <= 1.1 * independent["bits_per_element"], tier
    again = parse_profile(profile.to_bytes())
    assert again.nested is not None and np.array_equal(again.nested.depth, spec.depth)


@pytest.fixture(scope="module")
def doc_kv(model, sed_text):
    return model.prefill(model.document_ids(sed_text)[:512]).float()


def _spec_values(profile, kv: torch.Tensor, k: int, start: int, groups: np.ndarray | None = None,
                 *, kernel: bool = False) -> np.ndarray:  # fmt: skip
    """docs/format.md's values of tier k, in numpy: the coefficients' tier-k values
    (as tests/test_nested.py specifies them for channels), then the specified inverse,
    step by step, of ``groups`` only when given (``[len(groups), T, D]``: it takes
    about 6 s for all 180 groups of a chunk); with ``kernel``, the inverse kernel's
    values of every group instead (``[G, T, D]``), which
    test_the_inverse_kernel_is_the_specified_arithmetic_bit_for_bit holds to the spec."""
    from tests.test_nested import _spec_values as tier_values

    transform = profile.nested.transform
    L, two, H, T, D = kv.shape
    G = L * two * H
    y = transform.coefficients(kv.float().numpy().reshape(G, T, D), np.arange(G), H, start)
    coef = tier_values(profile, torch.from_numpy(y.reshape(kv.shape)), k).reshape(G, T, D)
    cos, sin = transform.rope_tables(start, T)
    if kernel:
        out = np.empty_like(coef)
        tf.synthesise(coef, transform.transposed(), transform.rotate(np.arange(G), H), cos, sin,
                      out)  # fmt: skip
        return out
    every = np.arange(G) if groups is None else groups
    return tf.synthesise_reference(coef[every], transform.transposed()[every],
                                   transform.rotate(every, H), cos, sin)  # fmt: skip


#: Groups whose values the tests check to the bit against the step-by-step inverse:
#: keys (turned back by RoPE) and values, every head, of the first, a middle and the
#: last layer; the inverse kernel is checked to the bit on its own, below.
SPEC_GROUPS = np.array([(layer * 2 + kv) * 3 + head for layer in (0, 14, 29)
                        for kv in (0, 1) for head in range(3)])  # fmt: skip


def test_every_tier_decodes_to_its_specified_values(klt, doc_kv) -> None:
    chunk = doc_kv[:, :, :, 256:512].contiguous()
    data = encode_chunk(nested_level("default", klt), chunk, HASH, profile=klt, start=256)
    header, _ = unpack(data)
    assert header.codec == "kvcdn-nested-klt-v1" and header.params["start"] == 256
    for k in range(len(NESTED_TIERS)):
        _, out = decode_chunk(data, profile=klt, tiers=k + 1, chunk_hash=HASH)
        got = out.numpy().reshape(-1, 256, 64)
        expected = _spec_values(klt, chunk, k, 256, SPEC_GROUPS)
        assert np.array_equal(got[SPEC_GROUPS].view(np.uint32), expected.view(np.uint32)), k
        every = _spec_values(klt, chunk, k, 256, kernel=True)
        assert np.array_equal(got.view(np.uint32), every.view(np.uint32)), NESTED_TIERS[k]
    # the transform itself inverts: coefficients of the chunk and back (the random
    # matrices do not fit the profile's steps, so the coded tiers are not close)
    transform, G = klt.nested.transform, 30 * 2 * 3
    x = chunk.numpy().reshape(G, 256, 64)
    y = transform.coefficients(x, np.arange(G), 3, 256)
    transform.values_into(y, np.arange(G), 3, 256, y)
    assert np.abs(y - x).max() < 1e-4 * np.abs(x).max()
    # the first chunk: sinks exact, the rest specified from position sinks on
    first = encode_chunk(nested_level("low", klt), doc_kv[:, :, :, :256].contiguous(), HASH,
                         profile=klt, start=0)  # fmt: skip
    _, out = decode_chunk(first, profile=klt, tiers=2)
    s = klt.sinks
    assert torch.equal(out[:, :, :, :s], doc_kv[:, :, :, :s].half().float())
    rest = out[:, :, :, s:].numpy().reshape(-1, 256 - s, 64)
    body = _spec_values(klt, doc_kv[:, :, :, s:256], 1, s, SPEC_GROUPS)
    assert np.array_equal(rest[SPEC_GROUPS], body)
    assert np.array_equal(rest, _spec_values(klt, doc_kv[:, :, :, s:256], 1, s, kernel=True))
    # the same values into a float16 tensor and into a window of a wider one
    half = torch.empty(out.shape, dtype=torch.float16)
    decode_into(first, TensorDest(half), profile=klt, part=Part.whole(30, 3, 2))
    assert torch.equal(half, out.half())
    wide = torch.zeros(30, 2, 3, 300, 64)
    decode_into(first, TensorDest(wide[:, :, :, 20:276]), profile=klt, part=Part.whole(30, 3, 2))
    assert torch.equal(wide[:, :, :, 20:276], out) and not wide[:, :, :, :20].any()


def test_a_rank_s_part_decodes_as_the_whole_does(klt, doc_kv) -> None:
    """A tensor-parallel rank's heads and a pipeline stage's layers: each head's matrix
    and rotation follow its group, wherever the part begins."""
    from kvcdn.container import parse_index

    chunk = doc_kv[:, :, :, 256:512].contiguous()
    data = encode_chunk(nested_level("default", klt), chunk, HASH, profile=klt, start=256)
    _, whole = decode_chunk(data, profile=klt, tiers=4)
    assert parse_index(data).tiers == len(NESTED_TIERS)
    for layers, heads in (((0, 30), (1, 3)), ((12, 20), (2, 3)), ((29, 30), (0, 1))):
        part = Part(layers, heads, 4)
        out = torch.empty(part.shape(whole.shape))
        decode_into(data, TensorDest(out), profile=klt, part=part)
        expected = whole[layers[0] : layers[1], :, heads[0] : heads[1]]
        assert torch.equal(out, expected), (layers, heads)


def test_values_of_groups_in_any_order_use_each_group_s_own_matrix(klt) -> None:
    """values_into takes a view of the matrices of consecutive groups; groups spanning
    the same range in another order get each its own matrix, as the reference does."""
    transform = klt.nested.transform
    rng = np.random.default_rng(5)
    y = rng.standard_normal((4, 7, 64)).astype(np.float32)
    cos, sin = transform.rope_tables(100, 7)
    for gids in ([8, 9, 10, 11], [8, 10, 9, 11], [11, 10, 9, 8]):
        g = np.array(gids)
        out = np.empty_like(y)
        transform.values_into(y, g, 3, 100, out)
        want = tf.synthesise_reference(y, transform.transposed()[g], transform.rotate(g, 3),
                                       cos, sin)  # fmt: skip
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), gids


def test_objects_and_profiles_that_do_not_fit_are_refused(klt, channels_profile, doc_kv
                                                          ) -> None:  # fmt: skip
    profile = channels_profile
    chunk = doc_kv[:, :, :, 256:512].contiguous()
    data = encode_chunk(nested_level("default", klt), chunk, HASH, profile=klt, start=256)
    plain = encode_chunk(nested_level("default", profile), chunk, HASH, profile=profile,
                         start=256)  # fmt: skip
    # a transformed object and a profile without the transform, and the other way
    # round: never coefficients read as channels
    with pytest.raises(FormatError, match="another codec profile|not the codec profile"):
        decode_chunk(data, profile=profile)
    with pytest.raises(FormatError, match="another codec profile|not the codec profile"):
        decode_chunk(plain, profile=klt)
    with pytest.raises(InputError, match="codec profile"):
        encode_chunk(nested_level("default", profile), chunk, HASH, profile=klt, start=256)
    # a header whose first position is missing or not one
    header, body = unpack(data)
    sections = [bytes(body.sections[i]) for i in range(len(body.sections))]
    for start in (None, -1, 1 << 31, "256", True):
        params = {k: v for k, v in header.params.items() if k != "start"}
        if start is not None:
            params["start"] = start
        bad = pack_sections(dataclasses.replace(header, params=params), sections)
        with pytest.raises(FormatError, match="first position"):
            decode_chunk(bad, profile=klt)
    # a different (valid) start decodes, to other values: positions are part of the object
    moved = pack_sections(dataclasses.replace(header, params={**header.params, "start": 512}),
                          sections)  # fmt: skip
    assert not torch.equal(decode_chunk(moved, profile=klt)[1], decode_chunk(data, profile=klt)[1])
    # ... but not where it would keep exact tokens that the sections do not hold (the
    # document's first ones), nor the sections' exact tokens where it keeps none: each
    # part of the object then keeps what the whole does
    first = pack_sections(dataclasses.replace(header, params={**header.params, "start": 0}),
                          sections)  # fmt: skip
    with pytest.raises(FormatError, match="exact tokens"):
        decode_chunk(first, profile=klt)
    opening = encode_chunk(nested_level("default", klt), doc_kv[:, :, :, :256].contiguous(),
                           HASH, profile=klt, start=0)  # fmt: skip
    head, kept = unpack(opening)
    late = pack_sections(dataclasses.replace(head, params={**head.params, "start": 256}),
                         [bytes(kept.sections[i]) for i in range(len(kept.sections))])
    with pytest.raises(FormatError, match="exact tokens"):
        decode_chunk(late, profile=klt)
    part = Part((0, 30), (1, 2))
    with pytest.raises(FormatError, match="exact tokens"):
        decode_into(late, TensorDest(torch.empty(part.shape(head.shape))), profile=klt,
                    part=part)  # fmt: skip
    # params beside the specified ones
    extra = pack_sections(dataclasses.replace(header, params={**header.params, "note": 1}),
                          sections)  # fmt: skip
    with pytest.raises(FormatError, match="params"):
        decode_chunk(extra, profile=klt)


def test_profiles_with_a_transform_that_does_not_fit_are_refused(klt) -> None:
    import json
    import struct

    from safetensors.numpy import load, save

    data = klt.to_bytes()
    again = parse_profile(data)
    assert again.sha256 == klt.sha256 and again.nested.transform is not None
    (header_len,) = struct.unpack("<Q", data[:8])
    meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["kvcdn"])
    arrays = load(data)

    def parse(arrays, name="klt-v1") -> None:
        meta["nested"]["transform"] = name
        if name is None:
            del meta["nested"]["transform"]
        parse_profile(save(arrays, metadata={"kvcdn": json.dumps(meta)}))

    with pytest.raises(FormatError, match="nested.transform must be"):
        parse(arrays, "dct-v9")
    with pytest.raises(FormatError, match="without nested.transform"):
        parse(arrays, None)
    nan = arrays["nested.transform.synthesis"].copy()
    nan[3, 1, 2, 5, 7] = np.nan
    with pytest.raises(FormatError, match="non-finite or out-of-range"):
        parse(dict(arrays, **{"nested.transform.synthesis": nan}))
    with pytest.raises(FormatError, match="nested.transform.synthesis"):
        parse(dict(arrays, **{"nested.transform.synthesis": nan[..., :32]}))
    freq = arrays["nested.transform.inv_freq"].copy()
    freq[0] = -1.0
    with pytest.raises(FormatError, match="rotary frequencies"):
        parse(dict(arrays, **{"nested.transform.inv_freq": freq}))
    # no frequencies: a transform that turns nothing (a model without RoPE)
    parse({k: v for k, v in arrays.items() if k != "nested.transform.inv_freq"})


def test_a_publication_with_a_transform_loads_what_its_objects_decode_to(
    model, klt, sed_text, tmp_path, monkeypatch
) -> None:
    """A store whose codec profile has a transform: a nested publish writes
    kvcdn-nested-klt-v1 objects, each chunk's at its own position, and a load at a
    level holds what decoding that level's tiers gives."""
    # a publish keeps the profile it used in this machine's cache, where the suite's
    # later publishes to new stores would find it: a cache of this test's own
    monkeypatch.setenv("KVCDN_PROFILE_CACHE", str(tmp_path / "profiles"))
    from kvcdn.catalog import read_manifest
    from kvcdn.models import kv_from_cache
    from kvcdn.profile_store import publish_profile
    from kvcdn.publish import publish
    from kvcdn.sdk import load_context
    from kvcdn.store import open_store

    root = tmp_path / "store"
    store = open_store(str(root))
    publish_profile(store, klt)
    publish(text=sed_text[:6000], name="sed-klt", model=model, store=str(root), levels="nested")
    manifest = read_manifest(store, "sed-klt", None)
    assert manifest.codec_profile.sha256 == klt.sha256
    chunks = manifest.chunks
    for level in ("low", "high"):
        ctx = load_context("sed-klt", model=model, store=str(root), quality=level)
        assert ctx.plan.chunk_levels == [level] * len(chunks)
        kv = kv_from_cache(ctx.cache)
        for c in (chunks[0], chunks[-1]):
            header, want = decode_chunk(store.get(c.objects[level]), profile=klt,
                                        tiers=c.objects[level].tiers.count)  # fmt: skip
            assert header.codec == "kvcdn-nested-klt-v1" and header.params["start"] == c.start
            got = kv[:, :, :, c.start : c.end]
            assert torch.equal(got, want.to(got.dtype))


_DECODE_AFTER_WARM_UP = """
import sys
import torch
from kvcdn.codec import decode_chunk, decode_into, warm_up
from kvcdn.codec_profile import parse_profile
from kvcdn.codecs import TensorDest
from kvcdn.container import Part
from kvcdn.kernels import transform

warm_up()  # what an sdk.Client starts in the background
warmed = {str(s) for s in transform._synthesise.signatures}
profile = parse_profile(open(sys.argv[1], "rb").read())
for path in sys.argv[2:]:
    data = open(path, "rb").read()
    _, whole = decode_chunk(data, profile=profile)
    decode_into(data, TensorDest(torch.empty(whole.shape, dtype=torch.float16)),
                profile=profile, part=Part.whole(30, 3, 4))
    wide = torch.zeros(30, 2, 3, 300, 64)
    decode_into(data, TensorDest(wide[:, :, :, 20:276]), profile=profile, part=Part.whole(30, 3, 4))
    decode_into(data, TensorDest(torch.empty(30, 2, 2, 256, 64)), profile=profile,
                part=Part((0, 30), (1, 3), 4))
print(sorted({str(s) for s in transform._synthesise.signatures} - warmed))
"""


def test_the_warm_up_loads_every_inverse_a_decode_runs(klt, doc_kv, tmp_path) -> None:
    """A fresh process's warm-up (kvcdn.codec.warm_up, which an sdk.Client runs in the
    background) loads the inverse in every array layout its decodes then run: the
    first chunk (a window after its sinks), a later one (whole), into float32,
    float16, a window of a wider tensor and a rank's heads. Without it, a machine's
    first transformed decode compiled the kernel (4.7 s now, 1.7 s before its sums were
    held in registers)."""
    (tmp_path / "profile").write_bytes(klt.to_bytes())
    objects = []
    for start in (0, 256):
        chunk = doc_kv[:, :, :, start : start + 256].contiguous()
        path = tmp_path / f"chunk{start}"
        path.write_bytes(encode_chunk(nested_level("default", klt), chunk, HASH, profile=klt,
                                      start=start))  # fmt: skip
        objects.append(str(path))
    done = subprocess.run([sys.executable, "-c", _DECODE_AFTER_WARM_UP, str(tmp_path / "profile"),
                           *objects], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"compiled after the warm-up: {done.stdout}"


# ---- the Triton inverse: in the interpreter (a child process), and on a GPU when lent ----


def _interpret(jobs: Path) -> None:
    """The interpreted kernel on each job's coefficients (child process)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from kvcdn.kernels import transform_triton

    transform_triton.warm_up("cpu", 64)  # runs, for both kinds of token count
    for path in sorted(jobs.glob("*.in.npz")):
        job = {k: torch.from_numpy(v) for k, v in np.load(path).items()}
        wide = job["y"]  # the coefficients are a strided view, as a decode's are
        y = wide[:, 3:]
        out = torch.full(y.shape, 7.0)
        transform_triton.synthesise(y, job["mt"], job["rotate"], job["cos"], job["sin"], out)
        refused = False
        try:
            transform_triton.synthesise(y, job["mt"], job["rotate"], job["cos"], job["sin"], y)
        except ValueError:
            refused = True
        np.savez(str(path).replace(".in.npz", ".out.npz"), out=out.numpy(),
                 refused=np.array(refused))  # fmt: skip


def test_the_triton_inverse_is_the_cpu_one_bit_for_bit(tmp_path) -> None:
    pytest.importorskip("triton")
    rng = np.random.default_rng(11)
    cases = {}
    for G, T, D in ((5, 37, 64), (3, 16, 128)):
        wide = (rng.standard_normal((G, T + 3, D)) * 4).astype(np.float32)
        mt = (rng.standard_normal((G, D, D)) / 8).astype(np.float32)
        rotate = (np.arange(G) % 2 == 0).astype(np.int32)
        cos, sin = tf.rope_tables(10000.0 ** (-np.arange(0, D, 2) / D), 300, T)
        cases[f"{G}x{T}x{D}"] = dict(y=wide, mt=mt, rotate=rotate, cos=cos, sin=sin)
        np.savez(tmp_path / f"{G}x{T}x{D}.in.npz", **cases[f"{G}x{T}x{D}"])
    root = str(Path(__file__).parents[1])
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    for name, case in cases.items():
        got = np.load(tmp_path / f"{name}.out.npz")
        y = np.ascontiguousarray(case["y"][:, 3:])
        want = np.empty_like(y)
        tf.synthesise(y, case["mt"], case["rotate"].astype(bool), case["cos"], case["sin"], want)
        assert np.array_equal(got["out"].view(np.uint32), want.view(np.uint32)), name
        assert got["refused"], "an output over its own coefficients must be refused"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decodes_transformed_objects_as_the_cpu_does(klt, doc_kv) -> None:
    chunk = doc_kv[:, :, :, :256].contiguous()  # with the sinks
    data = encode_chunk(nested_level("default", klt), chunk, HASH, profile=klt, start=0)
    for k in (1, 4, len(NESTED_TIERS)):
        _, cpu = decode_chunk(data, profile=klt, tiers=k)
        part = Part.whole(30, 3, k)
        for dtype in (torch.float32, torch.bfloat16):
            gpu = torch.empty(cpu.shape, dtype=dtype, device="cuda")
            decode_into(data, TensorDest(gpu), profile=klt, part=part)
            assert torch.equal(gpu.cpu(), cpu.to(dtype)), (k, dtype)
        heads = torch.zeros(30, 2, 5, 256, 64, device="cuda")
        decode_into(data, TensorDest(heads[:, :, 1:4]), profile=klt, part=part)
        assert torch.equal(heads[:, :, 1:4].cpu(), cpu) and not heads[:, :, 0].any()


if __name__ == "__main__":  # the interpreter child process
    _interpret(Path(sys.argv[1]))
