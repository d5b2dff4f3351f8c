"""``kvcdn-nested-v1``: the nested ladder, one object per chunk for every level.

The object holds tiers (a base and its refinements, :mod:`kvcdn.progressive`); the
level named ``tiers[k]`` is tiers ``0..k``, read as the first ``k + 1`` tiers of the
object's sections (version-2 container, tier-major). Each section, one tier of one
KV head of one layer (its K group, then its V group), is (little-endian, specified in
docs/format.md)::

    u32 S, u32 words of K, u32 words of V   exact tokens (tier 0 only; else 0)
    u32 states[2][STATES]                   each group's rANS states at its start
    f16 sinks[2][S][D]                      the first S tokens, exact (tier 0 only)
    u16 words                               K's words, then V's

The kernels are :mod:`kvcdn.kernels.nested`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvcdn.errors import FormatError, InputError

from . import Codec
from .dest import ChunkDest
from .rans import pack_section, parse_section

if TYPE_CHECKING:
    import torch

    from kvcdn.codec_profile import CodecProfile
    from kvcdn.container import ChunkHeader, Part

#: What a nested object's header names as its level: the object holds all of them (the
#: same word begins its keys' level id, which an edge checks against the header).
OBJECT_LEVEL = "nested"


class NestedCodec(Codec):
    id: ClassVar[str] = "kvcdn-nested-v1"
    needs_profile: ClassVar[bool] = True

    def object_level(self, level: str, params: dict[str, Any]) -> str:
        return OBJECT_LEVEL

    def tiers_for(self, level: str, params: dict[str, Any]) -> int | None:
        tiers = params.get("tiers")
        if not isinstance(tiers, list) or level not in tiers:
            raise InputError(f"level {level} is not a tier of this nested ladder")
        return tiers.index(level) + 1

    # ---- version 1: not written, not read ----------------------------------------
    def encode(self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None,
               start: int) -> bytes:  # fmt: skip
        raise InputError("nested levels are written as sectioned (version 2) objects only")

    def check_payload(self, header: ChunkHeader, payload: memoryview,
                      profile: CodecProfile | None, name: str) -> None:  # fmt: skip
        raise FormatError(f"{name}: a nested object must be sectioned (format version 2)")

    def decode_into(self, header: ChunkHeader, payload: memoryview, dest: ChunkDest,
                    profile: CodecProfile | None, name: str) -> None:  # fmt: skip
        raise FormatError(f"{name}: a nested object must be sectioned (format version 2)")

    # ---- version 2 ---------------------------------------------------------------
    def encode_sections(
        self, kv: torch.Tensor, params: dict[str, Any], profile: CodecProfile | None, start: int
    ) -> list[bytes]:
        from kvcdn.kernels import nested

        spec = _spec(profile, params, "the nested levels")
        assert profile is not None
        layers, two, heads, tokens, dim = kv.shape
        lay = profile.layout
        if (layers, heads, dim) != (lay.layers, lay.kv_heads, lay.head_dim):
            raise InputError("the KV does not have the shape the codec profile was calibrated for")
        groups = layers * two * heads
        sinks = max(0, min(profile.sinks - start, tokens))
        x = kv.float().numpy().reshape(groups, tokens, dim)
        mean, fine, depth, lo, size, base, refine = profile.nested_arrays()
        states, words, word_start = nested.encode(x[:, sinks:], mean, fine, depth, lo, size,
                                                  base, refine, profile.freqs)  # fmt: skip
        sink = x[:, :sinks].astype("<f2")
        out = []
        for r in range(len(spec.tiers)):
            s = sinks if r == 0 else 0  # the exact tokens are the base's
            for h in range(heads):
                for layer in range(layers):
                    k, v = (layer * 2) * heads + h, (layer * 2 + 1) * heads + h
                    out.append(pack_section(s, states[r], sink[:, :s], words[r],
                                            word_start[r], k, v))  # fmt: skip
        return out

    def check_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        _streams(header, sections, part, profile, name)

    def decode_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        dest: ChunkDest, profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        import torch

        from kvcdn.kernels import nested
        from kvcdn.kernels.rans import RansError

        st = _streams(header, sections, part, profile, name)
        assert profile is not None
        lp, hp = part.layer_count, part.head_count
        tokens, dim = header.shape[3], header.shape[4]
        staged = np.empty((lp * 2 * hp, tokens, dim), dtype=np.float32)
        s = st.sinks
        staged[:, :s] = st.sink.astype(np.float32)
        mean, fine, depth, lo, _, base, refine = (a[..., st.gids, :] for a in
                                                  profile.nested_arrays())  # fmt: skip
        try:
            nested.decode(st.k, st.words, st.word_start, st.states, profile.decode_tables(),
                          mean, fine, depth, lo, base, refine, staged[:, s:])  # fmt: skip
        except RansError as exc:
            raise FormatError(f"{name}: {exc}") from None
        dest.write(torch.from_numpy(staged).view(lp, 2, hp, tokens, dim))


@dataclass(frozen=True)
class _Streams:
    """The streams of a part's groups (layer, K/V, head) for tiers ``0..k``."""

    k: int
    sinks: int
    sink: np.ndarray  # float16 [groups, sinks, dim]
    states: np.ndarray  # [k + 1, groups, STATES]
    words: list[np.ndarray]  # per tier
    word_start: np.ndarray  # [k + 1, groups + 1]
    gids: np.ndarray  # the groups' ids in the whole chunk


