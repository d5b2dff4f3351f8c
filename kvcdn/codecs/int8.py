"""``int8-channel-zstd``: 8-bit values with a float32 absmax scale per channel
(layer, K/V, head, lane), zstd-compressed: the scales ``[L, 2, H, D]`` (float32)
then the values ``[L, 2, H, T, D]`` (int8)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import zstandard

from kvcdn.errors import FormatError

from . import Codec
from .dest import ChunkDest

if TYPE_CHECKING:
    import torch

    from kvcdn.codec_profile import CodecProfile
    from kvcdn.container import ChunkHeader


class Int8Codec(Codec):
    id: ClassVar[str] = "int8-channel-zstd"
    natural_dtype: ClassVar[str] = "float16"  # values are dequantised to float16

    def encode(
        self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
    ) -> bytes:
        from kvcdn.kernels.quant import quantize_int8_per_channel

        q, scales = quantize_int8_per_channel(kv)
        raw = scales.contiguous().numpy().tobytes() + q.contiguous().numpy().tobytes()
        return zstandard.ZstdCompressor(level=int(params.get("zstd_level", 3))).compress(raw)

    def check_payload(
        self, header: ChunkHeader, payload: memoryview, profile: CodecProfile | None, name: str
    ) -> None:
        layers, two, heads, tokens, dim = header.shape
        expected = layers * two * heads * dim * 4 + math.prod(header.shape)
        try:
            declared = zstandard.get_frame_parameters(payload).content_size
        except zstandard.ZstdError as exc:
            raise FormatError(f"{name}: int8 payload is not a zstd frame: {exc}") from None
        if declared not in (expected, zstandard.CONTENTSIZE_UNKNOWN):
            raise FormatError(f"{name}: int8 payload declares {declared} bytes")

    def decode_into(
        self,
        header: ChunkHeader,
        payload: memoryview,
        dest: ChunkDest,
        profile: CodecProfile | None,
        name: str,
    ) -> None:
        import torch

        from kvcdn.kernels.quant import dequantize_int8_per_channel

        layers, two, heads, tokens, dim = header.shape
        n_scales = layers * two * heads * dim
        expected = n_scales * 4 + math.prod(header.shape)
        try:
            frame = zstandard.get_frame_parameters(payload)
            if frame.content_size not in (expected, zstandard.CONTENTSIZE_UNKNOWN):
                raise FormatError(f"{name}: int8 payload declares {frame.content_size} bytes")
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise FormatError(f"{name}: int8 payload does not decompress: {exc}") from None
        if len(raw) != expected:
            raise FormatError(f"{name}: int8 payload holds {len(raw)} bytes, expected {expected}")
        buf = bytearray(raw)
        scales = torch.frombuffer(buf, dtype=torch.float32, count=n_scales)
        q = torch.frombuffer(buf, dtype=torch.int8, offset=n_scales * 4)
        scales = scales.view(layers, two, heads, dim)
        if not torch.isfinite(scales).all():
            raise FormatError(f"{name}: int8 scales are not finite")
        dest.write(dequantize_int8_per_channel(q.view(header.shape).to(dest.device), scales))
