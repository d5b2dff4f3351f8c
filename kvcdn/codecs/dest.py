"""Where a chunk's decoded KV goes: one interface for a tensor and for paged blocks.

A :class:`ChunkDest` holds one chunk's place, ``[L, 2, H, T, D]`` by token, and
takes values in one of two forms: float values of any dtype (:meth:`write`), and
exact float16 bits (:meth:`write_fp16`, what ``fp16`` objects and the exact first
tokens of ladder objects hold). Codecs write through it; they alone may look at
which kind of destination they were given, to pick a kernel that writes it
straight (:class:`TensorDest`: a view of a tensor on any device;
:class:`BlocksDest`: paged CPU blocks in vLLM's layouts).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from kvcdn.errors import FormatError

if TYPE_CHECKING:
    import torch

    from kvcdn.kernels.permuted import PermutedBlocks


class ChunkDest(ABC):
    """One chunk's place for its KV ``[L, 2, H, tokens, dim]``."""

    tokens: int
    dim: int
    device: str  # where values are written ("cpu", "cuda:0"): a codec computes there

    @abstractmethod
    def check(self, shape: tuple[int, ...], name: str) -> None:
        """Refuse, before anything is written, values of another shape than this
        place holds (:class:`FormatError` naming ``name``)."""

    @abstractmethod
    def write(self, kv: torch.Tensor) -> None:
        """Write float values ``[L, 2, H, tokens, dim]`` (any float dtype, any device)."""

    @abstractmethod
    def write_fp16(self, bits: np.ndarray) -> None:
        """Write exact float16 values given as their bits (``uint16 [L, 2, H, tokens,
        dim]``, possibly read-only)."""

    @abstractmethod
    def window(self, start: int, end: int) -> ChunkDest:
        """The same place for the chunk's tokens ``[start, end)`` only."""


class TensorDest(ChunkDest):
    """A writable tensor view ``[L, 2, H, T, D]`` (on any device, in any float dtype)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.tokens, self.dim = tensor.shape[3], tensor.shape[4]
        self.device = str(tensor.device)

    def check(self, shape: tuple[int, ...], name: str) -> None:
        if tuple(shape) != tuple(self.tensor.shape):
            raise FormatError(f"{name} has shape {list(shape)}, not {list(self.tensor.shape)}")

    def write(self, kv: torch.Tensor) -> None:
        import torch

        bits = self._bf16_bits()
        if bits is not None and kv.dtype == torch.float32 and kv.device.type == "cpu":
            try:
                values = kv.view(-1, *kv.shape[3:]).numpy()
            except RuntimeError:  # not viewable as one array: copied once, by numpy
                values = np.ascontiguousarray(kv.numpy()).reshape(-1, *kv.shape[3:])
            from kvcdn.kernels.cast import write_bf16

            write_bf16(values, bits)  # no torch operation: see the kernel's module
            return
        self.tensor.copy_(kv)

    def _bf16_bits(self) -> np.ndarray | None:
        """A CPU bfloat16 tensor's memory as uint16 ``[L * 2 * H, tokens, dim]``, or None
        (another dtype or device, or not viewable as one array)."""
        import torch

        t = self.tensor
        if t.dtype != torch.bfloat16 or t.device.type != "cpu":
            return None
        try:
            return t.view(torch.int16).view(-1, self.tokens, self.dim).numpy().view(np.uint16)
        except RuntimeError:
            return None

    def write_fp16(self, bits: np.ndarray) -> None:
        import torch

        if (values := self.float32_array()) is not None:  # no torch operation: see there
            from kvcdn.kernels.cast import widen_half

            widen_half(bits.reshape(values.shape), values)
            return
        # a read-only buffer is copied once; torch.from_numpy refuses to share it
        values = torch.from_numpy(bits if bits.flags.writeable else bits.copy())
        self.tensor.copy_(values.view(torch.float16))

    def window(self, start: int, end: int) -> TensorDest:
        return TensorDest(self.tensor[:, :, :, start:end])

    def float32_array(self) -> np.ndarray | None:
        """The place as a float32 array ``[L * 2 * H, tokens, dim]`` a CPU kernel writes
        straight, with no torch operation (whose OpenMP threads, spinning after it, would
        take the cores from the kernel's threads); None where the tensor is not one (on
        another device, another dtype, a window of a larger tensor)."""
        import torch

        t = self.tensor
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return None
        try:
            return t.view(-1, self.tokens, self.dim).numpy()
        except RuntimeError:  # not viewable as one array
            return None


class BlocksDest(ChunkDest):
    """Paged CPU blocks whose rows hold each head's tokens in a permuted order (vLLM's
    CPU attention layouts), written by kvcdn's CPU kernels with no staging copy:
    of the chunk's tokens, only ``lo .. hi`` (the part a load claimed)."""

    def __init__(self, blocks: PermutedBlocks) -> None:
        self.blocks = blocks
        self.tokens, self.dim = blocks.tokens, blocks.dim
        self.device = "cpu"

    def check(self, shape: tuple[int, ...], name: str) -> None:
        tokens, dim = shape[3], shape[4]
        if (tokens, dim) != (self.tokens, self.dim):
            raise FormatError(f"{name} holds {tokens} tokens of {dim} lanes, its place in the "
                              f"blocks {self.tokens} of {self.dim}")  # fmt: skip

    def write(self, kv: torch.Tensor) -> None:
        from kvcdn.kernels.paged_cpu import write_permuted

        write_permuted(np.ascontiguousarray(kv.detach().float().cpu().numpy()), self.blocks)

    def write_fp16(self, bits: np.ndarray) -> None:
        from kvcdn.kernels.paged_cpu import write_permuted

        write_permuted(bits, self.blocks)

    def window(self, start: int, end: int) -> BlocksDest:
        b = self.blocks.after(start)
        n = max(0, end - start)
        return BlocksDest(replace(b, lo=min(b.lo, n), hi=min(b.hi, n), tokens=min(b.tokens, n)))
