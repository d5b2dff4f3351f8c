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

The kernels are :mod:`kvcdn.kernels.nested`. ``kvcdn-nested-klt-v1``
(:class:`NestedKltCodec`) is the same object for a profile with a transform: its
streams are each head's coefficients (:mod:`kvcdn.kernels.transform`), and its header
also gives the chunk's first position.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvcdn.container import MAX_TIERS
from kvcdn.errors import FormatError, InputError

from . import Codec
from .dest import ChunkDest, TensorDest
from .rans import device_decode_tables, pack_sections_of, triton_available

if TYPE_CHECKING:
    import torch

    from kvcdn.codec_profile import CodecProfile, NestedTransform
    from kvcdn.container import ChunkHeader, Part
    from kvcdn.kernels.nested_simd import BlockSetup, VectorTables

#: What a nested object's header names as its level: the object holds all of them (the
#: same word begins its keys' level id, which an edge checks against the header).
OBJECT_LEVEL = "nested"


class NestedCodec(Codec):
    id: ClassVar[str] = "kvcdn-nested-v1"
    needs_profile: ClassVar[bool] = True
    #: Whether the streams are a transform's coefficients (:class:`NestedKltCodec`).
    transformed: ClassVar[bool] = False

    def object_level(self, level: str, params: dict[str, Any]) -> str:
        return OBJECT_LEVEL

    def tiers_for(self, level: str, params: dict[str, Any]) -> int | None:
        tiers = params.get("tiers")
        if not isinstance(tiers, list) or level not in tiers:
            raise InputError(f"level {level} is not a tier of this nested ladder")
        return tiers.index(level) + 1

    def object_tiers(self, header: ChunkHeader, name: str) -> int:
        tiers = header.params.get("tiers")
        if (not isinstance(tiers, list) or not 1 <= len(tiers) <= MAX_TIERS
                or not all(isinstance(t, str) for t in tiers)):  # fmt: skip
            raise FormatError(f"{name}: its header's tiers {tiers!r} are not a nested ladder's")
        return len(tiers)

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

        spec = _spec(profile, params, "the nested levels", self.transformed)
        assert profile is not None
        layers, two, heads, tokens, dim = kv.shape
        lay = profile.layout
        if (layers, heads, dim) != (lay.layers, lay.kv_heads, lay.head_dim):
            raise InputError("the KV does not have the shape the codec profile was calibrated for")
        groups = layers * two * heads
        sinks = max(0, min(profile.sinks - start, tokens))
        x = kv.float().numpy().reshape(groups, tokens, dim)
        body = x[:, sinks:]
        if spec.transform is not None:  # coefficients are coded, not channels
            body = spec.transform.coefficients(body, np.arange(groups), heads, start + sinks)
        mean, fine, depth, lo, size, base, refine, stride = profile.nested_arrays()
        states, words, word_start = nested.encode(body, mean, fine, depth, lo, size, base,
                                                  refine, stride, profile.freqs)  # fmt: skip
        sink = x[:, :sinks].astype("<f2")
        out = []
        for r in range(len(spec.tiers)):
            s = sinks if r == 0 else 0  # the exact tokens are the base's
            out += pack_sections_of(s, states[r], sink[:, :s], words[r], word_start[r],
                                    layers, heads)  # fmt: skip
        return out

    def check_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        _streams(header, sections, part, profile, name, self.transformed)

    def decode_sections(
        self, header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
        dest: ChunkDest, profile: CodecProfile | None, name: str,
    ) -> None:  # fmt: skip
        import torch

        from kvcdn.kernels import nested, simd
        from kvcdn.kernels.rans import RansError

        st = _streams(header, sections, part, profile, name, self.transformed)
        assert profile is not None
        transform = profile.nested.transform if profile.nested is not None else None
        lp, hp = part.layer_count, part.head_count
        tokens, dim = header.shape[3], header.shape[4]
        groups, s = lp * 2 * hp, st.sinks
        if s:
            dest.window(0, s).write_fp16(st.sink.view(np.uint16).reshape(lp, 2, hp, s, dim))
        g = st.gids
        if g[-1] - g[0] + 1 == len(g):  # consecutive (all heads): views, not copies
            g = slice(int(g[0]), int(g[-1]) + 1)
        *arrays, stride = profile.nested_arrays()
        mean, fine, depth, lo, _, base, refine = (a[..., g, :] for a in arrays)
        tables = (profile.decode_tables(), profile.table_starts(), mean, fine, depth, lo, base,
                  refine, stride)  # fmt: skip
        on_gpu = isinstance(dest, TensorDest) and dest.tensor.device.type == "cuda"
        if on_gpu and triton_available() and (transform is None or transform_gpu(dim)):
            from kvcdn.kernels import nested_triton

            assert isinstance(dest, TensorDest)
            t = dest.tensor
            if transform is not None:  # the coefficients, float32, apart from the values
                whole = torch.empty((groups, tokens, dim), dtype=torch.float32, device=t.device)
            else:  # the tensor itself where its groups are one dimension, else staged there
                try:
                    whole = t.view(groups, tokens, dim)
                except RuntimeError:
                    whole = torch.empty((groups, tokens, dim), dtype=t.dtype, device=t.device)
            # the tables stay on the device, with the profile, for the next chunk
            key = ("nested-triton", st.k, st.gids.tobytes(), str(t.device))
            lut = device_decode_tables(profile, t.device)  # one copy for every key
            on_device = profile.derived(key, lambda: nested_triton.tables(
                st.k, lut, *tables[1:], t.device))  # fmt: skip
            try:
                nested_triton.decode_with(on_device, st.words, st.wbeg, st.wend, st.states,
                                          whole[:, s:])  # fmt: skip
            except RansError as exc:
                raise FormatError(f"{name}: {exc}") from None
            if transform is not None:
                values = _values_on_device(profile, transform, st, header.shape[2],
                                           whole[:, s:])  # fmt: skip
                dest.window(s, tokens).write(values.view(lp, 2, hp, tokens - s, dim))
            elif whole.data_ptr() != t.data_ptr():
                dest.window(s, tokens).write(whole.view(lp, 2, hp, tokens, dim)[:, :, :, s:])
            return
        body = dest.float32_array() if isinstance(dest, TensorDest) else None
        staged = np.empty((groups, tokens, dim), dtype=np.float32) if body is None else body
        try:
            nested.decode(st.k, st.words, st.wbeg, st.wend, st.states, *tables, staged[:, s:],
                          vector_tables=_vector_tables(profile),
                          block_setup=_block_setup(profile, st, tables) if simd.AVAILABLE
                          else None)  # fmt: skip
        except RansError as exc:
            raise FormatError(f"{name}: {exc}") from None
        if transform is not None:  # the coefficients' values, in place
            transform.values_into(staged[:, s:], st.gids, header.shape[2], st.start + s,
                                  staged[:, s:])  # fmt: skip
        if body is None:
            view = torch.from_numpy(staged).view(lp, 2, hp, tokens, dim)
            dest.window(s, tokens).write(view[:, :, :, s:])


