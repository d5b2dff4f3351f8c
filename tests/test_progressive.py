"""Nested quantisation (kvcdn.progressive): levels that nest exactly, and refinements
that only add information."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcdn import progressive as pg


def _plan(streams: int, levels: int, seed: int) -> pg.NestedPlan:
    rng = np.random.default_rng(seed)
    plan = pg.base_plan(rng.uniform(0.05, 2.0, streams))
    for _ in range(levels):
        plan = plan.with_level(rng.random(streams) < 0.5)
    return plan


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), levels=st.integers(1, 5))
def test_every_level_is_the_midtread_quantiser_of_its_step(seed: int, levels: int) -> None:
    """Level k of a stream is round(x / step_k), step_k = base / 3**splits: the nested
    indices equal a direct quantisation wherever a value is not on a cell boundary."""
    rng = np.random.default_rng(seed)
    plan = _plan(16, levels, seed)
    x = rng.standard_normal((16, 300)) * rng.uniform(0.01, 3, (16, 1))
    for k, n in enumerate(pg.indices(x, plan)):
        step = plan.step(k)[:, None]
        direct = np.clip(np.rint(x / step), None, None)
        inside = np.abs(np.abs(x / step - np.rint(x / step)) - 0.5) > 1e-9
        base_range = np.abs(x) < (pg.BASE_LIMIT + 0.5) * plan.base_step[:, None]
        ok = inside & base_range
        assert np.array_equal(n[ok], direct[ok].astype(np.int64))
        # and every reconstruction is within half a step of its value
        err = np.abs(pg.reconstruct(n, plan, k) - x)
        assert np.all(err[base_range] <= step.repeat(x.shape[1], 1)[base_range] / 2 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_refinement_symbol_and_its_parent_give_back_the_child(seed: int) -> None:
    """What a decoder does: child = 3 * parent + c - 1, with c recovered from the coded
    symbol and the parent's sign; unsplit streams keep their index."""
    rng = np.random.default_rng(seed)
    plan = _plan(8, 3, seed)
    x = rng.standard_normal((8, 200)) * 40 * plan.base_step[:, None]  # some clipped
    n = pg.indices(x, plan)
    for k in range(1, plan.levels):
        split = plan.depth[k] > plan.depth[k - 1]
        assert np.array_equal(n[k][~split], n[k - 1][~split])
        parent, child = n[k - 1][split], n[k][split]
        if not parent.size:  # a tier that splits none of these streams
            continue
        sym, ctx = pg.refinement_symbols(parent, child)
        assert sym.min() >= 0 and sym.max() < pg.SPLIT and ctx.max() < pg.CONTEXTS
        c = np.where(parent < 0, pg.SPLIT - 1 - sym, sym)
        assert np.array_equal(pg.SPLIT * parent + c - 1, child)
    assert np.abs(n[0]).max() <= pg.BASE_LIMIT


