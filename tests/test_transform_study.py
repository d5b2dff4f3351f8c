"""The transforms study (bench/codecbench/transforms.py) measures what it says: its RoPE
is the model's own, its transforms invert exactly, and a KLT decorrelates a head."""

from __future__ import annotations

import numpy as np
import torch

from bench.codecbench.transforms import Scheme, _rotate_keys, at_kl, rope_tables


def test_keys_rotate_as_the_models_rope_and_back(model) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = rope_tables(model, 300)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 2, 3, 300, cos.shape[1]))
    ours = _rotate_keys(kv, cos, sin, 1.0)
    keys = torch.from_numpy(kv[:, 0])  # [L, H, T, D] as [batch, heads, T, D]
    c, s = torch.from_numpy(cos)[None], torch.from_numpy(sin)[None]
    _, theirs = apply_rotary_pos_emb(keys, keys, c, s)
    # the model's float32 tables, against the study's float64 angles
    np.testing.assert_allclose(ours[:, 0], theirs.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ours[:, 1], kv[:, 1])  # values are not rotated
    np.testing.assert_allclose(_rotate_keys(ours, cos, sin, -1.0), kv, rtol=0, atol=1e-12)


def test_a_head_klt_inverts_and_decorrelates(model) -> None:
    rope = rope_tables(model, 200)
    dim = rope[0].shape[1]
    rng = np.random.default_rng(1)
    mix = rng.standard_normal((dim, dim))  # correlated channels

    def kv() -> np.ndarray:
        return rng.standard_normal((1, 2, 2, 200, dim)) @ mix

    calibration = [kv(), kv()]
    fisher = rng.uniform(0.5, 2.0, (1, 2, 2, dim))
    scheme = Scheme(True, "head", calibration, fisher, 4, rope)
    x = kv()
    np.testing.assert_allclose(scheme.values(scheme.coefficients(x)), x, rtol=0, atol=1e-9)
    c = np.concatenate([scheme.coefficients(k)[:, :, :, 4:] for k in calibration], axis=3)
    cov = np.cov(c[0, 1, 0], rowvar=False)
    off = cov - np.diag(np.diag(cov))
    assert np.abs(off).max() < 1e-9 * np.abs(np.diag(cov)).max()
    assert np.abs(np.cov(x[0, 1, 0], rowvar=False) - np.diag(np.diag(np.cov(
        x[0, 1, 0], rowvar=False)))).max() > 0.1  # the values were correlated  # fmt: skip
    shared = Scheme(True, "layer", calibration, fisher, 4, rope)
    np.testing.assert_array_equal(shared.basis[0, 1, 0], shared.basis[0, 1, 1])
    np.testing.assert_allclose(shared.values(shared.coefficients(x)), x, rtol=0, atol=1e-9)


def test_bits_are_compared_at_the_same_kl() -> None:
    points = [{"kl": 0.001, "bits": 3.0}, {"kl": 0.004, "bits": 2.0}, {"kl": 0.016, "bits": 1.0}]
    assert at_kl(points, 0.002, "bits") == 2.5  # halfway in log KL
    assert at_kl(points, 0.016, "bits") == 1.0
    assert at_kl(points, 0.05, "bits") is None  # outside the sweep: not extrapolated
