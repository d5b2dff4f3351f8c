"""The Triton GPU decoder's throughput on synthetic streams shaped like a KV quantiser's.

Kept out of :mod:`kvcdn.kernels.rans_triton`, which holds the kernel only;
``tests/test_rans_triton.py`` uses :func:`synthetic` and
:func:`decode_throughput` on a GPU too.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def synthetic(
    G: int, T: int, D: int, n_tables: int = 16, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Realistic random symbols: ``(sym [G, T, D], table_id [G, D], freqs [n_tables, 12])``.

    Twelve-symbol tables with Laplacian-shaped counts (about 2 to 3 bits a
    symbol), as a KV quantiser's per-channel histograms look.
    """
    from kvcdn.kernels.rans import PROB_SCALE, normalize_freqs

    rng = np.random.default_rng(seed)
    n = 12
    k = np.arange(n)
    freqs = np.stack(
        [
            normalize_freqs(np.exp(-np.abs(k - rng.uniform(4, 7)) / rng.uniform(0.8, 1.6)))
            for _ in range(n_tables)
        ]
    )
    table_id = rng.integers(0, n_tables, size=(G, D)).astype(np.int32)
    cdf = np.cumsum(freqs, axis=1)  # [n_tables, n], ends at 4096
    u = rng.integers(0, PROB_SCALE, size=(G, T, D))
    sym = np.empty((G, T, D), dtype=np.uint8)
    lanes = np.broadcast_to(table_id[:, None, :], sym.shape)
    for tab in range(n_tables):
        sel = lanes == tab
        sym[sel] = np.searchsorted(cdf[tab], u[sel], side="right")
    return sym, table_id, freqs


def decode_throughput(
    G: int = 180 * 8, T: int = 256, D: int = 64, device: str = "cuda", iters: int = 20
) -> dict[str, Any]:
    """Decode throughput on realistic data (fp16 output), in fp16-equivalent GB/s.

    ``gbps`` is ``G * T * D * 2`` bytes over the mean time of one decode,
    timed with CUDA events after warm-up.
    """
    import torch

    from kvcdn.kernels.rans import build_decode_table
    from kvcdn.kernels.rans_numba import encode
    from kvcdn.kernels.rans_triton import decode, to_device

    sym, table_id, freqs = synthetic(G, T, D)
    states, words, word_start = encode(sym, table_id, freqs)
    rng = np.random.default_rng(1)
    scale = (rng.integers(8, 16, size=(G, D)) / 64.0).astype(np.float32)  # 4 significant bits
    offset = rng.standard_normal((G, D)).astype(np.float32)
    args = to_device(
        words, word_start, states, build_decode_table(freqs), table_id, scale, offset, device
    )
    out = torch.empty((G, T, D), dtype=torch.float16, device=device)
    for _ in range(3):
        decode(*args, out)
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        decode(*args, out)
    stop.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(stop) / 1000.0 / iters
    elements = G * T * D
    return {
        "gbps": elements * 2 / seconds / 1e9,
        "seconds": seconds,
        "elements": elements,
        "bits_per_symbol": words.size * 16 / elements,
        "G": G,
        "T": T,
        "D": D,
        "device": torch.cuda.get_device_name(device),
    }


def triton_result() -> dict[str, Any] | str:
    """:func:`decode_throughput` where the GPU path can run, else why not."""
    try:
        from kvcdn.kernels import rans_triton
    except Exception as exc:  # any import failure means the GPU path is not here
        return f"unavailable: {exc}"
    if not rans_triton.available():
        return "no CUDA device"
    return decode_throughput()
