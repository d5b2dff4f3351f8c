"""GPU inverse of the nested codec's transform (Triton): :func:`kvcdn.kernels.transform.
synthesise`, bit for bit, on torch tensors on the device.

One program computes ``BLOCK_T`` tokens of one group: two ``[BLOCK_T, D/2]``
accumulators (the outputs ``d < D/2`` and ``d >= D/2``, which RoPE's pairs join) start
at zero and take ``fma(M[d, j], y[j], sum)`` for ``j = 0, 1, ...`` in order, each
rounded once, as docs/format.md specifies (``tl.fma``: the interpreter rounds it once
too); keys are then turned with the host's cosine and sine tables, no other multiply
and add fused. ``D`` must be a power of two (the head sizes of the
models kvcdn serves: 64, 128, 256); other sizes decode on the CPU.

Imports without Triton; ``TRITON_INTERPRET=1`` (set before Triton is first imported)
runs it on CPU tensors.
"""

from __future__ import annotations

import torch

try:  # the module must import where Triton is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

_BLOCK_T = 16


def supports(dim: int) -> bool:
    """Whether the kernel takes groups of ``dim`` channels."""
    return triton is not None and dim >= 4 and dim & (dim - 1) == 0


def synthesise(y: torch.Tensor, mt: torch.Tensor, rotate: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
    """Values ``out [G, T, D]`` (float32) of coefficients ``y [G, T, D]`` (float32, any
    strides), with ``mt [G, D, D]`` the synthesis matrices transposed, ``rotate [G]``
    (int32) the groups turned by ``cos``/``sin`` ``[T, D/2]``, every tensor float32 on
    one device. ``out`` must not overlap ``y``: a program's warps may still read a
    token's coefficients while another writes its values."""
    if triton is None:
        raise RuntimeError("kvcdn.kernels.transform_triton needs triton")
    G, T, D = y.shape
    if not supports(D) or out.shape != y.shape or mt.shape != (G, D, D):
        raise ValueError("the coefficients, matrices and output do not fit together")
    if rotate.shape != (G,) or cos.shape != (T, D // 2) or sin.shape != (T, D // 2):
        raise ValueError("the rotations do not fit the groups and tokens")
    if any(t.dtype != torch.float32 for t in (y, mt, cos, sin, out)):
        raise ValueError("the transform runs in float32")
    if G == 0 or T == 0:
        return
    if _overlap(y, out):
        raise ValueError("out must not overlap y")
    mt, cos, sin = mt.contiguous(), cos.contiguous(), sin.contiguous()
    rotate = rotate.to(torch.int32).contiguous()
    _synthesise_kernel[(G, triton.cdiv(T, _BLOCK_T))](
        y, mt, rotate, cos, sin, out, T,
        y.stride(0), y.stride(1), y.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=D, HALF=D // 2, BLOCK_T=_BLOCK_T,
        enable_fp_fusion=False,  # only the sums' FMAs fused, as specified
    )  # fmt: skip


def warm_up(device: str | torch.device, dim: int) -> None:
    """Compile (or load from Triton's cache) the kernel for groups of ``dim`` channels on
    ``device``, so that a process's first transformed chunk does not wait for it: for
    token counts that are a multiple of 16 and that are not, which Triton compiles
    apart (a chunk's count is either). Nothing where the kernel does not take ``dim``."""
    if not supports(dim):
        return
    for tokens in (16, 12):
        y = torch.zeros((1, tokens, dim), device=device)
        mt = torch.zeros((1, dim, dim), device=device)
        tables = torch.zeros((tokens, dim // 2), device=device)
        synthesise(y, mt, torch.ones(1, dtype=torch.int32, device=device), tables, tables,
                   torch.empty_like(y))  # fmt: skip


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` and ``b`` span (first to last element) intersect."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


if triton is not None:

    @triton.jit
    def _synthesise_kernel(y_ptr, mt_ptr, rot_ptr, cos_ptr, sin_ptr, out_ptr, T,
                           ys0, ys1, ys2, os0, os1, os2,
                           D: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_T: tl.constexpr):  # fmt: skip  # pragma: no cover - jitted
        g = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = t < T
        i = tl.arange(0, HALF)
        low = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
        high = tl.zeros((BLOCK_T, HALF), dtype=tl.float32)
        row = y_ptr + g.to(tl.int64) * ys0 + t.to(tl.int64) * ys1
        m = mt_ptr + g.to(tl.int64) * D * D
        for j in range(D):  # in order: the sum of each output is specified term by term
            v = tl.load(row + j * ys2, mask=inside, other=0.0)
            m_low = tl.load(m + j * D + i)
            m_high = tl.load(m + j * D + HALF + i)
            low = tl.fma(m_low[None, :], v[:, None], low)
            high = tl.fma(m_high[None, :], v[:, None], high)
        at = t[:, None] * HALF + i[None, :]
        c = tl.load(cos_ptr + at, mask=inside[:, None], other=1.0)
        s = tl.load(sin_ptr + at, mask=inside[:, None], other=0.0)
        turned = tl.load(rot_ptr + g) != 0
        x_low = tl.where(turned, c * low - s * high, low)
        x_high = tl.where(turned, s * low + c * high, high)
        dest = out_ptr + g.to(tl.int64) * os0 + t[:, None].to(tl.int64) * os1
        tl.store(dest + i[None, :] * os2, x_low, mask=inside[:, None])
        tl.store(dest + (HALF + i[None, :]) * os2, x_high, mask=inside[:, None])
