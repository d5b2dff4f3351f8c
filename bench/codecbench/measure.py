"""The codec measurements: real containers and kernels, timed, and every row's quality.

Quality is :mod:`kvcdn.quality` against the exact KV on the continuation;
speeds are fp16-equivalent MB/s, the best of ``repeat`` runs after a warm-up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import estimates
from .log import log, warn

if TYPE_CHECKING:
    import torch

CONTINUATION_TOKENS = 257
FIXED_ROWS = ("fp16", "int8")


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The shortest of ``repeat`` (at least one) timed calls of ``fn``."""
    best = math.inf
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def probe_threads(threads: int) -> tuple[int, bool]:
    """(torch threads for model work, busy): do ``threads`` threads beat one right now?

    Where another process keeps a core busy, torch threads that meet at every
    parallel region wait for a descheduled peer, and ``threads`` threads run many
    times slower than one (measured here: a quality measurement took 17.5 s on
    2 threads against 2.9 s on 1). The model's work then runs on one thread;
    its results depend on the thread count only through float rounding. ``busy`` flags the speed
    figures taken meanwhile as not representative of the machine.
    """
    import torch

    if threads <= 1:
        return 1, False
    x = torch.ones(1 << 18)

    def run(n: int) -> float:
        torch.set_num_threads(n)
        x.mul_(1.0)
        return best_seconds(lambda: [x.mul_(1.0) for _ in range(20)], 2)

    try:
        t_n, t_1 = run(threads), run(1)
    finally:
        torch.set_num_threads(threads)
    # A busy CPU shows as n threads tens of times slower than one; allow for noise.
    return (1 if t_n >= t_1 else threads), t_n > 2 * t_1


class model_threads:  # noqa: N801 - used like a function
    """Use ``threads`` torch threads inside the block, then the previous count again."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.previous = 0

    def __enter__(self) -> None:
        import torch

        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.previous)


class Bench:
    """What every row needs: the model and profile, the chunking, and the CPU's state."""

    def __init__(self, model: Any, profile: Any, chunk: int, repeat: int) -> None:
        import torch

        self.model = model
        self.profile = profile
        self.chunk = chunk
        self.repeat = repeat
        self.threads = torch.get_num_threads()  # for the codec timings
        self.busy = False  # another process used the CPU since the last reset
        self.thread_counts: set[int] = set()  # torch threads the model ran with
        self.mean = torch.from_numpy(profile.mean)[:, :, :, None, :]
        self.sd_cal: np.ndarray | None = None

    def probe(self) -> int:
        """Torch threads for the next piece of model work (:func:`probe_threads`)."""
        n, busy = probe_threads(self.threads)
        self.busy |= busy
        self.thread_counts.add(n)
        return n

    def quality(self, sample: Any, kv: torch.Tensor) -> dict[str, float]:
        """:func:`kvcdn.quality.measure` of ``kv`` as the context's cache."""
        from kvcdn.quality import measure

        with model_threads(self.probe()):
            return measure(self.model, sample, kv)

    def real(self, level: Any, sample: Any) -> tuple[dict[str, Any], torch.Tensor]:
        """A level's row from real containers, one per chunk; and the decoded KV."""
        import torch

        from kvcdn.codec import decode_chunk, encode_chunk

        kv = sample.kv
        T = kv.shape[3]
        spans = [(a, min(a + self.chunk, T)) for a in range(0, T, self.chunk)]
        chunks = [kv[:, :, :, a:b].contiguous() for a, b in spans]
        profile = self.profile

        def encode_all() -> list[bytes]:
            return [
                encode_chunk(level, c, "0" * 64, profile=profile, start=a)
                for c, (a, _) in zip(chunks, spans, strict=True)
            ]

        datas = encode_all()  # warm-up (and the objects)
        enc_s = best_seconds(encode_all, self.repeat)
        out = torch.empty(kv.shape, dtype=torch.float32)

        def decode_all() -> None:
            for data, (a, b) in zip(datas, spans, strict=True):
                decode_chunk(data, profile=profile, out=out[:, :, :, a:b])

        decode_all()  # warm-up
        dec_s = best_seconds(decode_all, self.repeat)
        n_bytes = sum(len(d) for d in datas)
        fp16_bytes = kv.numel() * 2
        row = {
            "bits_per_element": 8 * n_bytes / kv.numel(),
            "bytes": n_bytes,
            **self.quality(sample, out),
            "encode_mb_s": fp16_bytes / enc_s / 1e6,
            "decode_mb_s": fp16_bytes / dec_s / 1e6,
            "estimate": False,
        }
        return row, out

    def kernel_decode(self, level: str, kv: torch.Tensor, chunked: torch.Tensor) -> dict[str, Any]:
        """The numba rANS kernel alone, on the whole document as one stream set."""
        from kvcdn.kernels import rans_numba

        p = self.profile
        s = p.sinks
        L, two, H, T, D = kv.shape
        G = L * two * H
        idx = p.quantise(level, kv.numpy()[:, :, :, s:])
        tid, scale, offset = p.dequant(level)
        states, words, word_start = rans_numba.encode(idx, tid, p.freqs)
        lut = p.decode_tables()
        out = np.empty((G, T - s, D), dtype=np.float32)

        def run() -> None:
            rans_numba.decode(words, word_start, states, lut, tid, scale, offset, out)

        run()  # warm-up
        secs = best_seconds(run, self.repeat)
        same = bool(np.array_equal(out.reshape(L, two, H, T - s, D), chunked[:, :, :, s:].numpy()))
        if not same:
            warn(f"{level}: whole-document kernel decode differs from the chunked decode")
        return {
            "decode_kernel_mb_s": out.size * 2 / secs / 1e6,
            "kernel_matches_chunked": same,
        }


