"""Nested quantisation: the ladder as one base and refinements that only add bytes.

The design the progressive ladder (one object per chunk, every level a prefix of
its sections) is built on; ``bench/progressive.py`` measures it against today's
independently coded levels, and ``docs/levels.md`` gives the figures.

* **Base.** Each stream (layer, K/V, head, channel) is quantised as the ladder codec
  does: a midtread uniform quantiser around the calibrated mean, step ``s0``.
* **Refinements split cells in three.** A midtread quantiser of step ``s / 3``
  nests exactly in one of step ``s``: each coarse cell is three fine ones, the
  middle one centred where the coarse cell was. So level ``k`` of a stream is
  simply the midtread quantiser of step ``s0 / 3**j``, where ``j`` is how many
  refinements up to ``k`` split that stream, and its index ``n`` follows from the
  level below's ``p`` and a ternary symbol ``c``: ``n = 3 p + c - 1``. Splitting in
  two would nest too, but turns the quantiser midrise (no cell centred on the
  mean): on SmolLM2-135M that costs several times the KL at the same step, because
  the many channels whose values sit near their mean are then all moved by a
  quarter step, the same way on every token.
* **Which streams a refinement splits.** A split in three costs a stream about
  ``log2 3`` bits per element at high resolution and much less where most values
  fall in the middle cell; its benefit in the model's output is taken as
  ``fisher * step**2 * (1 - 1/9) / 12`` (the calibration's sensitivity times the
  step's uniform-noise distortion; a *measured* distortion undervalues channels
  whose document mean moves away from the calibrated one, which an unsplit coarse
  step then misses on every token). Streams are split in order of benefit per
  bit, and each level splits the fraction whose measured KL on the calibration
  texts meets the level's target. A transform's coefficients (the KLT of
  ``kvcdn.kernels.transform``) are ordered by the error a split removes on the
  calibration data instead: many of them lie far inside the step, where the
  uniform-noise benefit is a promise a split does not keep.
* **Coding a refinement symbol.** ``c`` is turned to count from the side nearest
  the mean (``s = c`` above it, ``2 - c`` below), and coded with a table chosen by
  ``min(|p|, 2)``: the middle cell's children are symmetric, its neighbours' lean
  towards the mean, the tails' are near uniform.
* **The previous token as context.** Adjacent tokens are correlated in many streams,
  so a symbol's table also depends on the same stream's symbol at the previous token
  (a base index by its sign, a refinement symbol as it is): the coder's tables, in
  ``kvcdn.calibrate`` and ``kvcdn.kernels.nested``; this module's size estimates
  (:func:`level_bits`) count each stream's symbols without it.

Everything here is the numpy reference; kernels and the container follow it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvcdn.kernels import nested_stats

SPLIT = 3
#: Base indices are clipped to this magnitude (8-bit symbols, as the ladder codec's).
BASE_LIMIT = 127
#: Contexts of a refinement symbol: the parent index is 0, +-1, or further out.
CONTEXTS = 3


@dataclass(frozen=True)
class NestedPlan:
    """Per stream: the base step, and how many splits each level has made.

    Streams are flattened to ``N`` (layer, K/V, head, channel order); ``depth[k]`` is
    ``j`` at level ``k`` (``depth[0]`` is all zeros: the base), non-decreasing in ``k``
    by at most one a level.
    """

    base_step: np.ndarray  # float64 [N]
    depth: np.ndarray  # int64 [levels, N]

    def __post_init__(self) -> None:
        if self.depth.ndim != 2 or self.depth.shape[1] != self.base_step.shape[0]:
            raise ValueError("depth must be [levels, streams]")
        steps = np.diff(self.depth, axis=0)
        if np.any(self.depth[0] != 0) or np.any((steps != 0) & (steps != 1)):
            raise ValueError("each level splits a stream at most once, from a base of none")

    @property
    def levels(self) -> int:
        return self.depth.shape[0]

    def step(self, level: int) -> np.ndarray:
        """Each stream's quantiser step at ``level``."""
        return self.base_step / float(SPLIT) ** self.depth[level]

    def with_level(self, splits: np.ndarray) -> NestedPlan:
        """This plan with one more level, splitting the streams where ``splits``."""
        row = self.depth[-1] + splits.astype(np.int64)
        return NestedPlan(self.base_step, np.vstack([self.depth, row[None]]))


def base_plan(base_step: np.ndarray) -> NestedPlan:
    return NestedPlan(np.asarray(base_step, dtype=np.float64),
                      np.zeros((1, len(base_step)), dtype=np.int64))  # fmt: skip


def indices(x: np.ndarray, plan: NestedPlan) -> list[np.ndarray]:
    """The quantiser index of every value of ``x`` (``[N, T]``, mean removed) at every
    level of ``plan``, base first. The finest level is quantised; each coarser one is
    its parent cell, found by integer division, so levels nest exactly whatever the
    rounding of a value on a cell boundary."""
    finest = _finest(x, plan)
    return [_coarsen(finest, plan, k) for k in range(plan.levels)]


