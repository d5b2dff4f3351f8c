"""GPU decoder for the interleaved rANS of :mod:`kvcdn.kernels.rans` (Triton).

Same contract and bit-exact results as :func:`kvcdn.kernels.rans.decode_ref`
and :func:`kvcdn.kernels.rans_numba.decode`, on torch tensors.

Design: one program per group ``g``; the ``D`` lanes of the group are one
vector of ``BLOCK_D`` (a power of two, at least 32, lanes ``>= D`` masked).
Each step ``t`` decodes one symbol per lane (one gather from the packed
table), then the lanes whose state fell below ``L`` take the next words of
the group's shared buffer *in lane order*: lane ``d`` reads word
``pos + (number of lanes < d that need one)``, an exclusive prefix sum.
Dequantisation (``float32(sym) * scale + offset``, multiply then add, then a
round-to-nearest-even conversion to ``out``'s dtype, as torch's ``.to(dtype)``)
is fused in and written straight into ``out``, which may be any strided view.
The bfloat16 rounding is done with integer ops, so the interpreter (whose
float32 -> bfloat16 cast truncates) and GPUs give the same bits.

Tensor layouts (see :func:`to_device`); uint32 and uint16 data travel as the
signed type of the same width, bit for bit, since torch has little uint32
support:

``words``       int16 ``[n_words]`` (the uint16 words, reinterpreted)
``word_start``  int64 ``[G + 1]``
``states``      int32 ``[G, D]`` (the uint32 states, reinterpreted)
``lut``         int32 ``[n_tables, 4096]`` (the uint32 packed entries, reinterpreted)
``table_id``    int32 ``[G, D]``
``scale``       float32 ``[G, D]``
``offset``      float32 ``[G, D]``
``out``         float32, float16 or bfloat16 ``[G, T, D]``, any strides

``sym * scale`` is exact in float32 (scales keep 4 significant bits), so a
fused multiply-add would give the same bits; fusion is off all the same.

Inside the kernel states and table entries are bit-cast to uint32 and all
state arithmetic is uint32, as in the numba kernel. ``freq * (x >> 12) +
bias`` cannot wrap: it is at most ``4096 * (2**20 - 1) + 4095 = 2**32 - 1``.

Errors are flagged per group (reading at or past ``word_start[g + 1]``, not
ending at it, or a final state other than ``L``); :func:`decode` raises
:class:`~kvcdn.kernels.rans.RansError` if any group is flagged (one sync).

The module imports without Triton; :func:`available` says whether the GPU
path can run. Setting ``TRITON_INTERPRET=1`` before Triton is first imported
runs the kernel on CPU tensors (Triton's interpreter), which the tests use.
"""

from __future__ import annotations

import numpy as np
import torch

from .rans import PROB_BITS, PROB_SCALE, RANS_L, RansError

try:  # the module must import (and report unavailable) where Triton is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MIN_BLOCK_D = 32  # one warp


