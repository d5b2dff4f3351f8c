"""Quality levels, and a chunk's KV to a container object and back.

Each level has a name (what manifests and users say), a codec (what the
container says, and what picks the decoder: :mod:`kvcdn.codecs`) and parameters.
A level's ``id`` digests all three, so a changed codec never reuses an old
object's key.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .codec_profile import LADDER, CodecProfile
from .codecs import ChunkDest, TensorDest, codec_for, known_codec, rans
from .container import ChunkHeader, pack, unpack
from .errors import FormatError, InputError
from .manifest import TEXT_LEVEL

if TYPE_CHECKING:
    import torch

    from .manifest import ChunkEntry
    from .store import Reader


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


#: Levels that need no codec profile.
FIXED_LEVELS: dict[str, Level] = {
    "fp16": Level("fp16", "fp16", {}, "16-bit floats, the lossless reference"),
    "int8": Level(
        "int8",
        "int8-channel-zstd",
        {"bits": 8, "scale": "per-channel-absmax", "zstd_level": 3},
        "8-bit per-channel quantisation, zstd-compressed",
    ),
}
ALL_LEVEL_NAMES = (*LADDER, *FIXED_LEVELS, TEXT_LEVEL)
DEFAULT_LEVELS = tuple(LADDER)


def ladder_level(name: str, profile: CodecProfile) -> Level:
    quality = profile.levels[name].quality
    return Level(
        name,
        rans.RansCodec.id,
        {"profile": profile.sha256, "level": name},
        f"calibrated to KL {LADDER[name]:g} (measured {quality.get('kl', float('nan')):.4f})",
    )


def parse_levels(
    spec: str | list[str] | tuple[str, ...], profile: CodecProfile | None = None
) -> list[Level]:
    """``"default,low"`` -> the levels, in the order given, without repeats.

    Ladder levels need the model's codec ``profile``; ``text`` is implied by
    every manifest and is not a stored level.
    """
    levels = []
    for n in check_level_names(spec):
        if n in FIXED_LEVELS:
            levels.append(FIXED_LEVELS[n])
        elif profile is None:
            raise InputError(f"level {n} needs the model's codec profile")
        elif n not in profile.levels:
            raise InputError(f"the codec profile has no level {n}")
        else:
            levels.append(ladder_level(n, profile))
    return levels


def check_level_names(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """The stored level names in ``spec`` (no repeats, no ``text``); unknown names raise."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip().lower() for n in names if n.strip() and n.strip().lower() != TEXT_LEVEL]
    if not names:
        raise InputError("no levels given")
    unknown = [n for n in names if n not in LADDER and n not in FIXED_LEVELS]
    if unknown:
        known = ", ".join(ALL_LEVEL_NAMES)
        raise InputError(f"unknown level(s) {', '.join(unknown)}; known: {known}")
    return list(dict.fromkeys(names))


def needs_profile(spec: str | list[str] | tuple[str, ...]) -> bool:
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    return any(n.strip().lower() in LADDER for n in names)


def encode_chunk(
    level: Level,
    kv: torch.Tensor,
    chunk_hash: str,
    *,
    profile: CodecProfile | None = None,
    start: int = 0,
) -> bytes:
    """One chunk's KV ``[L, 2, H, T, D]`` -> a complete container object.

    ``start`` is the chunk's first token position in its document (the first
    ``profile.sinks`` positions are kept exact).
    """
    codec = codec_for(level.codec, f"level {level.name}")
    if codec.needs_profile and profile is None:
        raise InputError(f"level {level.name} needs the model's codec profile")
    header = ChunkHeader(level.codec, level.name, level.params, tuple(kv.shape), chunk_hash)
    return pack(header, codec.encode(kv.detach().cpu(), level.params, profile, start))


def decode_into(
    data: bytes,
    dest: ChunkDest,
    *,
    name: str = "chunk object",
    profile: CodecProfile | None = None,
    verified: bool = False,
    chunk_hash: str | None = None,
) -> ChunkHeader:
    """A container object decoded into ``dest`` (a tensor view or paged blocks): the
    one decode path. ``verified=True`` says the caller has checked ``data`` against a
    trusted sha256 (the manifest's), so the trailer is not hashed again;
    ``chunk_hash``, the chunk the object must hold, and the destination's shape are
    checked before anything is decoded.

    Values are written as they are decoded: a rANS stream found corrupt at its end
    (which its sha256 cannot catch when its publisher made it so) raises after
    writing, and the caller must treat ``dest`` as not loaded."""
    header, payload = open_chunk(data, name=name, verified=verified, chunk_hash=chunk_hash)
    _decode(header, payload, dest, profile, name)
    return header