def level_indices(x: np.ndarray, plan: NestedPlan, level: int) -> np.ndarray:
    """``indices(x, plan)[level]``, without the other levels."""
    return _coarsen(_finest(x, plan), plan, level)


def _finest(x: np.ndarray, plan: NestedPlan) -> np.ndarray:
    """The finest level's indices, as whole float64 values (NaN read as 0)."""
    scale = float(SPLIT) ** plan.depth[-1][:, None]
    limit = BASE_LIMIT * scale + (scale - 1) // 2  # a base cell's reach at the finest step
    finest = np.rint(x / (plan.base_step[:, None] / scale))
    np.clip(finest, -limit, limit, out=finest)
    nan = np.isnan(finest)
    if nan.any():
        finest[nan] = 0.0
    return finest


def _coarsen(finest: np.ndarray, plan: NestedPlan, level: int) -> np.ndarray:
    """Level ``level``'s int64 indices from the finest: ``floor((n + (up - 1) / 2) /
    up)`` for ``up = 3**(top - depth)``, in float64 (SIMD, where numpy's int64 division
    is not): exact, since every operand is a whole number below 2**53 and a quotient
    that is not whole is at least ``1/up`` from one."""
    up = float(SPLIT) ** (plan.depth[-1] - plan.depth[level])[:, None]
    if not np.any(up > 1):
        return finest.astype(np.int64)
    out = finest + (up - 1) / 2
    np.divide(out, up, out=out)
    np.floor(out, out=out)
    return out.astype(np.int64)


def reconstruct(n: np.ndarray, plan: NestedPlan, level: int) -> np.ndarray:
    """Values (mean removed) of the level-``level`` indices ``n``."""
    return n * plan.step(level)[:, None]


def level_values(kv: np.ndarray, mean: np.ndarray, plan: NestedPlan, level: int,
                 sinks: int) -> np.ndarray:  # fmt: skip
    """KV ``[L, 2, H, T, D]`` (float32) as level ``level`` of ``plan`` reconstructs it,
    its first ``sinks`` tokens kept as they are: ``values_of(reconstruct(n, plan,
    level), mean)`` for ``n = level_indices(streams_of(kv[:, :, :, sinks:], mean),
    plan, level)``, bit for bit, in one pass (:mod:`kvcdn.kernels.nested_stats`)."""
    scale = float(SPLIT) ** plan.depth[-1]  # as _finest and _coarsen compute them
    limit = BASE_LIMIT * scale + (scale - 1) // 2
    up = float(SPLIT) ** (plan.depth[-1] - plan.depth[level])
    return nested_stats.level_values(kv, mean, sinks, plan.base_step / scale, limit, up,
                                     plan.step(level))  # fmt: skip