def _vector_tables(profile: CodecProfile) -> VectorTables:
    """The CPU vector kernel's form of the profile's base tables, made once per profile
    (16 ms on a 2-CPU EPYC Zen 4; 58 ms the first time in a process)."""
    from kvcdn.kernels import nested_simd

    _, _, _, _, _, base, _, stride = profile.nested_arrays()
    return profile.derived("nested-simd-tables", lambda: nested_simd.vector_tables(
        profile.decode_tables(), profile.table_starts(), base, stride))  # fmt: skip


def _block_setup(profile: CodecProfile, st: _Streams, tables: tuple) -> BlockSetup:
    """How the CPU vector kernel's blocks take a part's groups, and what each block starts
    from: made once per profile, tiers and part (the plan 1-2 ms for the embedded model's
    180 groups; the setup took 0.4 ms of every ``nearlossless`` chunk)."""
    from kvcdn.kernels import nested_simd

    _, cum, mean, fine, depth, lo, base, refine, stride = tables

    def make() -> BlockSetup:
        plan = nested_simd.plan_blocks(st.k, depth)
        return nested_simd.block_setup(plan, st.k, depth, lo, base, refine, cum, mean, fine,
                                       stride, _vector_tables(profile))  # fmt: skip

    return profile.derived(("nested-simd-setup", st.k, st.gids.tobytes()), make)


def transform_gpu(dim: int) -> bool:
    """Whether the Triton inverse of the transform takes heads of ``dim`` channels (else
    a transformed ladder's GPU destination is decoded on the CPU and copied)."""
    from kvcdn.kernels import transform_triton

    return transform_triton.supports(dim)