def measure_document(bench: Bench, sample: Any, ladder: list[str]) -> dict[str, dict[str, Any]]:
    """Every row for one document, in table order: ladder, fixed levels, baselines, ablations."""
    from kvcdn.codec import FIXED_LEVELS, ladder_level

    profile = bench.profile
    rows: dict[str, dict[str, Any]] = {}
    stage = time.perf_counter()

    def done(what: str) -> None:
        nonlocal stage
        log(f"  {what}: {time.perf_counter() - stage:.1f} s")
        stage = time.perf_counter()

    for lname in ladder:
        rows[lname], out = bench.real(ladder_level(lname, profile), sample)
        rows[lname].update(bench.kernel_decode(lname, sample.kv, out))
        done(lname)
    for fname in FIXED_ROWS:
        rows[fname], _ = bench.real(FIXED_LEVELS[fname], sample)
        done(fname)
    with model_threads(bench.probe()):  # not timed: as the model
        rows.update(estimates.baselines(bench, sample))
        done("baselines")
        if "default" in profile.levels:
            rows.update(estimates.ablations(bench, sample, "default"))
            done("ablations")
    return rows


def calibration_sd(model: Any, profile: Any) -> np.ndarray | None:
    """Per-stream sd of the calibration texts' KV (what ``calibrate`` measured), or None."""
    import torch

    from kvcdn.calibrate import bundled_texts

    texts = bundled_texts()
    names = profile.calibration.get("texts")
    if names and sorted(names) != sorted(texts):
        warn(f"the profile was calibrated on {names}, not the bundled texts: no no-fisher row")
        return None
    ctx_max = int(profile.calibration.get("context_tokens", 2048))
    bodies = []
    for text in texts.values():
        ids = model.document_ids(text)
        ctx = min(ctx_max, len(ids) - CONTINUATION_TOKENS)
        bodies.append(model.prefill(ids[:ctx]).float().cpu()[:, :, :, profile.sinks :])
    body = torch.cat(bodies, dim=3)
    mean_err = float((body.mean(dim=3) - torch.from_numpy(profile.mean)).abs().max())
    if mean_err > 1e-2:
        warn(f"calibration KV does not reproduce the profile's means (max error {mean_err:.3g})")
    return body.std(dim=3, unbiased=False).numpy()
