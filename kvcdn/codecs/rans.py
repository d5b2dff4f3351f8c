"""``kvcdn-rans-v1``: the calibrated ladder codec (CacheGen-style).

Each group (layer, K/V, head) is quantised per lane with the codec profile's
steps for the level, and its symbols are rANS-coded with the profile's
frequency tables, interleaved over the lanes; the document's first
``profile.sinks`` tokens are kept exact as float16. Payload (little-endian),
specified in docs/format.md::

    u32 G, u32 T, u32 D, u32 S     groups (layers*2*heads), tokens, head dim, exact tokens
    u32 word_start[G + 1]          group g's words are words[word_start[g]:word_start[g+1]]
    u32 states[G * D]              initial decoder state of every stream
    f16 sinks[G * S * D]           the first S tokens, exact
    u16 words[word_start[G]]       the interleaved rANS words of all groups
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvcdn.errors import FormatError, InputError

from . import Codec, _section_ids
from .dest import BlocksDest, ChunkDest, TensorDest

if TYPE_CHECKING:
    import torch

    from kvcdn.codec_profile import CodecProfile
    from kvcdn.container import ChunkHeader, Part

_PREAMBLE = struct.Struct("<IIII")
#: A version-2 section (one head of one layer: its K group, then its V group):
#: u32 S, u32 words of K, u32 words of V; u32 states[2][D]; f16 sinks[2][S][D]; u16 words.
SECTION_COUNTS = struct.Struct("<III")


@dataclass(frozen=True)
class _Parts:
    """A payload's tables, checked against its header and the codec profile."""

    level: str
    groups: int
    sinks: int  # the first tokens, stored exact
    word_start: np.ndarray
    states: np.ndarray
    sink: np.ndarray  # float16 [groups, sinks, dim]
    words: np.ndarray


class RansCodec(Codec):
    id: ClassVar[str] = "kvcdn-rans-v1"
    needs_profile: ClassVar[bool] = True

    def encode(
        self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
    ) -> bytes:
        groups, sinks, sink, states, words, word_start = _code_groups(kv, params, profile,
                                                                      start)  # fmt: skip
        tokens, dim = kv.shape[3], kv.shape[4]
        return b"".join(
            (
                _PREAMBLE.pack(groups, tokens, dim, sinks),
                word_start.astype("<u4").tobytes(),
                states.astype("<u4").tobytes(),
                sink.tobytes(),
                words.astype("<u2").tobytes(),
            )
        )

    def check_payload(
        self, header: ChunkHeader, payload: memoryview, profile: CodecProfile | None, name: str
    ) -> None:
        _parts(header, payload, name, profile)

    def decode_into(
        self,
        header: ChunkHeader,
        payload: memoryview,
        dest: ChunkDest,
        profile: CodecProfile | None,
        name: str,
    ) -> None:
        from kvcdn.kernels.rans import RansError

        parts = _parts(header, payload, name, profile)
        assert profile is not None  # _parts refuses none
        layers, two, heads, tokens, dim = header.shape
        s = parts.sinks
        if s:
            dest.window(0, s).write_fp16(
                parts.sink.view(np.uint16).reshape(layers, two, heads, s, dim)
            )
        try:
            _decode_body(_Coded(parts, profile, None), dest, parts.groups, tokens, s, dim)
        except RansError as exc:
            raise FormatError(f"{name}: {exc}") from None

    def encode_sections(
        self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
    ) -> list[bytes]:
        """The streams of all groups coded at once (as :meth:`encode`), then cut into
        one section per head and layer: its K and V groups' states, sinks and words."""
        _, sinks, sink, states, words, word_start = _code_groups(kv, params, profile, start)
        layers, _, heads = kv.shape[:3]
        return pack_sections_of(sinks, states, sink, words, word_start, layers, heads)

    def check_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        _section_streams(header, sections, part, profile, name)

    def decode_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        dest: ChunkDest, profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        """The part's sections joined into one set of streams in the part's group order
        (layer, K/V, head), decoded by one kernel call as a whole object is."""
        from kvcdn.kernels.rans import RansError

        parts, gids = _section_streams(header, sections, part, profile, name)
        assert profile is not None
        lp, hp = part.layer_count, part.head_count
        tokens, dim = header.shape[3], header.shape[4]
        s = parts.sinks
        if s:
            dest.window(0, s).write_fp16(parts.sink.view(np.uint16).reshape(lp, 2, hp, s, dim))
        try:
            _decode_body(_Coded(parts, profile, gids), dest, parts.groups, tokens, s, dim)
        except RansError as exc:
            raise FormatError(f"{name}: {exc}") from None