def _values_on_device(profile: CodecProfile, transform: NestedTransform, st: _Streams,
                      heads: int, coefficients: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The values (float32, a new tensor) of a part's decoded coefficients on the device,
    with the part's matrices kept there with the profile."""
    import torch

    from kvcdn.kernels import transform_triton

    dev = coefficients.device
    key = ("nested-transform", st.gids.tobytes(), str(dev))
    mt, rotate = profile.derived(key, lambda: (
        torch.from_numpy(np.ascontiguousarray(transform.transposed()[st.gids])).to(dev),
        torch.from_numpy(transform.rotate(st.gids, heads).astype(np.int32)).to(dev)))  # fmt: skip
    # the host's tables are kept read-only: copied to the device, never shared
    cos, sin = (torch.tensor(t, device=dev)
                for t in transform.rope_tables(st.start + st.sinks, coefficients.shape[1]))
    values = torch.empty_like(coefficients)
    transform_triton.synthesise(coefficients, mt, rotate, cos, sin, values)
    return values


@dataclass(frozen=True)
class _Streams:
    """The streams of a part's groups (layer, K/V, head) for tiers ``0..k``, as views of
    one buffer of the part's sections."""

    k: int
    sinks: int
    sink: np.ndarray  # float16 [groups, sinks, dim]
    states: np.ndarray  # [k + 1, groups, STATES]
    words: np.ndarray  # uint16: every section, in tier order (plus four padding words)
    wbeg: np.ndarray  # [k + 1, groups]: where each group's stream of each tier begins
    wend: np.ndarray  # [k + 1, groups]: and ends
    gids: np.ndarray  # the groups' ids in the whole chunk
    start: int  # the chunk's first token's position (transformed ladders; else 0)


class NestedKltCodec(NestedCodec):
    """``kvcdn-nested-klt-v1``: the nested ladder of a profile with a transform
    (:class:`~kvcdn.codec_profile.NestedTransform`): each head's streams are
    coefficients, and the header's params also give the chunk's first position
    (``start``), where the keys' rotary embedding was taken back. Its own id, so that
    a reader that does not know the transform refuses the object rather than decode
    coefficients as channels."""

    id: ClassVar[str] = "kvcdn-nested-klt-v1"
    transformed: ClassVar[bool] = True

    def object_params(self, params: dict[str, Any], start: int) -> dict[str, Any]:
        return {**params, "start": int(start)}


#: A chunk's first position, at most (a transformed object's ``start``).
MAX_START = 1 << 31
#: The keys of a nested object's header params, exactly (``docs/format.md``).
_PARAMS = frozenset({"profile", "tiers"})
_KLT_PARAMS = _PARAMS | {"start"}


def _spec(profile: CodecProfile | None, params: dict[str, Any], what: str,
          transformed: bool) -> Any:  # fmt: skip
    if profile is None or profile.nested is None:
        raise InputError(f"{what} need a codec profile with a nested ladder")
    if (profile.nested.transform is not None) != transformed:
        raise InputError(f"{what} were named for a codec the codec profile does not use")
    if params.get("profile") != profile.sha256 or params.get("tiers") != list(
        profile.nested.tiers
    ):
        raise InputError(f"{what} were named for another codec profile than the one given")
    return profile.nested


def _streams(
    header: ChunkHeader, sections: Mapping[int, memoryview], part: Part,
    profile: CodecProfile | None, name: str, transformed: bool,
) -> _Streams:  # fmt: skip
    """Every length of the part's sections checked against the header and the profile
    (all sections at once: a part of a 70B chunk has thousands), then their streams
    in the part's group order, as offsets into one copy of the sections."""
    from kvcdn.kernels.nested import STATES

    if profile is None or profile.nested is None:
        raise FormatError(f"{name} needs a codec profile with a nested ladder to decode")
    spec = profile.nested
    if header.params.get("profile") != profile.sha256:
        raise FormatError(f"{name} was encoded with another codec profile than the one given")
    if header.params.get("tiers") != list(spec.tiers) or header.level != OBJECT_LEVEL:
        raise FormatError(f"{name}: its tiers are not the codec profile's nested ladder")
    if (spec.transform is not None) != transformed:
        raise FormatError(f"{name}: its codec {header.codec} is not the codec profile's")
    start = header.params.get("start") if transformed else 0
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < MAX_START:
        raise FormatError(f"{name}: its first position {start!r} is not one")
    if set(header.params) != (_KLT_PARAMS if transformed else _PARAMS):
        raise FormatError(f"{name}: its header's params are not {header.codec}'s")
    layers, two, heads, tokens, dim = header.shape
    lay = profile.layout
    if (layers, heads, dim) != (lay.layers, lay.kv_heads, lay.head_dim):
        raise FormatError(f"{name}: shape {list(header.shape)} does not fit the codec profile")
    tiers = len(spec.tiers)
    count = part.tier_count(tiers)
    if not part.fits(header.shape) or not 1 <= count <= tiers:
        raise FormatError(f"{name}: part {part} is not within this object")
    geometry = profile.derived(("nested-part", part, count),
                               lambda: _part_geometry(part, layers, heads, count))  # fmt: skip
    ids, sec, kv = geometry.ids, geometry.sections, geometry.kv
    try:
        raws = [sections[i] for i in ids]
    except KeyError:
        raise FormatError(f"{name}: a section of {part} was not read") from None
    head_size = 3 * 4 + 8 * STATES
    lengths = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
    if int(lengths.min()) < head_size:
        raise FormatError(f"{name}: a section of {part} is truncated")
    if np.any(lengths & 1):  # every well-formed length is even: its words are whole
        bad = ids[int(np.flatnonzero(lengths & 1)[0])]
        raise FormatError(f"{name}: section {bad}'s length is odd (its words are 16-bit)")
    # four padding words, so that a read clamped to an empty stream at the end, and the
    # vector decoder's four-word reads, stay inside
    words = np.frombuffer(b"".join([*raws, bytes(8)]), dtype="<u2")
    first = np.zeros(len(raws), dtype=np.int64)  # each section's first word
    np.cumsum(lengths[:-1] // 2, out=first[1:])
    # each section's three counts (u32: kept tokens, K's words, V's words), read from
    # the words in one gather rather than a struct unpack a section
    at = first[:, None] + 2 * np.arange(3)
    counts = words[at].astype(np.int64) | (words[at + 1].astype(np.int64) << 16)
    per_tier = len(ids) // count
    kept, nk, nv = counts.T
    sinks = int(kept[0])
    if sinks > tokens or np.any(kept[:per_tier] != sinks) or np.any(kept[per_tier:] != 0):
        raise FormatError(f"{name}: its sections disagree on the exact tokens they keep")
    # S as format.md gives it: of a transformed object, from its first position, so that
    # a part's sections (which may not hold the chunk's other heads) keep what the whole
    # object's do; of another (its header has no position), at most the profile's
    given = max(0, min(profile.sinks - start, tokens))
    if (sinks != given) if transformed else (sinks > profile.sinks):
        raise FormatError(f"{name}: it keeps {sinks} exact tokens, which its position does "
                          "not give")  # fmt: skip
    if max(int(nk.max()), int(nv.max())) > (tokens - sinks) * dim:
        raise FormatError(f"{name}: a stream of {part} is longer than its symbols allow")
    body = head_size + 4 * kept * dim
    if np.any(lengths != body + 2 * (nk + nv)):
        bad = ids[int(np.flatnonzero(lengths != body + 2 * (nk + nv))[0])]
        raise FormatError(f"{name}: section {bad}'s length is not what its counts say")
    wbeg = first[sec] + body[sec] // 2 + kv * nk[sec]
    wend = wbeg + np.where(kv == 1, nv[sec], nk[sec])
    at = first[sec][..., None] + 6 + 2 * STATES * kv[:, None] + 2 * np.arange(STATES)
    states = words[at].astype(np.uint32) | (words[at + 1].astype(np.uint32) << 16)
    if np.any(states < (1 << 16)):
        raise FormatError(f"{name}: a stream state is out of range")
    sink_at = first[sec[0]] + head_size // 2 + kv * sinks * dim
    sink = words[sink_at[:, None] + np.arange(sinks * dim)].view("<f2")
    sink = sink.reshape(len(geometry.gids), sinks, dim)
    return _Streams(count - 1, sinks, sink, states, words, wbeg, wend, geometry.gids, start)


@dataclass(frozen=True, eq=False)
class _PartGeometry:
    """Where a part's streams lie among its sections, the same for every chunk of one
    shape: read-only arrays, shared by every decode."""

    ids: tuple[int, ...]  # the part's sections in table order: tier, then head, then layer
    sections: np.ndarray  # [tiers, groups]: each group's (layer, K/V, head) in ``ids``
    kv: np.ndarray  # [groups]: 0 for K, 1 for V
    gids: np.ndarray  # [groups]: the groups' ids in the whole chunk


def _part_geometry(part: Part, layers: int, heads: int, tiers: int) -> _PartGeometry:
    """The :class:`_PartGeometry` of ``part`` (its first ``tiers`` tiers) of a chunk of
    ``layers`` layers and ``heads`` KV heads, which the codec keeps with the profile
    (made for every chunk, it took a fifth of a ``nearlossless`` chunk's checks)."""
    lp, hp = part.layer_count, part.head_count
    layer, kv, head = (a.ravel() for a in np.meshgrid(np.arange(lp), np.arange(2),
                                                      np.arange(hp), indexing="ij"))  # fmt: skip
    sections = np.arange(tiers)[:, None] * (lp * hp) + head * lp + layer
    gids = ((part.layers[0] + layer) * 2 + kv) * heads + part.heads[0] + head
    arrays = (sections, kv, gids.astype(np.int64))
    for a in arrays:
        a.flags.writeable = False
    return _PartGeometry(tuple(part.section_ids(layers, heads, tiers)), *arrays)