def test_refinements_cost_what_they_add_and_the_base_what_it_holds() -> None:
    """Sizes: a refinement that splits nothing is free; one that splits every stream of
    wide Gaussian data costs about log2(3) bits; the chain rule makes base plus one
    refinement cost what the finer quantiser alone does, give or take the context."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 20000)) * 4.0
    plan = pg.base_plan(np.full(32, 1.0))
    none = plan.with_level(np.zeros(32, dtype=bool))
    assert pg.level_bits(x, none)[1] == pytest.approx(pg.level_bits(x, none)[0])
    every = plan.with_level(np.ones(32, dtype=bool))
    base, refined = pg.level_bits(x, every)
    assert refined - base == pytest.approx(np.log2(3), abs=0.02)
    direct = pg.base_bits(np.rint(x / (1 / 3)).astype(np.int64))  # within +-127? yes: 4 sd*3
    assert refined == pytest.approx(float(direct.mean()), abs=0.02)


def test_planning_splits_the_streams_of_most_benefit_per_bit_until_the_target_is_met() -> None:
    """With a KL stand-in that is the Fisher-weighted squared step, the planner splits
    the sensitive streams first and no more than the target needs."""
    rng = np.random.default_rng(1)
    streams = 64
    fisher = np.where(np.arange(streams) < 16, 100.0, 1.0)
    x = rng.standard_normal((streams, 4000))
    base = np.full(streams, 1.0)

    def kl_of(plan: pg.NestedPlan) -> float:
        return float((fisher * plan.step(plan.levels - 1) ** 2).sum())

    start = kl_of(pg.base_plan(base))
    plan = pg.plan_levels(x, base, fisher, kl_of, [start * 0.15])
    split = plan.depth[1] > 0
    assert split[:16].all()  # the sensitive streams are split first
    assert kl_of(plan) <= start * 0.15
    assert split.sum() < streams  # and not every other one with them
    with pytest.raises(ValueError, match="at most once"):
        pg.NestedPlan(plan.base_step, np.vstack([plan.depth, plan.depth[-1:] + 2]))


def _entropy_by_bincount(sym: np.ndarray, bins: int) -> np.ndarray:
    """Bits per element of each row, counted with numpy (the kernels' reference)."""
    rows, count = sym.shape
    flat = (np.arange(rows)[:, None] * bins + sym).ravel()
    c = np.bincount(flat, minlength=rows * bins).reshape(rows, bins).astype(np.float64)
    p = c / count
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(c > 0, p * np.log2(p), 0.0).sum(axis=1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), levels=st.integers(1, 4), sinks=st.integers(0, 6))
def test_the_calibration_kernels_give_the_numpy_definitions_bit_for_bit(
    seed: int, levels: int, sinks: int
) -> None:
    """What calibration measures comes from kernels (kvcdn.kernels.nested_stats): the
    reconstruction at each level equals the numpy chain bit for bit (NaN, infinity and
    clipped values included), and the sizes equal counts made with numpy's bincount."""
    rng = np.random.default_rng(seed)
    L, K, H, T, D = 2, 2, 3, 40, 8
    kv = (rng.standard_normal((L, K, H, T, D))
          * rng.uniform(0.01, 300, (L, K, H, 1, D))).astype(np.float32)  # fmt: skip
    kv.flat[rng.integers(0, kv.size, 3)] = [np.nan, np.inf, -np.inf]
    mean = rng.standard_normal((L, K, H, D)).astype(np.float32)
    plan = _plan(L * K * H * D, levels, seed)
    # ties: power-of-two steps, and values halfway between two cells of the streams
    # never split (rounding half to even, as numpy's rint does)
    plan = pg.NestedPlan(2.0 ** rng.integers(-3, 3, plan.base_step.shape), plan.depth)
    whole = (plan.depth[-1] == 0).reshape(L, K, H, D)
    mean[whole] = 0.0
    ties = (rng.integers(-20, 20, kv.shape) + 0.5) * plan.base_step.reshape(L, K, H, 1, D)
    kv = np.where(whole[:, :, :, None, :] & (rng.random(kv.shape) < 0.5), ties, kv)
    kv = kv.astype(np.float32)
    x = pg.streams_of(kv[:, :, :, sinks:], mean)
    for k in range(plan.levels):
        with np.errstate(invalid="ignore"):
            value = pg.values_of(pg.reconstruct(pg.level_indices(x, plan, k), plan, k), mean)
        want = kv.copy()
        want[:, :, :, sinks:] = value
        got = pg.level_values(kv, mean, plan, k, sinks)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert pg.base_level_bits(x, plan.base_step) == pg.level_bits(
        x, pg.base_plan(plan.base_step))[0]  # fmt: skip
    n = pg.indices(np.nan_to_num(x, posinf=0.0, neginf=0.0), plan)
    assert np.array_equal(pg.base_bits(n[0]), _entropy_by_bincount(n[0] + pg.BASE_LIMIT, 255))
    for k in range(1, plan.levels):
        split = ~np.all(n[k] == n[k - 1], axis=1)
        want_bits = np.zeros(len(split))
        if split.any():
            sym, ctx = pg.refinement_symbols(n[k - 1][split], n[k][split])
            want_bits[split] = (_entropy_by_bincount(ctx * pg.SPLIT + sym, 9)
                                - _entropy_by_bincount(ctx, 3))  # fmt: skip
        assert np.array_equal(pg.refinement_bits(n[k - 1], n[k]), want_bits)


def test_the_counting_kernels_refuse_what_does_not_nest() -> None:
    parent = np.array([[0, 1, 2]])
    with pytest.raises(ValueError, match="do not nest"):
        pg.refinement_bits(parent, np.array([[0, 5, 6]]))
    with pytest.raises(ValueError, match="outside"):
        pg.base_bits(np.array([[200, 0]]))