def _code_groups(
    kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every group (layer, K/V, head) of ``kv`` quantised and rANS-coded at once, as both
    versions' payloads hold them: (groups, exact tokens S, sinks float16 [G, S, D],
    states [G, D], words, word_start [G + 1])."""
    from kvcdn.kernels import rans_numba

    if profile is None:
        raise InputError(f"level {params.get('level')} needs the model's codec profile")
    layers, two, heads, tokens, dim = kv.shape
    lay = profile.layout
    if (layers, heads, dim) != (lay.layers, lay.kv_heads, lay.head_dim):
        raise InputError("the KV does not have the shape the codec profile was calibrated for")
    groups = layers * two * heads
    sinks = max(0, min(profile.sinks - start, tokens))
    x = kv.float().numpy().reshape(groups, tokens, dim)
    states, words, word_start = rans_numba.quantise_encode(
        x[:, sinks:], *profile.quantiser(params["level"]), profile.freqs
    )
    return groups, sinks, x[:, :sinks].astype("<f2"), states, words, word_start


@dataclass(frozen=True)
class _Coded:
    """A chunk's streams of some groups, and their level's tables: the kernels' arguments."""

    parts: _Parts
    profile: CodecProfile
    gids: np.ndarray | None  # the groups' ids in the whole chunk (None: all)

    def tables(self) -> tuple[np.ndarray, ...]:
        """(lut, table_id, scale, offset) of these groups."""
        dequant = self.profile.dequant(self.parts.level)
        tid, scale, offset = dequant if self.gids is None else (a[self.gids] for a in dequant)
        return self.profile.decode_tables(), tid, scale, offset

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arguments of the CPU kernels."""
        return (self.parts.words, self.parts.word_start, self.parts.states, *self.tables())

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The arguments of the Triton kernel, on ``device``: the streams copied there,
        the tables kept there by the profile."""
        from kvcdn.kernels import rans_triton

        groups = None if self.gids is None else self.gids.tobytes()
        lut = device_decode_tables(self.profile, device)
        tables = self.profile.derived(("rans-triton", self.parts.level, groups, str(device)),
                                      lambda: rans_triton.tables_to_device(
                                          lut, *self.tables()[1:], device))  # fmt: skip
        p = self.parts
        return (*rans_triton.streams_to_device(p.words, p.word_start, p.states, device), *tables)


def _decode_body(
    coded: _Coded, dest: ChunkDest, groups: int, tokens: int, s: int, dim: int
) -> None:
    """The coded tokens ``s ..`` into ``dest``, by the kernel that writes it straight:
    into paged blocks, a CUDA tensor (Triton), a float32 CPU tensor; otherwise decoded
    on the CPU and copied."""
    import torch

    from kvcdn.kernels import rans_numba

    if isinstance(dest, BlocksDest):
        rans_numba.decode_permuted(*coded.arrays(), tokens - s, dest.blocks.after(s))
        return
    assert isinstance(dest, TensorDest)
    try:
        body = dest.tensor.view(groups, tokens, dim)[:, s:]
    except RuntimeError:  # its groups are not one dimension (some heads of a wider
        # tensor): decoded beside it, then copied into it
        t = dest.tensor
        staged = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        _decode_body(coded, TensorDest(staged), groups, tokens, s, dim)
        dest.window(s, tokens).write(staged[:, :, :, s:])
        return
    if body.device.type == "cuda" and triton_available():
        from kvcdn.kernels import rans_triton

        rans_triton.decode(*coded.on_device(body.device), body)
    elif body.dtype == torch.float32 and body.device.type == "cpu":
        rans_numba.decode(*coded.arrays(), body.numpy())
    else:  # another dtype, or CUDA without Triton: decoded here, then cast into it
        tmp = np.empty((groups, tokens - s, dim), dtype=np.float32)
        rans_numba.decode(*coded.arrays(), tmp)
        window = dest.window(s, tokens)
        window.write(torch.from_numpy(tmp).view(window.tensor.shape))


def _check_level(header: ChunkHeader, name: str, profile: CodecProfile | None) -> str:
    """The header's level, once the header agrees with the codec profile."""
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
    return level


def _section_streams(
    header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
    profile: CodecProfile | None, name: str,
) -> tuple[_Parts, np.ndarray]:  # fmt: skip
    """The streams of ``part``'s groups (layer, K/V, head) from its sections, every
    length checked before it is used, and the groups' ids in the whole chunk."""
    level = _check_level(header, name, profile)
    ids = _section_ids(sections, part, header, name)
    layers, _, heads, tokens, dim = header.shape
    parsed: dict[int, tuple[np.ndarray, ...]] = {}
    sinks = None
    for i in ids:
        parsed[i] = parse_section(sections[i], i, dim, tokens, dim, name)
        if sinks is None:
            sinks = parsed[i][0]
        if parsed[i][0] != sinks:
            raise FormatError(f"{name}: section {i} keeps {parsed[i][0]} exact tokens, "
                              f"not {sinks}")  # fmt: skip
    assert sinks is not None  # a part holds at least one section
    order = [(lay, kv, h) for lay in range(*part.layers) for kv in (0, 1)
             for h in range(*part.heads)]  # fmt: skip
    picked = [(parsed[h * layers + lay][1:], kv) for lay, kv, h in order]
    states = np.stack([p[0][kv] for p, kv in picked])
    if np.any(states < (1 << 16)):
        raise FormatError(f"{name}: a stream state is out of range")
    counts = np.array([len(p[2 + kv]) for p, kv in picked], dtype=np.int64)
    word_start = np.zeros(len(picked) + 1, dtype=np.int64)
    np.cumsum(counts, out=word_start[1:])
    words = np.concatenate([p[2 + kv] for p, kv in picked])
    if sinks:
        sink = np.stack([p[1][kv] for p, kv in picked])
    else:
        sink = np.empty((len(picked), 0, dim), dtype="<f2")
    gids = np.array([(lay * 2 + kv) * heads + h for lay, kv, h in order], dtype=np.int64)
    return _Parts(level, len(picked), sinks, word_start, states, sink, words), gids


