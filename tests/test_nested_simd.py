"""The nested ladder's vector decoder (sixteen groups at a time) against the scalar one,
bit for bit, on streams the real encoder made from the embedded model's KV with its
calibrated profile: every tier, group counts that fill no block, sliced outputs, and
damaged streams, which both refuse naming the same group."""

from __future__ import annotations

import numpy as np
import pytest

from kvcdn.kernels import nested, nested_simd, simd
from kvcdn.kernels.rans import RansError

pytestmark = pytest.mark.skipif(not simd.AVAILABLE, reason="the host has no AVX-512 or AVX2")

TOKENS = 24
ARRAYS = ("words", "wbeg", "wend", "states", "lut", "cum", "mean", "fine", "depth", "lo",
          "base", "refine", "stride")  # fmt: skip
SETUP = ("depth", "lo", "base", "refine", "cum", "mean", "fine")  # block_setup's, in order


@pytest.fixture(scope="module")
def streams(profile, model, sed_text) -> dict[str, np.ndarray]:
    """Every group of 24 real tokens (with values far outside the tables, and a NaN,
    which the encoder clips), coded by the real encoder; words read-only, as a payload's."""
    kv = model.prefill(model.document_ids(sed_text)[: TOKENS + 8])[:, :, :, 8:]
    mean, fine, depth, lo, size, base, refine, stride = profile.nested_arrays()
    x = kv.float().numpy().reshape(-1, TOKENS, kv.shape[4]).copy()
    x[0, 1, 3], x[17, 2, 5], x[100, 0, 7] = 1e4, -1e4, np.nan
    states, words, start = nested.encode(x, mean, fine, depth, lo, size, base, refine, stride,
                                         profile.freqs)  # fmt: skip
    first = np.cumsum([0] + [len(w) for w in words])[:, None]
    joined = np.concatenate([*words, np.zeros(4, np.uint16)])  # as the codec pads them
    joined.setflags(write=False)
    return {
        "words": joined, "wbeg": start[:, :-1] + first[:-1], "wend": start[:, 1:] + first[:-1],
        "states": states, "lut": profile.decode_tables(), "cum": profile.table_starts(),
        "mean": mean, "fine": fine, "depth": depth, "lo": lo, "base": base, "refine": refine,
        "stride": np.array(stride),
    }  # fmt: skip


def groups_of(case: dict[str, np.ndarray], groups: np.ndarray) -> dict[str, np.ndarray]:
    """The streams of some groups (each array's group axis is its second-to-last but
    the words', the tables' and the states' middle one)."""
    out = dict(case)
    for a in ("wbeg", "wend"):
        out[a] = case[a][:, groups]
    out["states"] = case["states"][:, groups]
    for a in ("mean", "fine", "lo", "base", "depth", "refine"):
        out[a] = case[a][..., groups, :]
    return out


def decode(case: dict[str, np.ndarray], k: int, vector: bool, sliced: bool) -> np.ndarray:
    G, D = case["mean"].shape
    whole = np.full((G, TOKENS + 3, D), np.nan, dtype=np.float32)
    out = whole[:, 3:] if sliced else whole[:, :TOKENS]
    assert nested_simd.usable(out, case["words"], case["lut"], case["wbeg"], case["wend"])
    nested.decode(k, *(case[a] for a in ARRAYS), out, vector)
    return out


@pytest.mark.parametrize("groups", [180, 17, 16, 1], ids=lambda g: f"{g}_groups")
def test_vector_decoder_equals_the_scalar_one_at_every_tier(streams, groups: int) -> None:
    rng = np.random.default_rng(groups)
    case = groups_of(streams, np.sort(rng.choice(180, groups, replace=False)))
    coded = case["depth"][1:] != case["depth"][:-1]
    assert groups < 16 or coded.any(axis=(1, 2)).all()  # every tier codes lanes
    for k in range(case["depth"].shape[0]):
        for sliced in (False, True):
            want = decode(case, k, False, sliced)
            got = decode(case, k, True, sliced)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (k, sliced)
            assert np.isfinite(got).all()