def available() -> bool:
    """True when Triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def store_rounded(ptr, val, mask, OUT_BF16: tl.constexpr):
        """float32 ``val`` into ``ptr``'s dtype, rounded as torch's ``.to`` rounds. bfloat16
        by hand, to nearest even (NaN -> 0x7FC0, as torch does): the interpreter's own
        float32 -> bfloat16 cast truncates, while GPUs round."""
        if OUT_BF16:
            b = tl.cast(val, tl.uint32, bitcast=True)
            b = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
            h = tl.where(val != val, 0x7FC0, b).to(tl.uint16)
            tl.store(ptr, tl.cast(h, tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(ptr, val.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _decode_kernel(
        words_ptr,
        word_start_ptr,
        states_ptr,
        lut_ptr,
        table_id_ptr,
        scale_ptr,
        offset_ptr,
        out_ptr,
        err_ptr,
        T,
        D,
        stride_og,
        stride_ot,
        stride_od,
        BLOCK_D: tl.constexpr,
        PROB_BITS_C: tl.constexpr,
        RANS_L_C: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        g = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK_D)
        live = lane < D
        row = g * D + lane

        # Dead lanes start at L and never take a word.
        x = tl.load(states_ptr + row, mask=live, other=RANS_L_C)
        x = tl.cast(x, tl.uint32, bitcast=True)
        tab = tl.load(table_id_ptr + row, mask=live, other=0).to(tl.int64) << PROB_BITS_C
        scale = tl.load(scale_ptr + row, mask=live, other=0.0)
        offset = tl.load(offset_ptr + row, mask=live, other=0.0)
        pos = tl.load(word_start_ptr + g)
        end = tl.load(word_start_ptr + g + 1)
        bad = tl.zeros([BLOCK_D], dtype=tl.int32)
        out_row = out_ptr + g * stride_og + lane * stride_od

        for _t in range(T):
            slot = (x & ((1 << PROB_BITS_C) - 1)).to(tl.int64)
            e = tl.load(lut_ptr + tab + slot, mask=live, other=0)
            e = tl.cast(e, tl.uint32, bitcast=True)
            sym = e & 0xFF
            freq = ((e >> 8) & 0xFFF) + 1
            x = freq * (x >> PROB_BITS_C) + (e >> 20)
            need = (x < RANS_L_C) & live
            need_i = need.to(tl.int32)
            idx = pos + (tl.cumsum(need_i, axis=0) - need_i)
            inside = idx < end
            bad = bad | (need & (idx >= end)).to(tl.int32)
            w = tl.load(words_ptr + idx, mask=need & inside, other=0).to(tl.int32) & 0xFFFF
            x = tl.where(need & inside, (x << 16) | w.to(tl.uint32), x)
            pos = pos + tl.sum(need_i, axis=0)
            val = sym.to(tl.float32) * scale
            val = val + offset
            store_rounded(out_row, val, live, OUT_BF16)
            out_row += stride_ot

        bad = bad | (live & (x != RANS_L_C)).to(tl.int32)
        flag = tl.max(bad, axis=0) | (pos != end).to(tl.int32)
        tl.store(err_ptr + g, flag)


def _as_bits(t: torch.Tensor, signed: torch.dtype, unsigned_name: str) -> torch.Tensor:
    """``t`` reinterpreted as ``signed`` if it holds the unsigned type of the same width."""
    unsigned = getattr(torch, unsigned_name, None)
    if unsigned is not None and t.dtype == unsigned:
        return t.view(signed)
    return t


def decode(
    words: torch.Tensor,
    word_start: torch.Tensor,
    states: torch.Tensor,
    lut: torch.Tensor,
    table_id: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    out: torch.Tensor,
    *,
    num_warps: int | None = None,
) -> None:
    """Decode into ``out [G, T, D]``: same contract as :func:`kvcdn.kernels.rans.decode_ref`.

    Layouts are in the module docstring. Raises :class:`RansError` on a
    corrupt stream (``out`` is then partly written).
    """
    if triton is None:
        raise RuntimeError("kvcdn.kernels.rans_triton needs triton")
    if out.dim() != 3 or out.dtype not in _OUT_DTYPES:
        raise ValueError("out must be a float32, float16 or bfloat16 tensor [G, T, D]")
    G, T, D = out.shape
    words = _as_bits(words, torch.int16, "uint16")
    states = _as_bits(states, torch.int32, "uint32")
    lut = _as_bits(lut, torch.int32, "uint32")
    expect = {
        "words": (words, torch.int16, None),
        "word_start": (word_start, torch.int64, (G + 1,)),
        "states": (states, torch.int32, (G, D)),
        "lut": (lut, torch.int32, None),
        "table_id": (table_id, torch.int32, (G, D)),
        "scale": (scale, torch.float32, (G, D)),
        "offset": (offset, torch.float32, (G, D)),
    }
    for name, (t, dtype, shape) in expect.items():
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != out.device:
            raise ValueError(f"{name} is on {t.device}, out on {out.device}")
    if words.dim() != 1 or lut.dim() != 2 or lut.shape[1] != PROB_SCALE:
        raise ValueError(f"words must be 1-D and lut [n_tables, {PROB_SCALE}]")
    if G == 0:
        return
    if words.numel() == 0:  # never read (every load is masked), but keep a real pointer
        words = torch.zeros(1, dtype=torch.int16, device=out.device)
    block_d = max(_MIN_BLOCK_D, triton.next_power_of_2(max(D, 1)))
    if num_warps is None:
        num_warps = max(1, block_d // 64)
    err = torch.zeros(G, dtype=torch.int32, device=out.device)
    _decode_kernel[(G,)](
        words.contiguous(),
        word_start.contiguous(),
        states.contiguous(),
        lut.contiguous(),
        table_id.contiguous(),
        scale.contiguous(),
        offset.contiguous(),
        out,
        err,
        T,
        D,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        BLOCK_D=block_d,
        PROB_BITS_C=PROB_BITS,
        RANS_L_C=RANS_L,
        OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=num_warps,
        enable_fp_fusion=False,  # multiply, then add (exact either way: see the docstring)
    )
    if bool(err.any()):
        raise RansError("rANS stream does not end where it should (corrupt payload)")


def to_device(
    words: np.ndarray,
    word_start: np.ndarray,
    states: np.ndarray,
    lut: np.ndarray,
    table_id: np.ndarray,
    scale: np.ndarray,
    offset: np.ndarray,
    device: str | torch.device,
) -> tuple[torch.Tensor, ...]:
    """Numpy coder outputs -> the tensors :func:`decode` takes, on ``device``.

    Returns ``(words, word_start, states, lut, table_id, scale, offset)``.
    """
    return (*streams_to_device(words, word_start, states, device),
            *tables_to_device(lut, table_id, scale, offset, device))  # fmt: skip


def streams_to_device(
    words: np.ndarray, word_start: np.ndarray, states: np.ndarray, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's streams: ``(words, word_start, states)`` on ``device``."""
    put = array_to_device
    return (put(words, np.uint16, device, np.int16), put(word_start, np.int64, device),
            put(states, np.uint32, device, np.int32))  # fmt: skip


