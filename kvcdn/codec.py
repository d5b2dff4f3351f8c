"""Quality levels: how a chunk's KV becomes a container payload and back.

Each level has a name (what manifests and users say), a codec (what the
container says, and what picks the decoder) and parameters. A level's ``id``
digests all three, so a changed codec never reuses an old object's key.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from .codec_profile import LADDER, CodecProfile
from .container import ChunkHeader, pack, unpack
from .errors import FormatError, InputError
from .manifest import TEXT_LEVEL

if TYPE_CHECKING:
    import torch

    from kvcdn.kernels.permuted import PermutedBlocks


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
RANS_CODEC = "kvcdn-rans-v1"
ALL_LEVEL_NAMES = (*LADDER, *FIXED_LEVELS, TEXT_LEVEL)
DEFAULT_LEVELS = tuple(LADDER)


def ladder_level(name: str, profile: CodecProfile) -> Level:
    quality = profile.levels[name].quality
    return Level(
        name,
        RANS_CODEC,
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
    header = ChunkHeader(level.codec, level.name, level.params, tuple(kv.shape), chunk_hash)
    kv = kv.detach().cpu()
    if level.codec == RANS_CODEC:
        if profile is None:
            raise InputError(f"level {level.name} needs the model's codec profile")
        return pack(header, _encode_rans(kv, level.params, profile, start))
    return pack(header, _ENCODERS[level.codec](kv, level.params))


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
    """A container object -> (its header, KV ``[L, 2, H, T, D]`` on ``device``).

    With ``out`` (a tensor of the chunk's shape, possibly a slice of a larger
    cache tensor) the KV is written there and ``out`` is returned; otherwise
    a new tensor is returned (fp16 for the fixed levels, float32 on CPU for
    ladder levels). ``verified=True`` says the caller has checked ``data``
    against a trusted sha256 (the manifest's), so the trailer is not hashed
    again; ``chunk_hash``, the chunk the object must hold, is checked before
    anything is decoded.
    """
    header, payload = _open(data, name, verified, chunk_hash)
    if header.codec == RANS_CODEC:
        return header, _decode_rans(header, payload, name, device, profile, out)
    kv = _fixed_decoder(header, name)(header, payload, name, device)
    if out is not None:
        if tuple(out.shape) != tuple(kv.shape):
            raise FormatError(f"{name} has shape {list(kv.shape)}, not {list(out.shape)}")
        out.copy_(kv)
        return header, out
    return header, kv


# ---- codecs -------------------------------------------------------------------


def _encode_fp16(kv: torch.Tensor, params: dict[str, Any]) -> bytes:
    import torch

    return kv.to(torch.float16).contiguous().numpy().tobytes()


def _fp16_bits(header: ChunkHeader, payload: memoryview, name: str) -> np.ndarray:
    """The fp16 payload as float16 bits ``[L, 2, H, T, D]`` (uint16, read-only)."""
    expected = math.prod(header.shape) * 2
    if len(payload) != expected:
        raise FormatError(f"{name}: fp16 payload is {len(payload)} bytes, expected {expected}")
    return np.frombuffer(payload, dtype="<u2").reshape(header.shape)


def _decode_fp16(header: ChunkHeader, payload: memoryview, name: str, device: str) -> torch.Tensor:
    import torch

    bits = _fp16_bits(header, payload, name)
    return torch.from_numpy(bits.copy()).view(torch.float16).to(device)


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


# ---- the rANS ladder codec ------------------------------------------------------
#
# Payload (little-endian), specified in docs/format.md:
#   u32 G, u32 T, u32 D, u32 S     groups (layers*2*heads), tokens, head dim, exact tokens
#   u32 word_start[G + 1]          group g's words are words[word_start[g]:word_start[g+1]]
#   u32 states[G * D]              initial decoder state of every stream
#   f16 sinks[G * S * D]           the first S tokens, exact
#   u16 words[word_start[G]]       the interleaved rANS words of all groups

_RANS_PREAMBLE = struct.Struct("<IIII")


def _encode_rans(
    kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile, start: int
) -> bytes:
    from kvcdn.kernels import rans_numba

    level = params["level"]
    layers, two, heads, tokens, dim = kv.shape
    if (layers, heads, dim) != (
        profile.layout.layers,
        profile.layout.kv_heads,
        profile.layout.head_dim,
    ):
        raise InputError("the KV does not have the shape the codec profile was calibrated for")
    groups = layers * two * heads
    sinks = max(0, min(profile.sinks - start, tokens))
    x = kv.float().numpy().reshape(groups, tokens, dim)
    states, words, word_start = rans_numba.quantise_encode(
        x[:, sinks:], *profile.quantiser(level), profile.freqs
    )
    sink = x[:, :sinks].astype(np.float16)
    return b"".join(
        (
            _RANS_PREAMBLE.pack(groups, tokens, dim, sinks),
            word_start.astype("<u4").tobytes(),
            states.astype("<u4").tobytes(),
            sink.tobytes(),
            words.astype("<u2").tobytes(),
        )
    )


@dataclass(frozen=True)
class _RansParts:
    """A rANS payload's tables, checked against its header and the codec profile."""

    level: str
    groups: int
    sinks: int  # the first tokens, stored exact
    word_start: np.ndarray
    states: np.ndarray
    sink: np.ndarray  # float16 [groups, sinks, dim]
    words: np.ndarray


def _rans_parts(
    header: ChunkHeader, payload: memoryview, name: str, profile: CodecProfile | None
) -> _RansParts:
    if profile is None:
        raise FormatError(f"{name} needs a codec profile to decode, and none was given")
    level = header.params.get("level")
    if header.params.get("profile") != profile.sha256:
        raise FormatError(f"{name} was encoded with another codec profile than the one given")
    if level not in profile.levels or header.level != level:
        raise FormatError(f"{name}: the codec profile has no level {level!r}")
    layers, two, heads, tokens, dim = header.shape
    lay = profile.layout
    if (layers, two, heads, dim) != (lay.layers, 2, lay.kv_heads, lay.head_dim):
        raise FormatError(f"{name}: shape {list(header.shape)} does not fit the codec profile")
    groups = layers * two * heads
    if len(payload) < _RANS_PREAMBLE.size:
        raise FormatError(f"{name}: payload is truncated")
    g, t, d, s = _RANS_PREAMBLE.unpack_from(payload, 0)
    if (g, t, d) != (groups, tokens, dim) or s > tokens:
        raise FormatError(f"{name}: payload dimensions {g, t, d, s} contradict the header")
    off = _RANS_PREAMBLE.size
    if len(payload) < off + 4 * (groups + 1):
        raise FormatError(f"{name}: payload is truncated before its stream offset table ends")
    word_start = np.frombuffer(payload, dtype="<u4", count=groups + 1, offset=off).astype(np.int64)
    off += 4 * (groups + 1)
    n_states = groups * dim
    n_words = int(word_start[-1])
    expected = off + 4 * n_states + 2 * groups * s * dim + 2 * n_words
    if expected != len(payload):
        raise FormatError(f"{name}: payload is {len(payload)} bytes, its tables say {expected}")
    if word_start[0] != 0 or np.any(np.diff(word_start) < 0):
        raise FormatError(f"{name}: stream offset table is not monotonic from 0")
    if np.any(np.diff(word_start) > (tokens - s) * dim):
        raise FormatError(f"{name}: a stream is longer than its symbols allow")
    states = np.frombuffer(payload, dtype="<u4", count=n_states, offset=off).reshape(groups, dim)
    off += 4 * n_states
    sink = np.frombuffer(payload, dtype="<f2", count=groups * s * dim, offset=off)
    off += 2 * groups * s * dim
    words = np.frombuffer(payload, dtype="<u2", count=n_words, offset=off)
    if np.any(states < (1 << 16)):
        raise FormatError(f"{name}: a stream state is out of range")
    return _RansParts(level, groups, s, word_start, states, sink.reshape(groups, s, dim), words)


def _decode_rans(
    header: ChunkHeader,
    payload: memoryview,
    name: str,
    device: str,
    profile: CodecProfile | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    import torch

    from kvcdn.kernels.rans import RansError

    parts = _rans_parts(header, payload, name, profile)
    assert profile is not None  # _rans_parts refuses none
    groups, s, tokens, dim = parts.groups, parts.sinks, header.shape[3], header.shape[4]
    words, word_start, states = parts.words, parts.word_start, parts.states
    if out is None:
        out = torch.empty(header.shape, dtype=torch.float32, device=device)
    elif tuple(out.shape) != tuple(header.shape):
        raise FormatError(f"{name} has shape {list(header.shape)}, not {list(out.shape)}")
    flat = out.view(groups, tokens, dim)
    if s:
        flat[:, :s] = torch.from_numpy(parts.sink.copy()).to(flat)
    tid, scale, offset = profile.dequant(parts.level)
    body = flat[:, s:]
    try:
        if out.device.type == "cuda" and _triton_available():
            from kvcdn.kernels import rans_triton

            args = rans_triton.to_device(
                words, word_start, states, profile.decode_tables(), tid, scale, offset, out.device
            )
            rans_triton.decode(*args, body)
        elif out.dtype == torch.float32:
            from kvcdn.kernels import rans_numba

            rans_numba.decode(
                words, word_start, states, profile.decode_tables(), tid, scale, offset, body.numpy()
            )
        else:  # another dtype, or CUDA without Triton: decode on the CPU, then copy
            from kvcdn.kernels import rans_numba

            tmp = np.empty((groups, tokens - s, dim), dtype=np.float32)
            rans_numba.decode(
                words, word_start, states, profile.decode_tables(), tid, scale, offset, tmp
            )
            body.copy_(torch.from_numpy(tmp))
    except RansError as exc:
        raise FormatError(f"{name}: {exc}") from None
    return out


def decode_into_blocks(
    data: bytes,
    into: PermutedBlocks,
    *,
    name: str = "chunk object",
    profile: CodecProfile | None = None,
    verified: bool = False,
    chunk_hash: str | None = None,
) -> ChunkHeader:
    """:func:`decode_chunk` straight into paged CPU blocks (vLLM's CPU layouts, see
    :class:`~kvcdn.kernels.permuted.PermutedBlocks`): fp16 and rANS in one pass
    with no staging copy, other codecs through a float32 copy of the chunk.

    Values are written as they are decoded: a rANS stream found corrupt at its end
    (which its sha256 cannot catch when its publisher made it so) raises after
    writing, and the caller must treat the blocks as not loaded."""
    from dataclasses import replace

    from kvcdn.kernels import rans_numba
    from kvcdn.kernels.paged_cpu import write_permuted
    from kvcdn.kernels.rans import RansError

    header, payload = _open(data, name, verified, chunk_hash)
    layers, two, heads, tokens, dim = header.shape
    if (tokens, dim) != (into.tokens, into.dim):  # before any write (the sinks come first)
        raise FormatError(f"{name} holds {tokens} tokens of {dim} lanes, its place in the "
                          f"blocks {into.tokens} of {into.dim}")  # fmt: skip
    try:
        if header.codec == "fp16":
            write_permuted(_fp16_bits(header, payload, name), into)
        elif header.codec == RANS_CODEC:
            parts = _rans_parts(header, payload, name, profile)
            assert profile is not None  # _rans_parts refuses none
            s = parts.sinks
            if s:
                sink = parts.sink.view(np.uint16).reshape(layers, two, heads, s, dim)
                write_permuted(sink, replace(into, lo=min(into.lo, s), hi=min(into.hi, s),
                                             tokens=min(into.tokens, s)))  # fmt: skip
            tid, scale, offset = profile.dequant(parts.level)
            rans_numba.decode_permuted(
                parts.words, parts.word_start, parts.states, profile.decode_tables(), tid,
                scale, offset, tokens - s, into.after(s),
            )  # fmt: skip
        else:
            kv = _fixed_decoder(header, name)(header, payload, name, "cpu")
            write_permuted(np.ascontiguousarray(kv.float().numpy()), into)
    except RansError as exc:
        raise FormatError(f"{name}: {exc}") from None
    return header


def _fixed_decoder(header: ChunkHeader, name: str) -> Any:
    """The decoder of a codec without a profile (fp16, int8), or a clear refusal."""
    decoder = _DECODERS.get(header.codec)
    if decoder is None:
        raise FormatError(f"{name} uses codec '{header.codec}', which this kvcdn cannot decode")
    return decoder


def _open(
    data: bytes, name: str, verified: bool, chunk_hash: str | None
) -> tuple[ChunkHeader, memoryview]:
    header, payload = unpack(data, name=name, verify_digest=not verified)
    if chunk_hash is not None and header.chunk_hash != chunk_hash:
        raise FormatError(f"{name} holds another chunk than its manifest says")
    return header, payload


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
        if key[0] == "cuda" and key not in _warmed and _triton_available():
            from kvcdn.kernels import rans_triton

            rans_triton.warm_up(device, dtype, dim)
            _warmed.add(key)


def _triton_available() -> bool:
    try:
        from kvcdn.kernels import rans_triton
    except ImportError:
        return False
    return rans_triton.available()


_ENCODERS = {"fp16": _encode_fp16, "int8-channel-zstd": _encode_int8}
_DECODERS = {"fp16": _decode_fp16, "int8-channel-zstd": _decode_int8}