def pack_sections_of(sinks: int, states: np.ndarray, sink: np.ndarray, words: np.ndarray,
                     word_start: np.ndarray, layers: int, heads: int) -> list[bytes]:  # fmt: skip
    """Every group's streams (groups ``[L, 2, H]`` in that order) as version-2 sections,
    one per head and layer, head-major: :func:`pack_section` of each."""
    return [pack_section(sinks, states, sink, words, word_start, (layer * 2) * heads + h,
                         (layer * 2 + 1) * heads + h)
            for h in range(heads) for layer in range(layers)]  # fmt: skip


def pack_section(sinks: int, states: np.ndarray, sink: np.ndarray, words: np.ndarray,
                 word_start: np.ndarray, k: int, v: int) -> bytes:  # fmt: skip
    """The version-2 section of groups ``k`` (keys) and ``v`` (values) of one head and
    layer: u32 S, u32 words of K, u32 words of V; u32 states[2][lanes]; f16 sinks[2][S][D];
    u16 words (K's, then V's). ``states [G, lanes]``, ``sink [G, S, D]``, ``words`` and
    ``word_start [G + 1]`` are every group's (the nested codec's tiers use it too)."""
    ks, ke, vs, ve = (int(word_start[g + e]) for g in (k, v) for e in (0, 1))
    words = words.astype("<u2", copy=False)
    return b"".join((
        SECTION_COUNTS.pack(sinks, ke - ks, ve - vs),
        states[[k, v]].astype("<u4").tobytes(), sink[[k, v]].astype("<f2").tobytes(),
        words[ks:ke].tobytes(), words[vs:ve].tobytes(),
    ))  # fmt: skip


def parse_section(
    raw: memoryview, i: int, lanes: int, tokens: int, dim: int, name: str
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pack_section` read back, every length checked before it is used: (S,
    states ``[2, lanes]``, sinks ``[2, S, D]``, K's words, V's words)."""
    if len(raw) < SECTION_COUNTS.size:
        raise FormatError(f"{name}: section {i} is truncated")
    s, nk, nv = SECTION_COUNTS.unpack_from(raw, 0)
    if s > tokens:
        raise FormatError(f"{name}: section {i} keeps {s} exact tokens of {tokens}")
    if max(nk, nv) > (tokens - s) * dim:
        raise FormatError(f"{name}: a stream of section {i} is longer than its symbols allow")
    off = SECTION_COUNTS.size
    expected = off + 8 * lanes + 4 * s * dim + 2 * (nk + nv)
    if len(raw) != expected:
        raise FormatError(f"{name}: section {i} is {len(raw)} bytes, its counts say {expected}")
    states = np.frombuffer(raw, dtype="<u4", count=2 * lanes, offset=off).reshape(2, lanes)
    off += 8 * lanes
    sink = np.frombuffer(raw, dtype="<f2", count=2 * s * dim, offset=off).reshape(2, s, dim)
    off += 4 * s * dim
    words = np.frombuffer(raw, dtype="<u2", count=nk + nv, offset=off)
    return s, states, sink, words[:nk], words[nk:]


def _parts(
    header: ChunkHeader, payload: memoryview, name: str, profile: CodecProfile | None
) -> _Parts:
    level = _check_level(header, name, profile)
    layers, two, heads, tokens, dim = header.shape
    groups = layers * two * heads
    if len(payload) < _PREAMBLE.size:
        raise FormatError(f"{name}: payload is truncated")
    g, t, d, s = _PREAMBLE.unpack_from(payload, 0)
    if (g, t, d) != (groups, tokens, dim) or s > tokens:
        raise FormatError(f"{name}: payload dimensions {g, t, d, s} contradict the header")
    off = _PREAMBLE.size
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
    return _Parts(level, groups, s, word_start, states, sink.reshape(groups, s, dim), words)


def device_decode_tables(profile: CodecProfile, device: torch.device) -> torch.Tensor:
    """The profile's decode tables on ``device``, one copy there for every level and
    part decoded there (they are 6 MB)."""
    from kvcdn.kernels import rans_triton

    return profile.derived(("decode-tables", str(device)), lambda: rans_triton.array_to_device(
        profile.decode_tables(), np.uint32, device, np.int32))  # fmt: skip


def triton_available() -> bool:
    """Whether the Triton decoder can run here (Triton installed, a CUDA device)."""
    try:
        from kvcdn.kernels import rans_triton
    except ImportError:
        return False
    return rans_triton.available()