@pytest.mark.parametrize("how", ["truncate", "bad_state", "flip_word", "late_group"])
def test_vector_decoder_refuses_what_the_scalar_one_refuses(streams, how: str) -> None:
    """A damaged tier 2 of one group (or of the last group of a padded block): both
    decoders raise, naming that group."""
    case = {a: v.copy() for a, v in streams.items()}
    g = 179 if how == "late_group" else 37
    if how == "truncate":
        case["wend"][2, g] -= 1
    elif how in ("bad_state", "late_group"):
        case["states"][2, g, 1] ^= 1
    else:
        at = (case["wbeg"][2, g] + case["wend"][2, g]) // 2
        case["words"][at] ^= 0x5A5A
    for vector in (False, True):
        with pytest.raises(RansError, match=f"group {g}:"):
            decode(case, 2, vector, sliced=True)
    decode(case, 1, True, sliced=True)  # the tiers below are whole


def test_shapes_the_vector_decoder_does_not_take_use_the_scalar_one(streams) -> None:
    """Rows of 20 lanes (not whole vectors), a last axis with a stride and words with
    none after the last stream are refused by the vector decoder; ``decode`` then
    decodes them group by group, the same values."""
    case = groups_of(streams, np.arange(20))
    bounds = case["words"], case["lut"], case["wbeg"], case["wend"]
    assert not nested_simd.usable(np.empty((20, TOKENS, 20), np.float32), *bounds)
    strided = np.empty((20, TOKENS, 128), dtype=np.float32)[:, :, ::2]
    assert not nested_simd.usable(strided, *bounds)
    last = int(case["wend"].max())  # a read takes two words: none after the last stream
    assert not nested_simd.usable(np.empty((20, TOKENS, 64), np.float32),
                                  case["words"][:last], *bounds[1:])  # fmt: skip
    want = decode(case, 3, False, sliced=False)
    nested.decode(3, *(case[a] for a in ARRAYS), strided)
    assert np.array_equal(strided.view(np.uint32), want.view(np.uint32))
    # words every other one of a buffer (its gathers would read the ones between), and
    # base ranges whose indices 32-bit lanes do not hold: the scalar kernel's values
    between = np.full(2 * len(case["words"]), 0xBEEF, np.uint16)
    between[::2] = case["words"]
    spread = dict(case, words=between[::2])
    assert not nested_simd.usable(np.empty((20, TOKENS, 64), np.float32), spread["words"],
                                  *bounds[1:])  # fmt: skip
    out = np.empty((20, TOKENS, 64), np.float32)
    nested.decode(3, *(spread[a] for a in ARRAYS), out)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    wide = case["lo"].copy()
    wide[0, 0] = 1 << 30
    assert nested_simd.usable(out, *bounds, lo=case["lo"])
    assert not nested_simd.usable(out, *bounds, lo=wide)


def test_blocks_take_fewer_steps_than_groups_sorted_by_their_counts(streams) -> None:
    """The planned order is an order of the groups; each block's steps are the most
    lanes one of its groups codes in each tier; and the blocks take fewer steps than
    with the groups sorted by their tiers' counts (the order the planner replaced)."""
    depth = streams["depth"]
    for k in (2, 3, depth.shape[0] - 1):
        order = nested_simd.block_order(k, depth)
        assert sorted(order.tolist()) == list(range(180))
        counts = nested_simd.coded_lanes(k, depth)
        steps = nested_simd.block_steps(k, depth, order)
        for b, taken in enumerate(steps):
            assert taken == counts[:, order[b * 16 : (b + 1) * 16]].max(axis=1).sum()
        by_counts = np.lexsort(counts[::-1])
        assert steps.sum() < nested_simd.block_steps(k, depth, by_counts).sum(), k
    assert nested_simd.block_order(0, depth).tolist() == list(range(180))