def read_chunk(
    reader: Reader,
    entry: ChunkEntry,
    level: str,
    dest: ChunkDest,
    *,
    profile: CodecProfile | None = None,
) -> ChunkHeader:
    """Chunk ``entry``'s object at ``level``, read from ``reader`` bounded by the size its
    manifest records, checked against its sha256, and decoded into ``dest`` (it must hold
    the chunk it is named for): the one fetch-verify-decode of a whole object. (A load
    streams its fetches and decodes them apart, through the same :func:`decode_into`.)"""
    ref = entry.objects[level]
    data = reader.get(ref)
    return decode_into(data, dest, name=f"object {ref.key}", profile=profile, verified=True,
                       chunk_hash=entry.hash)  # fmt: skip


def decode_chunk(
    data: bytes,
    *,
    name: str = "chunk object",
    device: str = "cpu",
    profile: CodecProfile | None = None,
    out: torch.Tensor | None = None,
    verified: bool = False,
    chunk_hash: str | None = None,
) -> tuple[ChunkHeader, torch.Tensor]:
    """:func:`decode_into` a tensor: ``out`` (of the chunk's shape, possibly a slice of
    a larger cache tensor), else a new one on ``device`` in the codec's own dtype
    (float16 for ``fp16`` and ``int8``, float32 for ladder levels). Returns the
    header and the tensor."""
    import torch

    header, payload = open_chunk(data, name=name, verified=verified, chunk_hash=chunk_hash)
    if out is None:
        codec = codec_for(header.codec, name)
        codec.check_payload(header, payload, profile, name)  # before a tensor is allocated
        out = torch.empty(header.shape, dtype=getattr(torch, codec.natural_dtype), device=device)
    _decode(header, payload, TensorDest(out), profile, name)
    return header, out


def _decode(header: ChunkHeader, payload: memoryview, dest: ChunkDest,
            profile: CodecProfile | None, name: str) -> None:  # fmt: skip
    codec = codec_for(header.codec, name)
    dest.check(header.shape, name)  # before anything is written
    codec.decode_into(header, payload, dest, profile, name)


def open_chunk(
    data: bytes, *, name: str = "chunk object", verified: bool = False,
    chunk_hash: str | None = None,
) -> tuple[ChunkHeader, memoryview]:  # fmt: skip
    """A container's header and payload, its digest checked (unless ``verified``) and
    the chunk it holds checked against ``chunk_hash`` (when given)."""
    header, payload = unpack(data, name=name, verify_digest=not verified)
    if chunk_hash is not None and header.chunk_hash != chunk_hash:
        raise FormatError(f"{name} holds another chunk than its manifest says")
    return header, payload


def is_exact(codec_id: str) -> bool:
    """Whether a level of codec ``codec_id`` holds the model's exact KV (an unknown
    codec is not)."""
    codec = known_codec(codec_id)
    return codec is not None and codec.exact


def uses_profile(codec_id: str) -> bool:
    """Whether a level of codec ``codec_id`` decodes with the model's codec profile."""
    codec = known_codec(codec_id)
    return codec is not None and codec.needs_profile


_warm_lock = threading.Lock()
_warmed: set[tuple[str, str]] = set()


def warm_up(device: str = "cpu", dtype: Any = None, dim: int = 64) -> None:
    """Load the decode kernels a load on ``device`` uses into this process, so that
    the first chunk decoded does not pay for it: the CPU kernels (about 0.3 s, from
    numba's cache) and, on a CUDA device, the Triton decoder for ``dtype`` outputs
    of ``dim`` channels (about 0.5 s). Once per process, device and dtype."""
    import torch

    dtype = dtype or torch.float32
    key = (str(torch.device(device).type), str(dtype))
    with _warm_lock:
        if ("cpu", "") not in _warmed:
            from kvcdn.kernels import rans_numba

            rans_numba.warm_up()
            _warmed.add(("cpu", ""))  # the compiled kernels are the process's
        if key[0] == "cuda" and key not in _warmed and rans.triton_available():
            from kvcdn.kernels import rans_triton

            rans_triton.warm_up(device, dtype, dim)
            _warmed.add(key)
