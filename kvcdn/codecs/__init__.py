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
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from kvcdn.errors import FormatError

from .dest import BlocksDest, ChunkDest, TensorDest

if TYPE_CHECKING:
    import torch

    from kvcdn.codec_profile import CodecProfile
    from kvcdn.container import ChunkHeader, Part

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

    def object_level(self, level: str, params: dict[str, Any]) -> str:
        """The level an object's header names: the level's own, or for an object that
        holds several (the nested ladder) the word its keys' level id begins with."""
        return level

    def object_params(self, params: dict[str, Any], start: int) -> dict[str, Any]:
        """The params an object's header holds: the level's, and what the codec needs of
        the chunk itself (the nested transform: its first token's position)."""
        return params

    def tiers_for(self, level: str, params: dict[str, Any]) -> int | None:
        """How many tiers of its object level ``level`` reads, for a codec whose one
        object holds several levels (the nested ladder); None: the object is the level."""
        return None

    def object_tiers(self, header: ChunkHeader, name: str) -> int:
        """How many tiers of sections a version-2 object of this codec with ``header``
        holds: one, but for a codec whose object holds several levels. A container of
        more is refused (:class:`FormatError`): its extra sections would be bytes no
        reader decodes."""
        return 1

    # ---- version-2 objects: one section per KV head and layer ----------------------
    # The defaults treat each section as a payload of its own, of shape [1, 2, 1, T, D]
    # (fp16 and int8 are); a codec whose sections share state (the ladder codec's
    # profile) overrides them.

    def encode_sections(
        self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
    ) -> list[bytes]:
        """The sections of ``kv`` ``[L, 2, H, T, D]`` in table order (head-major:
        section ``h * L + l`` is head ``h`` of layer ``l``)."""
        layers, _, heads = kv.shape[:3]
        return [
            self.encode(kv[lay : lay + 1, :, h : h + 1].contiguous(), params, profile, start)
            for h in range(heads)
            for lay in range(layers)
        ]

    def check_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        """:meth:`check_payload` for the sections of ``part`` (all present)."""
        one = _one_section(header)
        for i in _section_ids(sections, part, header, name):
            self.check_payload(one, sections[i], profile, f"{name} section {i}")

    def decode_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        dest: ChunkDest, profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        """Decode ``part`` of the chunk from its sections into ``dest`` (of the part's
        shape): each section into a staging tensor, then the part at once."""
        import torch

        self.check_sections(header, sections, part, profile, name)
        staged = torch.empty(part.shape(header.shape), dtype=torch.float32)
        one = _one_section(header)
        layers = header.shape[0]
        for h in range(part.head_count):
            for lay in range(part.layer_count):
                i = (part.heads[0] + h) * layers + part.layers[0] + lay
                view = TensorDest(staged[lay : lay + 1, :, h : h + 1])
                self.decode_into(one, sections[i], view, profile, f"{name} section {i}")
        dest.write(staged)


def _one_section(header: ChunkHeader) -> ChunkHeader:
    """The header a version-2 section decodes under: one layer, one head."""
    return replace(header, shape=(1, 2, 1, header.shape[3], header.shape[4]))


def _section_ids(sections: Mapping[int, memoryview], part: Part, header: ChunkHeader,
                 name: str) -> list[int]:  # fmt: skip
    """The sections of ``part``, refused unless the part fits and all are present."""
    if not part.fits(header.shape) or part.tier_count(1) != 1:
        raise FormatError(f"{name}: part {part} is not within shape {list(header.shape)}")
    ids = part.section_ids(header.shape[0])
    if any(i not in sections for i in ids):
        raise FormatError(f"{name}: a section of {part} was not read")
    return ids


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
    from .nested import NestedCodec, NestedKltCodec
    from .rans import RansCodec

    for codec in (Fp16Codec(), Int8Codec(), RansCodec(), NestedCodec(), NestedKltCodec()):
        register_codec(codec)


_register_builtin()