def tables_of(case: dict[str, np.ndarray]) -> nested_simd.VectorTables:
    return nested_simd.vector_tables(case["lut"], case["cum"], case["base"], int(case["stride"]))


def setup_of(case: dict[str, np.ndarray], k: int, plan: nested_simd.BlockPlan
             ) -> nested_simd.BlockSetup:  # fmt: skip
    args = (case[a] for a in SETUP)
    return nested_simd.block_setup(plan, k, *args, int(case["stride"]), tables_of(case))


def test_any_order_of_the_groups_decodes_the_same_and_others_are_refused(streams) -> None:
    """The order shares groups out to blocks and blocks to threads, nothing else: the
    values are the scalar decoder's whatever the order; an order that is not one of
    the groups is refused before the kernel runs (its indices are not bounds-checked)."""
    k = streams["depth"].shape[0] - 1
    want = decode(streams, k, False, sliced=True)
    arrays = [streams[a] for a in ARRAYS]
    for order in (np.arange(180)[::-1].copy(), np.random.default_rng(1).permutation(180)):
        got = np.full_like(want, np.nan)
        plan = nested_simd.BlockPlan(order.astype(np.int64), np.zeros(12, np.int64))
        nested.decode(k, *arrays, got, block_setup=setup_of(streams, k, plan))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    for bad in (np.zeros(180), np.arange(179), np.arange(1, 181)):
        plan = nested_simd.BlockPlan(bad.astype(np.int64), np.zeros(12, np.int64))
        with pytest.raises(ValueError, match="block plan"):
            setup_of(streams, k, plan)
    plan = nested_simd.BlockPlan(np.arange(180), np.zeros(11, np.int64))  # 12 blocks
    with pytest.raises(ValueError, match="block plan"):
        setup_of(streams, k, plan)


def test_a_block_setup_is_taken_only_for_arrays_of_its_shapes(streams) -> None:
    """A block setup (made once per profile, tiers and groups, then read by the kernel
    without bounds checks) is refused for other tiers, groups or lanes, another
    stride, or vector tables fewer than its base steps start in; one made for the
    arrays decodes as the scalar kernel does, chunk after chunk."""
    k = streams["depth"].shape[0] - 1
    arrays = [streams[a] for a in ARRAYS]
    plan = nested_simd.plan_blocks(k, streams["depth"])
    setup = setup_of(streams, k, plan)
    want = decode(streams, k, False, sliced=True)
    for _ in range(2):
        got = np.full_like(want, np.nan)
        nested.decode(k, *arrays, got, block_setup=setup)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not any(a.flags.writeable for a in setup.arrays)  # shared by every decode
    lower = setup_of(streams, k - 1, nested_simd.plan_blocks(k - 1, streams["depth"]))
    with pytest.raises(ValueError, match="block setup"):
        nested.decode(k, *arrays, np.empty_like(want), block_setup=lower)
    few = groups_of(streams, np.arange(20))
    with pytest.raises(ValueError, match="block setup"):
        nested.decode(k, *(few[a] for a in ARRAYS), np.empty((20, TOKENS, 64), np.float32),
                      block_setup=setup)  # fmt: skip
    one = tables_of(dict(streams, base=np.full_like(streams["base"], streams["base"][0, 0])))
    assert one.tables == 3 < setup.tables  # the setup's base tables past these
    with pytest.raises(ValueError, match="block setup"):
        nested.decode(k, *arrays, np.empty_like(want), vector_tables=one, block_setup=setup)
    lut = streams["lut"][: int(streams["base"].max())]  # tables of other decode tables
    with pytest.raises(ValueError, match="vector tables"):
        nested.decode(k, *arrays, np.empty_like(want), vector_tables=tables_of(
            dict(streams, lut=lut, cum=streams["cum"][: len(lut)], base=streams["base"] % 3)))
    without = nested_simd.vector_tables(streams["lut"], streams["cum"], streams["base"], 0)
    with pytest.raises(ValueError, match="vector tables"):  # made for one table a base
        nested_simd.block_setup(plan, k, *(streams[a] for a in SETUP), int(streams["stride"]),
                                without)  # fmt: skip
    tables = tables_of(streams)
    assert not tables.entries.flags.writeable  # shared by every chunk's decode
    backwards = tables._replace(entries=np.ascontiguousarray(tables.entries)[::-1])
    with pytest.raises(ValueError, match="vector tables"):  # its gathers ignore strides
        nested.decode(k, *arrays, np.empty_like(want), vector_tables=backwards,
                      block_setup=setup)  # fmt: skip
    with pytest.raises(ValueError, match="vector tables"):
        nested.decode(k, *arrays, np.empty_like(want), block_setup=setup,
                      vector_tables=tables._replace(entries=tables.entries.astype(np.uint16)))
    assert not plan.order.flags.writeable and not plan.steps.flags.writeable
    mine = nested_simd.BlockPlan(np.arange(180), plan.steps)  # a plan the caller can change
    changed = setup_of(streams, k, mine)
    mine.order[3] = 1 << 40  # after its setup was made
    with pytest.raises(ValueError, match="block plan"):
        nested.decode(k, *arrays, np.empty_like(want), block_setup=changed)
    shifted = dict(streams, base=streams["base"] + 1)  # tables no base starts at
    with pytest.raises(ValueError, match="not one of the vector tables"):
        nested_simd.block_setup(plan, k, *(shifted[a] for a in SETUP), int(streams["stride"]),
                                tables_of(streams))  # fmt: skip
    with pytest.raises(ValueError, match="do not fit"):
        setup_of(dict(streams, lo=streams["lo"][:20]), k, plan)
    bad = streams["refine"].copy()
    bad[0, 0, 0, 0] = len(streams["cum"])
    with pytest.raises(ValueError, match="table"):
        setup_of(dict(streams, refine=bad), k, plan)


