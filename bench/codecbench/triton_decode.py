"""The Triton GPU decoder's throughput, where a CUDA device is present."""

from __future__ import annotations

from typing import Any


def triton_result() -> dict[str, Any] | str:
    """:func:`kvcdn.kernels.rans_triton.bench` where the GPU path can run, else why not."""
    try:
        from kvcdn.kernels import rans_triton
    except Exception as exc:  # any import failure means the GPU path is not here
        return f"unavailable: {exc}"
    if not rans_triton.available():
        return "no CUDA device"
    return rans_triton.bench()