def _spec(profile: CodecProfile | None, params: dict[str, Any], what: str) -> Any:
    if profile is None or profile.nested is None:
        raise InputError(f"{what} need a codec profile with a nested ladder")
    if params.get("profile") != profile.sha256 or params.get("tiers") != list(
        profile.nested.tiers
    ):
        raise InputError(f"{what} were named for another codec profile than the one given")
    return profile.nested


def _streams(
    header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
    profile: CodecProfile | None, name: str,
) -> _Streams:  # fmt: skip
    """Every length of the part's sections checked against the header and the profile,
    then their streams in the part's group order."""
    from kvcdn.kernels.nested import STATES

    if profile is None or profile.nested is None:
        raise FormatError(f"{name} needs a codec profile with a nested ladder to decode")
    spec = profile.nested
    if header.params.get("profile") != profile.sha256:
        raise FormatError(f"{name} was encoded with another codec profile than the one given")
    if header.params.get("tiers") != list(spec.tiers) or header.level != OBJECT_LEVEL:
        raise FormatError(f"{name}: its tiers are not the codec profile's nested ladder")
    layers, two, heads, tokens, dim = header.shape
    lay = profile.layout
    if (layers, heads, dim) != (lay.layers, lay.kv_heads, lay.head_dim):
        raise FormatError(f"{name}: shape {list(header.shape)} does not fit the codec profile")
    tiers = len(spec.tiers)
    count = part.tier_count(tiers)
    if not part.fits(header.shape) or not 1 <= count <= tiers:
        raise FormatError(f"{name}: part {part} is not within this object")
    ids = part.section_ids(layers, heads, tiers)
    if any(i not in sections for i in ids):
        raise FormatError(f"{name}: a section of {part} was not read")
    order = [(lay_, kv, h) for lay_ in range(*part.layers) for kv in (0, 1)
             for h in range(*part.heads)]  # fmt: skip
    per_tier = layers * heads
    sinks = None
    sink_parts: dict[int, np.ndarray] = {}
    states = np.empty((count, len(order), STATES), dtype=np.uint32)
    words: list[np.ndarray] = []
    word_start = np.zeros((count, len(order) + 1), dtype=np.int64)
    for r in range(count):
        parsed: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for h in range(*part.heads):
            for layer in range(*part.layers):
                i = r * per_tier + h * layers + layer
                s, st, sink, wk, wv = parse_section(sections[i], i, STATES, tokens, dim, name)
                if r == 0 and sinks is None:
                    sinks = s
                if s != (sinks if r == 0 else 0):
                    raise FormatError(f"{name}: section {i} keeps {s} exact tokens")
                if max(len(wk), len(wv)) > (tokens - (sinks or 0)) * dim:
                    raise FormatError(f"{name}: a stream of section {i} is longer than its "
                                      "symbols allow")  # fmt: skip
                if s:
                    sink_parts[h * layers + layer] = sink
                parsed[h * layers + layer] = (st, wk, wv)
        picked = [(parsed[h * layers + lay_], kv) for lay_, kv, h in order]
        states[r] = np.stack([p[0][kv] for p, kv in picked])
        counts = np.array([len(p[1 + kv]) for p, kv in picked], dtype=np.int64)
        np.cumsum(counts, out=word_start[r, 1:])
        words.append(np.concatenate([p[1 + kv] for p, kv in picked]))
    if np.any(states < (1 << 16)):
        raise FormatError(f"{name}: a stream state is out of range")
    sinks = sinks or 0
    if sinks:
        sink = np.stack([sink_parts[h * layers + lay_][kv] for lay_, kv, h in order])
    else:
        sink = np.empty((len(order), 0, dim), dtype="<f2")
    gids = np.array([(lay_ * 2 + kv) * heads + h for lay_, kv, h in order], dtype=np.int64)
    return _Streams(count - 1, sinks, sink, states, words, word_start, gids)
