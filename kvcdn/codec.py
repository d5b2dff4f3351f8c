"""Quality levels: how a chunk's KV becomes a container payload and back.

Each level has a name (what manifests and users say), a codec (what the
container says, and what picks the decoder) and parameters. A level's ``id``
digests all three, so a changed codec never reuses an old object's key.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zstandard

from .container import ChunkHeader, pack, unpack
from .errors import FormatError, InputError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Level:
    name: str
    codec: str
    params: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def id(self) -> str:
        blob = json.dumps([self.codec, self.params], sort_keys=True).encode()
        return f"{self.name}-{hashlib.sha256(blob).hexdigest()[:12]}"

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "params": self.params, "description": self.description}


LEVELS: dict[str, Level] = {
    "fp16": Level("fp16", "fp16", {}, "16-bit floats, the lossless reference"),
    "int8": Level(
        "int8",
        "int8-channel-zstd",
        {"bits": 8, "scale": "per-channel-absmax", "zstd_level": 3},
        "8-bit per-channel quantisation, zstd-compressed",
    ),
}
DEFAULT_LEVELS = ("fp16", "int8")


def parse_levels(spec: str | list[str] | tuple[str, ...]) -> list[Level]:
    """``"fp16,int8"`` -> the levels, in the order given, without repeats."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip().lower() for n in names if n.strip()]
    if not names:
        raise InputError("no levels given")
    unknown = [n for n in names if n not in LEVELS]
    if unknown:
        raise InputError(f"unknown level(s) {', '.join(unknown)}; known: {', '.join(LEVELS)}")
    return [LEVELS[n] for n in dict.fromkeys(names)]


def encode_chunk(level: Level, kv: torch.Tensor, chunk_hash: str) -> bytes:
    """One chunk's KV ``[L, 2, H, T, D]`` -> a complete container object."""
    header = ChunkHeader(level.codec, level.name, level.params, tuple(kv.shape), chunk_hash)
    return pack(header, _ENCODERS[level.codec](kv.detach().cpu(), level.params))


def decode_chunk(
    data: bytes, *, name: str = "chunk object", device: str = "cpu"
) -> tuple[ChunkHeader, torch.Tensor]:
    """A container object -> (its header, fp16 KV ``[L, 2, H, T, D]`` on ``device``)."""
    header, payload = unpack(data, name=name)
    decoder = _DECODERS.get(header.codec)
    if decoder is None:
        raise FormatError(f"{name} uses codec '{header.codec}', which this kvcdn cannot decode")
    return header, decoder(header, payload, name, device)


# ---- codecs -------------------------------------------------------------------


def _encode_fp16(kv: torch.Tensor, params: dict[str, Any]) -> bytes:
    import torch

    return kv.to(torch.float16).contiguous().numpy().tobytes()


def _decode_fp16(header: ChunkHeader, payload: memoryview, name: str, device: str) -> torch.Tensor:
    import torch

    expected = math.prod(header.shape) * 2
    if len(payload) != expected:
        raise FormatError(f"{name}: fp16 payload is {len(payload)} bytes, expected {expected}")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float16)
    return flat.view(header.shape).to(device)


def _encode_int8(kv: torch.Tensor, params: dict[str, Any]) -> bytes:
    from kvcdn.kernels.quant import quantize_int8_per_channel

    q, scales = quantize_int8_per_channel(kv)
    raw = scales.contiguous().numpy().tobytes() + q.contiguous().numpy().tobytes()
    return zstandard.ZstdCompressor(level=int(params.get("zstd_level", 3))).compress(raw)


def _decode_int8(header: ChunkHeader, payload: memoryview, name: str, device: str) -> torch.Tensor:
    import torch

    from kvcdn.kernels.quant import dequantize_int8_per_channel

    layers, two, heads, tokens, dim = header.shape
    n_scales = layers * two * heads * dim
    expected = n_scales * 4 + math.prod(header.shape)
    try:
        params = zstandard.get_frame_parameters(payload)
        if params.content_size not in (expected, zstandard.CONTENTSIZE_UNKNOWN):
            raise FormatError(f"{name}: int8 payload declares {params.content_size} bytes")
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
    return dequantize_int8_per_channel(q.view(header.shape).to(device), scales.to(device))


_ENCODERS = {"fp16": _encode_fp16, "int8-channel-zstd": _encode_int8}
_DECODERS = {"fp16": _decode_fp16, "int8-channel-zstd": _decode_int8}