def refinement_symbols(parent: np.ndarray, child: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The coded symbol (0 = the child nearest the mean) and its context of each split
    cell: ``child`` indices at the finer level, ``parent`` at the one below."""
    c = child - SPLIT * parent + 1
    if np.any((c < 0) | (c >= SPLIT)):
        raise ValueError("child indices do not nest in their parents")
    sym = np.where(parent < 0, SPLIT - 1 - c, c)
    ctx = np.minimum(np.abs(parent), CONTEXTS - 1)
    return sym, ctx


# ---- sizes (entropy estimates) -------------------------------------------------------


def _row_entropy(sym: np.ndarray, bins: int) -> np.ndarray:
    """Per row of ``sym`` (``[N, T]``, values in ``[0, bins)``): bits per element of an
    ideal coder with the row's own frequencies."""
    return _entropy(nested_stats.row_counts(sym, bins), sym.shape[1])


def _entropy(counts: np.ndarray, count: int) -> np.ndarray:
    """Bits per element of each row of ``counts [N, bins]``, out of ``count`` elements."""
    c = counts.astype(np.float64)
    p = c / max(count, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(c > 0, p * np.log2(p), 0.0).sum(axis=1)


def base_bits(n: np.ndarray) -> np.ndarray:
    """Bits per element of each stream's base indices."""
    return _row_entropy(n + BASE_LIMIT, 2 * BASE_LIMIT + 1)


def refinement_bits(parent: np.ndarray, child: np.ndarray) -> np.ndarray:
    """Bits per element of each stream's refinement symbols given their contexts
    (``H(symbol | context)``, counted as :func:`refinement_symbols` codes them); a
    stream the refinement does not split (``child == parent`` everywhere) costs
    nothing."""
    split, counts = nested_stats.refinement_counts(parent, child)
    out = np.zeros(parent.shape[0])
    if split.any():
        joint = counts[split]
        contexts = joint.reshape(-1, CONTEXTS, SPLIT).sum(axis=2)
        tokens = parent.shape[1]
        out[split] = _entropy(joint, tokens) - _entropy(contexts, tokens)
    return out


def base_level_bits(x: np.ndarray, base_step: np.ndarray) -> float:
    """``level_bits(x, base_plan(base_step))[0]``, counted in one pass over ``x``: what a
    search for the base's step asks at every step."""
    # a base-only plan's finest step is its base step (``_finest`` divides by 3**0)
    counts = nested_stats.base_counts(x, np.asarray(base_step, dtype=np.float64), BASE_LIMIT)
    return float(_entropy(counts, x.shape[1]).mean())


def level_bits(x: np.ndarray, plan: NestedPlan) -> list[float]:
    """Mean bits per element of ``x`` at every level: the base plus refinements up to it."""
    n = indices(x, plan)
    total = base_bits(n[0])
    out = [float(total.mean())]
    for k in range(1, plan.levels):
        total = total + refinement_bits(n[k - 1], n[k])
        out.append(float(total.mean()))
    return out


# ---- planning ------------------------------------------------------------------------

#: KL of the model on reconstructions at a plan's last level (the caller's measure).
KlOfPlan = Callable[[NestedPlan], float]


def split_order(x: np.ndarray, plan: NestedPlan, fisher: np.ndarray, *,
                measured: bool = False) -> np.ndarray:  # fmt: skip
    """The streams in the order a refinement on ``plan`` splits them: best benefit per
    bit first. ``x`` is the calibration data ``[N, T]`` (mean removed), ``fisher``
    each stream's sensitivity. The benefit is the step's uniform-noise distortion
    (module doc), or with ``measured`` the squared error the split removes on ``x``:
    a transform's coefficients (``kvcdn.kernels.transform``) include many whose
    values are far inside the step, where the uniform-noise model promises a gain a
    split does not give, at a low price in bits, so they would be split first."""
    top = plan.levels - 1
    n = level_indices(x, plan, top)
    trial = plan.with_level(np.ones(len(fisher), dtype=bool))
    finer = level_indices(x, trial, top + 1)
    cost = refinement_bits(n, finer)
    step = plan.step(top)
    if measured:
        now = ((x - n * step[:, None]) ** 2).mean(axis=1)
        split = ((x - finer * trial.step(top + 1)[:, None]) ** 2).mean(axis=1)
        benefit = fisher * np.maximum(now - split, 0.0)
    else:
        benefit = fisher * step**2 * (1 - 1 / SPLIT**2) / 12
    return np.argsort(-benefit / np.maximum(cost, 1e-3), kind="stable")


def plan_refinement(
    x: np.ndarray, plan: NestedPlan, fisher: np.ndarray, kl_of: KlOfPlan, target: float,
    *, steps: int = 7, order: np.ndarray | None = None,
) -> NestedPlan:  # fmt: skip
    """``plan`` with one more level: the streams of best benefit per bit split, as few
    as meet ``target`` (the KL ``kl_of`` measures), found by bisection on the fraction.
    ``x`` is the calibration data ``[N, T]`` (mean removed), ``fisher`` each stream's
    sensitivity; ``order`` what :func:`split_order` gives for them, where the caller
    plans on the same level more than once."""
    if order is None:
        order = split_order(x, plan, fisher)

    def split(fraction: float) -> NestedPlan:
        chosen = np.zeros(len(fisher), dtype=bool)
        chosen[order[: int(round(fraction * len(order)))]] = True
        return plan.with_level(chosen)

    lo, hi = 0.0, 1.0
    if kl_of(split(hi)) > target:
        return split(hi)  # every stream split and still above: the finest one step allows
    for _ in range(steps):
        mid = (lo + hi) / 2
        if kl_of(split(mid)) > target:
            lo = mid
        else:
            hi = mid
    return split(hi)


def plan_levels(
    x: np.ndarray, base_step: np.ndarray, fisher: np.ndarray, kl_of: KlOfPlan,
    targets: Sequence[float],
) -> NestedPlan:  # fmt: skip
    """A base at ``base_step`` and one refinement per KL target (coarsest first)."""
    plan = base_plan(base_step)
    for target in targets:
        plan = plan_refinement(x, plan, fisher, kl_of, target)
    return plan


# ---- between KV tensors and streams ----------------------------------------------------


def streams_of(body: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """KV ``[L, 2, H, T, D]`` less its calibrated ``mean`` ``[L, 2, H, D]`` as streams
    ``[N, T]`` (float64), in (layer, K/V, head, channel) order."""
    x = np.asarray(body, dtype=np.float64) - np.asarray(mean, dtype=np.float64)[:, :, :, None]
    return np.ascontiguousarray(np.moveaxis(x, 3, -1).reshape(-1, x.shape[3]))


def values_of(streams: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """The inverse of :func:`streams_of`: float32 ``[L, 2, H, T, D]``."""
    layers, two, heads, dim = mean.shape
    x = streams.reshape(layers, two, heads, dim, -1)
    return (np.moveaxis(x, -1, 3) + mean[:, :, :, None]).astype(np.float32)
