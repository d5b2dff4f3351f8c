"""The adaptive planner's downgrade search (:func:`kvcdn.sdk.planner.plan`) as a numba
kernel, for links predicted as ``latency + bytes / throughput``.

A plan that misses its deadline takes one downgrade at a time, each weighing every
(chunk, option) pair, and a load plans again after each chunk: for a 32K-token
document (128 chunks) the numpy search spends 3-23 ms a plan in numpy's per-call
overhead on arrays of a few hundred values. This kernel does the same arithmetic, a
pair at a time, in the same order of operations (so the same floats), and breaks
ties as numpy's ``argmax`` does (the first pair in chunk and option order): the plan
is the same, which ``tests/test_planner.py`` checks against the pair-by-pair search
the planner was first written as.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _finish(busy_device, busy_link, busy_text_ready, est_bytes, est_device, est_text,
            decode_max, latency, bps):  # pragma: no cover - jitted  # fmt: skip
    """The planner's ``_Estimate.finish_with``."""
    finish = busy_device + est_device
    link = busy_link + est_bytes
    if link != 0:
        seconds = 0.0 if link <= 0 else latency + link / bps
        finish = max(finish, seconds + decode_max)
    if est_text != 0.0:
        finish = max(finish, busy_text_ready + est_text)
    return finish


@njit(cache=True, nogil=True)
def downgrade(valid, nbytes, device, quality, text, at, busy_device, busy_link,
              busy_text_ready, est_bytes, est_device, est_text, latency, bps,
              deadline):  # pragma: no cover - jitted  # fmt: skip
    """Swap options in ``at`` (each chunk's option, changed in place) while the estimate
    misses ``deadline``; ``[chunks, options]`` arrays describe the options (``valid``
    where a chunk has that many). Every swap makes the estimate smaller, so it ends."""
    n, width = valid.shape
    decode_now = np.empty(n)
    for i in range(n):
        decode_now[i] = 0.0 if text[i, at[i]] else device[i, at[i]]
    finish = _finish(busy_device, busy_link, busy_text_ready, est_bytes, est_device, est_text,
                     decode_now.max(), latency, bps)  # fmt: skip
    while finish > deadline:
        # the largest decode of the other chunks: the second largest for the first
        # chunk holding the largest, the largest for every other
        first = np.argmax(decode_now)
        second = 0.0
        if n > 1:
            second = -np.inf
            for i in range(n):
                if i != first and decode_now[i] > second:
                    second = decode_now[i]
        best_i, best_k, best = -1, -1, -np.inf
        for i in range(n):
            h = at[i]
            held_bytes, held_device, held_quality = nbytes[i, h], device[i, h], quality[i, h]
            held_text = device[i, h] if text[i, h] else 0.0
            others = second if i == first else decode_now[first]
            for k in range(width):
                if not valid[i, k] or k == h:
                    continue
                if not text[i, k] and quality[i, k] > held_quality:
                    continue  # a better level never saves time
                after = busy_device + ((est_device - held_device) + device[i, k])
                link = busy_link + ((est_bytes - held_bytes) + nbytes[i, k])
                decode = 0.0 if text[i, k] else device[i, k]
                if link != 0:
                    seconds = 0.0 if link <= 0 else latency + link / bps
                    after = max(after, seconds + max(others, decode))
                text_s = (est_text - held_text) + (device[i, k] if text[i, k] else 0.0)
                if text_s != 0.0:
                    after = max(after, busy_text_ready + text_s)
                saved = finish - after
                if not saved > 1e-12:
                    continue
                loss = held_quality - quality[i, k]
                score = np.inf if loss <= 0 else saved / loss
                if score > best:
                    best_i, best_k, best = i, k, score
        if best_i < 0:
            break  # nothing saves time: the best effort
        i, k, h = best_i, best_k, at[best_i]
        est_bytes = est_bytes + -1 * nbytes[i, h]  # as _Estimate.add(held, -1)
        est_device = est_device + -1 * device[i, h]
        if text[i, h]:
            est_text = est_text + -1 * device[i, h]
        est_bytes = est_bytes + nbytes[i, k]
        est_device = est_device + device[i, k]
        if text[i, k]:
            est_text = est_text + device[i, k]
        at[i] = k
        decode_now[i] = 0.0 if text[i, k] else device[i, k]
        finish = _finish(busy_device, busy_link, busy_text_ready, est_bytes, est_device,
                         est_text, decode_now.max(), latency, bps)  # fmt: skip


def warm_up() -> None:
    """Load the compiled search (a few ms from numba's cache, once numba is in the
    process), so that a load's first plan does not pay for it."""
    one = np.ones((1, 1), dtype=bool)
    zeros = np.zeros((1, 1))
    downgrade(one, np.zeros((1, 1), dtype=np.int64), zeros, zeros, ~one,
              np.zeros(1, dtype=np.int64), 0.0, 0, 0.0, 0, 0.0, 0.0, 0.0, 1.0, 1.0)  # fmt: skip
