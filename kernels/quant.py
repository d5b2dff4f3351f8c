"""Per-channel symmetric 8-bit quantisation of KV tensors.

A "channel" is one (layer, K/V, head, head-dim element) across a chunk's
tokens: KV outliers live in fixed channels, so a scale per channel keeps them
from flattening every other value (the observation CacheGen and KIVI build on).
"""

from __future__ import annotations

import torch


def quantize_int8_per_channel(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv [L, 2, H, T, D]`` -> (int8 values of that shape, fp32 scales ``[L, 2, H, D]``)."""
    x = kv.float()
    scales = x.abs().amax(dim=3) / 127.0  # [L, 2, H, D]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(x / scales.unsqueeze(3)).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8_per_channel(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """Inverse of :func:`quantize_int8_per_channel`, on whatever device ``q`` is on."""
    return (q.to(torch.float32) * scales.to(q.device).unsqueeze(3)).to(dtype)