def test_streams_of_one_base_table_with_other_ranges_decode_as_the_scalar_one(
        streams, profile, model, sed_text) -> None:  # fmt: skip
    """A base step takes its next context from the sign of its lane's own index, not from
    its table: a stream whose range differs from the other streams of its table (what
    the profile's parser refuses, and the vector tables once refused too) decodes to
    the scalar decoder's values. Vector tables of decode tables whose slots are not
    their symbols' frequencies are refused."""
    kv = model.prefill(model.document_ids(sed_text)[: TOKENS + 8])[:, :, :, 8:]
    mean, fine, depth, lo, size, base, refine, stride = profile.nested_arrays()
    lo = lo.copy()
    lo[1, 0] += 1  # every index of the stream one more: contexts moved
    lo[2, 5] -= 2
    x = kv.float().numpy().reshape(-1, TOKENS, kv.shape[4])
    states, words, start = nested.encode(x, mean, fine, depth, lo, size, base, refine, stride,
                                         profile.freqs)  # fmt: skip
    first = np.cumsum([0] + [len(w) for w in words])[:, None]
    case = dict(streams, words=np.concatenate([*words, np.zeros(4, np.uint16)]),
                wbeg=start[:, :-1] + first[:-1], wend=start[:, 1:] + first[:-1], states=states,
                lo=lo)  # fmt: skip
    for k in range(depth.shape[0]):
        want = decode(case, k, False, sliced=False)
        assert np.array_equal(decode(case, k, True, sliced=False).view(np.uint32),
                              want.view(np.uint32)), k  # fmt: skip
    lut = streams["lut"].copy()
    table = int(base[0, 0])
    lut[table, 0] = (lut[table, 0] & ~np.uint32(0xFF)) | np.uint32(lut[table, -1] & 0xFF)
    with pytest.raises(ValueError, match="frequencies"):
        tables_of(dict(streams, lut=lut))
    with pytest.raises(ValueError, match="frequencies"):  # symbols past the starts given
        tables_of(dict(streams, cum=streams["cum"][:, :2]))