def tables_to_device(
    lut: np.ndarray, table_id: np.ndarray, scale: np.ndarray, offset: np.ndarray,
    device: str | torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """What is the same for every chunk of a level: ``(lut, table_id, scale, offset)`` on
    ``device``, which a caller can keep there."""
    put = array_to_device
    return (put(lut, np.uint32, device, np.int32), put(table_id, np.int32, device),
            put(scale, np.float32, device), put(offset, np.float32, device))  # fmt: skip


def array_to_device(a: np.ndarray | torch.Tensor, dtype: type, device: str | torch.device,
                    view: type | None = None) -> torch.Tensor:  # fmt: skip
    """``a`` as ``dtype`` (its bits read as ``view``, if given) on ``device``; a tensor
    (one a caller keeps on the device already, in the kernel's dtype) as it is there."""
    if isinstance(a, torch.Tensor):
        return a.to(device)
    a = np.ascontiguousarray(a, dtype=dtype)
    if not a.flags.writeable:  # a view of an object's bytes: torch would warn, once a
        a = a.copy()  # process, of a tensor it could write through (it only reads it)
    return torch.from_numpy(a.view(view) if view is not None else a).to(device)


def warm_up(device: str | torch.device, dtype: torch.dtype, dim: int) -> None:
    """Compile (or load from Triton's cache) the decoder for ``dtype`` outputs of
    ``dim`` channels on ``device``, so that a process's first chunk does not wait
    for it (about 0.5 s on an H200). Triton specialises integer arguments by
    divisibility by 16, so both kinds of chunk length are run."""
    from .rans import build_decode_table, encode_ref, normalize_freqs

    freqs = normalize_freqs(np.arange(1, 13, dtype=np.float64))[None, :]
    lut = build_decode_table(freqs)
    table_id = np.zeros((1, dim), dtype=np.int32)
    scale = np.ones((1, dim), dtype=np.float32)
    offset = np.zeros((1, dim), dtype=np.float32)
    for tokens in (16, 17):
        sym = np.zeros((1, tokens, dim), dtype=np.uint8)
        states, words, word_start = encode_ref(sym, table_id, freqs)
        args = to_device(words, word_start, states, lut, table_id, scale, offset, device)
        out = torch.empty((1, tokens + 1, dim), dtype=dtype, device=device)
        decode(*args, out[:, 1:])  # after sink tokens, as the codec writes
