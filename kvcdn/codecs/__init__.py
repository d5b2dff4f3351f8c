"""Codecs: how a chunk's KV becomes a container payload, and back into a destination.

Each codec is a :class:`Codec` registered under the string a container's header
names it by (``"fp16"``, ``"int8-channel-zstd"``, ``"kvcdn-rans-v1"``); nothing
outside this package tests a codec's name. A codec says whether it needs the
model's codec profile and whether it is exact, encodes KV into a payload, and
decodes a payload into a :class:`~kvcdn.codecs.dest.ChunkDest` (a tensor view or
paged blocks). Adding a codec is one module here, registered below, plus its
payload's specification in ``docs/format.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from kvcdn.errors import FormatError

from .dest import BlocksDest, ChunkDest, TensorDest

if TYPE_CHECKING:
    import torch

    from kvcdn.codec_profile import CodecProfile
    from kvcdn.container import ChunkHeader

__all__ = [
    "BlocksDest",
    "ChunkDest",
    "Codec",
    "TensorDest",
    "codec_for",
    "known_codec",
    "register_codec",
]


class Codec(ABC):
    """One way of storing a chunk's KV ``[L, 2, H, T, D]``."""

    #: The codec's name in container headers and manifests.
    id: ClassVar[str]
    #: Encoding and decoding need the model's calibrated codec profile.
    needs_profile: ClassVar[bool] = False
    #: Decoding gives back exactly the float16 values of what was encoded: the model's
    #: own KV, as exact as a store can hold it.
    exact: ClassVar[bool] = False
    #: The dtype a decode allocates when the caller gives no destination.
    natural_dtype: ClassVar[str] = "float32"

    @abstractmethod
    def encode(
        self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
    ) -> bytes:
        """The payload of ``kv`` (on the CPU) whose first token is the document's token
        ``start``."""

    @abstractmethod
    def check_payload(
        self, header: ChunkHeader, payload: memoryview, profile: CodecProfile | None, name: str
    ) -> None:
        """Refuse a payload whose lengths and tables contradict ``header`` (or the
        profile), before anything is allocated for it (:class:`FormatError`);
        :meth:`decode_into` checks as much again before it writes."""

    @abstractmethod
    def decode_into(
        self,
        header: ChunkHeader,
        payload: memoryview,
        dest: ChunkDest,
        profile: CodecProfile | None,
        name: str,
    ) -> None:
        """Decode ``payload`` (checked against ``header`` first, every length and table
        before it is used) into ``dest``, whose shape the caller has checked against the
        header's. Errors are :class:`FormatError` naming ``name``; values may have been
        written when one is raised at the end of a stream."""


_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    """Make ``codec`` the decoder of containers naming ``codec.id``."""
    _REGISTRY[codec.id] = codec
    return codec


def known_codec(codec_id: str) -> Codec | None:
    """The codec named ``codec_id``, or None when this kvcdn has none by that name."""
    return _REGISTRY.get(codec_id)


def codec_for(codec_id: str, name: str = "chunk object") -> Codec:
    """The codec named ``codec_id``; :class:`FormatError` naming ``name`` otherwise."""
    codec = _REGISTRY.get(codec_id)
    if codec is None:
        raise FormatError(f"{name} uses codec '{codec_id}', which this kvcdn does not know")
    return codec


def _register_builtin() -> None:
    from .fp16 import Fp16Codec
    from .int8 import Int8Codec
    from .rans import RansCodec

    for codec in (Fp16Codec(), Int8Codec(), RansCodec()):
        register_codec(codec)


_register_builtin()