def test_a_profile_without_contexts_decodes_as_the_scalar_one_does(profile, model,
                                                                    sed_text) -> None:
    """Stride 0 (a profile made before contexts: one base table a stream, one ternary
    table per parent context): a base step then stays in its one table, and the vector
    decoder still gives the scalar one's values at every tier."""
    kv = model.prefill(model.document_ids(sed_text)[: TOKENS + 8])[:, :, :, 8:]
    mean, fine, depth, lo, size, base, refine, _ = profile.nested_arrays()
    x = kv.float().numpy().reshape(-1, TOKENS, kv.shape[4]).copy()
    states, words, start = nested.encode(x, mean, fine, depth, lo, size, base, refine, 0,
                                         profile.freqs)  # fmt: skip
    first = np.cumsum([0] + [len(w) for w in words])[:, None]
    case = {
        "words": np.concatenate([*words, np.zeros(4, np.uint16)]),
        "wbeg": start[:, :-1] + first[:-1], "wend": start[:, 1:] + first[:-1],
        "states": states, "lut": profile.decode_tables(), "cum": profile.table_starts(),
        "mean": mean, "fine": fine, "depth": depth, "lo": lo, "base": base, "refine": refine,
        "stride": np.array(0),
    }  # fmt: skip
    for k in range(depth.shape[0]):
        want = decode(case, k, False, sliced=True)
        assert np.array_equal(decode(case, k, True, sliced=True).view(np.uint32),
                              want.view(np.uint32)), k  # fmt: skip


def test_decode_refuses_tiers_states_and_tables_that_do_not_fit(streams) -> None:
    """Neither kernel checks its indices, so the arrays are checked first: tiers past the
    streams' (which crashed both kernels), a state below the coder's range and a table
    past the decode tables are refused before a kernel runs."""
    R = streams["depth"].shape[0]
    out = np.empty((180, TOKENS, 64), np.float32)
    with pytest.raises(ValueError, match="tiers"):
        nested.decode(R, *(streams[a] for a in ARRAYS), out)
    low = dict(streams, states=streams["states"].copy())
    low["states"][1, 5, 2] = 5
    with pytest.raises(ValueError, match="state"):
        nested.decode(2, *(low[a] for a in ARRAYS), out)
    far = dict(streams, base=streams["base"].copy())
    far["base"][3, 3] = streams["lut"].size // 4096 - 2  # its contexts' tables run past
    with pytest.raises(ValueError, match="table"):
        nested.decode(1, *(far[a] for a in ARRAYS), out)


def test_rows_that_do_not_start_at_an_element_take_the_scalar_kernel(streams) -> None:
    """An output whose token rows are 258 bytes apart (a view of a byte buffer) is not
    the vector kernel's, which writes whole elements from each row's first: decoded
    there, it holds what an aligned output holds."""
    want = decode(streams, 2, False, sliced=False)
    raw = np.zeros(180 * TOKENS * 258 + 16, np.uint8)
    flat = raw[2 : 2 + (len(raw) - 16) // 4 * 4].view(np.float32)
    odd = np.lib.stride_tricks.as_strided(flat, shape=(180, TOKENS, 64),
                                          strides=(TOKENS * 258, 258, 4))  # fmt: skip
    assert not nested_simd.usable(odd, streams["words"], streams["lut"], streams["wbeg"],
                                  streams["wend"])  # fmt: skip
    nested.decode(2, *(streams[a] for a in ARRAYS), odd)
    assert np.array_equal(np.ascontiguousarray(odd).view(np.uint32), want.view(np.uint32))


def test_decode_refuses_stream_arrays_of_other_groups_or_lanes(streams) -> None:
    """Per-stream arrays (here the means) of fewer groups than the output are refused,
    not read past their ends."""
    short = dict(streams, mean=streams["mean"][:100])
    with pytest.raises(ValueError, match="groups and lanes"):
        nested.decode(1, *(short[a] for a in ARRAYS), np.empty((180, TOKENS, 64), np.float32))
