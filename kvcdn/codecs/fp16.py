"""``fp16``: the KV as float16, exact to what the model computed in float16 or bfloat16
(the payload is ``L * 2 * H * T * D`` little-endian float16 values, in that order)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvcdn.errors import FormatError

from . import Codec, _section_ids
from .dest import ChunkDest

if TYPE_CHECKING:
    import torch

    from kvcdn.codec_profile import CodecProfile
    from kvcdn.container import ChunkHeader, Part


class Fp16Codec(Codec):
    id: ClassVar[str] = "fp16"
    exact: ClassVar[bool] = True
    natural_dtype: ClassVar[str] = "float16"

    def encode(
        self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
    ) -> bytes:
        import torch

        return kv.to(torch.float16).contiguous().numpy().tobytes()

    def check_payload(
        self, header: ChunkHeader, payload: memoryview, profile: CodecProfile | None, name: str
    ) -> None:
        expected = math.prod(header.shape) * 2
        if len(payload) != expected:
            raise FormatError(f"{name}: fp16 payload is {len(payload)} bytes, expected {expected}")

    def decode_into(
        self,
        header: ChunkHeader,
        payload: memoryview,
        dest: ChunkDest,
        profile: CodecProfile | None,
        name: str,
    ) -> None:
        self.check_payload(header, payload, profile, name)
        dest.write_fp16(np.frombuffer(payload, dtype="<u2").reshape(header.shape))

    def decode_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        dest: ChunkDest, profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        """The part's float16 bits gathered from its sections, written at once."""
        ids = _section_ids(sections, part, header, name)
        tokens, dim = header.shape[3], header.shape[4]
        for i in ids:
            if len(sections[i]) != 4 * tokens * dim:
                raise FormatError(f"{name}: fp16 section {i} is {len(sections[i])} bytes, "
                                  f"expected {4 * tokens * dim}")  # fmt: skip
        bits = np.empty(part.shape(header.shape), dtype=np.uint16)
        for h in range(part.head_count):
            for lay in range(part.layer_count):
                i = ids[h * part.layer_count + lay]
                bits[lay, :, h] = np.frombuffer(sections[i], dtype="<u2").reshape(2, tokens, dim)
        dest.write_fp16(bits)
