"""The planner's downgrade search as first written, one (chunk, option) pair at a time:
the oracle :func:`kvcdn.sdk.planner._downgrade` (which weighs every pair at once, as
arrays) is tested against, and the baseline ``bench/planner.py`` times it against."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvcdn.sdk.planner import TEXT, ChunkChoice, Option, _Estimate


def downgrade_pairwise(
    chunks: Sequence[ChunkChoice],
    chosen: dict[int, Option],
    est: _Estimate,
    deadline_s: float,
) -> dict[int, Option]:
    by_index = {c.index: c for c in chunks}
    decode_of = {i: (0.0 if o.level == TEXT else o.device_s) for i, o in chosen.items()}
    finish = est.finish(max(decode_of.values(), default=0.0))
    while finish > deadline_s:
        best_swap: tuple[float, int, Option] | None = None
        # the largest decode time without chunk i, in O(1): keep the top two
        top = sorted(decode_of.items(), key=lambda kv: kv[1], reverse=True)[:2] + [(-1, 0.0)]
        for index, option in chosen.items():
            others = top[1][1] if top[0][0] == index else top[0][1]
            for alt in by_index[index].options:
                if alt is option or (alt.level != TEXT and alt.quality > option.quality):
                    continue  # a better level never saves time; text (exact) may
                after = est.finish_with(
                    est.bytes - option.bytes + alt.bytes,
                    est.device_s - option.device_s + alt.device_s,
                    est.text_s
                    - (option.device_s if option.level == TEXT else 0.0)
                    + (alt.device_s if alt.level == TEXT else 0.0),
                    max(others, 0.0 if alt.level == TEXT else alt.device_s),
                )
                saved = finish - after
                if saved <= 1e-12:
                    continue
                loss = option.quality - alt.quality
                score = math.inf if loss <= 0 else saved / loss
                if best_swap is None or score > best_swap[0]:
                    best_swap = (score, index, alt)
        if best_swap is None:
            break  # nothing saves time: the best effort
        _, index, alt = best_swap
        est.add(chosen[index], -1)
        est.add(alt)
        decode_of[index] = 0.0 if alt.level == TEXT else alt.device_s
        chosen[index] = alt
        finish = est.finish(max(decode_of.values(), default=0.0))
    return chosen
