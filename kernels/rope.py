"""Moving rotary-embedded keys to other positions.

Rotary position embeddings (RoPE) rotate each pair of a key's channels by
``position * inv_freq[i]``. A rotation by ``a`` followed by one by ``b`` is a
rotation by ``a + b``, so a key computed at position ``p`` moves to ``p + delta``
by one more rotation by ``delta``, whatever the scaling that produced
``inv_freq`` (linear, NTK, Llama 3, YaRN: they all change the frequencies, not
the fact that it is a rotation). A magnitude factor some schemes put on the
rotation (YaRN's ``attention_scaling``) is already in the key and must not be
applied twice, so the rotation here is a pure one.

The channel pairing is the "rotate half" convention of Hugging Face models:
channel ``i`` pairs with ``i + head_dim / 2``.
"""

from __future__ import annotations

import torch


def rotate_keys(
    keys: torch.Tensor, delta: torch.Tensor | int, inv_freq: torch.Tensor
) -> torch.Tensor:
    """``keys [..., T, D]`` rotated by ``delta`` positions (an int, or ``[T]`` per token).

    Computed in float32 (positions times frequencies lose precision in half
    floats) and returned in the keys' dtype.
    """
    head_dim = keys.shape[-1]
    if head_dim % 2 or inv_freq.numel() != head_dim // 2:
        raise ValueError(
            f"keys of head_dim {head_dim} do not match {inv_freq.numel()} rotary frequencies"
        )
    tokens = keys.shape[-2]
    if isinstance(delta, int):
        delta = torch.full((tokens,), delta, dtype=torch.float32, device=keys.device)
    angles = delta.to(device=keys.device, dtype=torch.float64)[:, None] * inv_freq.to(
        device=keys.device, dtype=torch.float64
    )
    angles = torch.cat((angles, angles), dim=-1)  # [T, D]
    cos, sin = angles.cos().float(), angles.sin().float()
    k = keys.float()
    half = head_dim // 2
    rotated_half = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return (k * cos + rotated_half * sin).to(keys.dtype)
