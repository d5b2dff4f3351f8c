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
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .codec_profile import LADDER, CodecProfile
from .codecs import ChunkDest, TensorDest, codec_for, known_codec, nested, rans
from .container import (
    FORMAT_VERSION,
    Body,
    ChunkHeader,
    ChunkIndex,
    Part,
    pack,
    pack_sections,
    parse_index,
    unpack,
)
from .errors import FormatError, InputError
from .keys import tiered_object_id
from .manifest import TEXT_LEVEL, IndexRef, ObjectRef, ObjectSpan, TierRef

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

    @property
    def tiers(self) -> int | None:
        """How many tiers of the chunk's object this level reads (None: all of an object
        of its own)."""
        return codec_for(self.codec, f"level {self.name}").tiers_for(self.name, self.params)

    @property
    def object_id(self) -> str:
        """What names the level's objects in store keys: its id, or for the tiers of a
        nested ladder one id shared by all of them (one object per chunk)."""
        return self.id if self.tiers is None else tiered_object_id(self.id)


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
#: In a list of levels to publish: every tier of the profile's nested ladder, one object
#: a chunk for all of them (``minimal``, then the ladder's levels by name).
NESTED = "nested"
ALL_LEVEL_NAMES = (*LADDER, *FIXED_LEVELS, NESTED, TEXT_LEVEL)
DEFAULT_LEVELS = tuple(LADDER)


def ladder_level(name: str, profile: CodecProfile) -> Level:
    quality = profile.levels[name].quality
    return Level(
        name,
        rans.RansCodec.id,
        {"profile": profile.sha256, "level": name},
        f"calibrated to KL {LADDER[name]:g} (measured {quality.get('kl', float('nan')):.4f})",
    )


def nested_level(name: str, profile: CodecProfile) -> Level:
    """Tier ``name`` of the profile's nested ladder, as a level."""
    spec = profile.nested
    if spec is None or name not in spec.tiers:
        raise InputError(f"the codec profile has no nested tier {name}")
    quality = spec.quality.get(name, {})
    target = f"calibrated to KL {LADDER[name]:g}" if name in LADDER else "the nested base"
    codec = nested.NestedCodec if spec.transform is None else nested.NestedKltCodec
    return Level(
        name,
        codec.id,
        {"profile": profile.sha256, "tiers": list(spec.tiers)},
        f"{target}, nested (measured {quality.get('kl', float('nan')):.4f})",
    )


def tier_bytes(data: bytes, tiers: int) -> int:
    """Bytes a reader of the first ``tiers`` tiers of the object ``data`` fetches: its
    index and those tiers' sections."""
    from .container import parse_index

    index = parse_index(data, verify_digest=False)
    per_tier = len(index.lengths) // index.tiers
    return index.size + sum(index.lengths[: tiers * per_tier])


def parse_levels(
    spec: str | list[str] | tuple[str, ...], profile: CodecProfile | None = None
) -> list[Level]:
    """``"default,low"`` -> the levels, in the order given, without repeats.

    Ladder levels need the model's codec ``profile``; ``text`` is implied by
    every manifest and is not a stored level.
    """
    levels = []
    for n in check_level_names(spec):
        if n == NESTED:
            if profile is None or profile.nested is None:
                raise InputError("the store's codec profile has no nested ladder: run "
                                 "'kvcdn calibrate' to make one")  # fmt: skip
            levels.extend(nested_level(t, profile) for t in profile.nested.tiers)
        elif n in FIXED_LEVELS:
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
    unknown = [n for n in names if n not in LADDER and n not in FIXED_LEVELS and n != NESTED]
    if unknown:
        known = ", ".join(ALL_LEVEL_NAMES)
        raise InputError(f"unknown level(s) {', '.join(unknown)}; known: {known}")
    if NESTED in names and any(n in LADDER for n in names):
        raise InputError(f"{NESTED} holds the ladder's levels itself: it cannot be published "
                         f"beside {', '.join(n for n in names if n in LADDER)}")  # fmt: skip
    return list(dict.fromkeys(names))


def needs_profile(spec: str | list[str] | tuple[str, ...]) -> bool:
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    return any(n.strip().lower() in (*LADDER, NESTED) for n in names)


def encode_chunk(
    level: Level,
    kv: torch.Tensor,
    chunk_hash: str,
    *,
    profile: CodecProfile | None = None,
    start: int = 0,
    version: int = FORMAT_VERSION,
) -> bytes:
    """One chunk's KV ``[L, 2, H, T, D]`` -> a complete container object (of format
    ``version``: 2, in sections a reader can fetch apart; 1, one payload).

    ``start`` is the chunk's first token position in its document (the first
    ``profile.sinks`` positions are kept exact).
    """
    codec = codec_for(level.codec, f"level {level.name}")
    if codec.needs_profile and profile is None:
        raise InputError(f"level {level.name} needs the model's codec profile")
    header = ChunkHeader(level.codec, codec.object_level(level.name, level.params),
                         codec.object_params(level.params, start), tuple(kv.shape),
                         chunk_hash)  # fmt: skip
    kv = kv.detach().cpu()
    if version == 1:
        return pack(header, codec.encode(kv, level.params, profile, start))
    return pack_sections(header, codec.encode_sections(kv, level.params, profile, start))


def object_ref(key: str, data: bytes, tiers: int | None = None) -> ObjectRef:
    """The manifest's reference to the object ``data`` stored under ``key``: its size
    and sha256, for a version-2 object its index's size and digest, and for a level
    that reads its first ``tiers`` tiers, their size."""
    from .container import index_size

    sha = hashlib.sha256(data).hexdigest()
    n = index_size(data)
    index = None if n is None else IndexRef(n, bytes(data[n - 32 : n]).hex())
    tier = None if tiers is None else TierRef(tiers, tier_bytes(data, tiers))
    return ObjectRef(key, len(data), sha, index, tier)


def level_part(ref: ObjectRef, part: Part | None, layers: int, heads: int) -> Part | None:
    """What a reader holding ``part`` (None: all) reads of the object ``ref`` names: the
    part, with the tiers of the level the ref is for; None: the whole object."""
    if ref.tiers is None:
        return part
    return replace(part or Part.whole(layers, heads), tiers=ref.tiers.count)


@dataclass(frozen=True)
class PartRead:
    """Part of a version-2 object as a reader fetched it: its header and the sections of
    the part, each checked against the index its manifest records."""

    header: ChunkHeader
    body: Body
    part: Part
    nbytes: int  # bytes fetched: the index and the sections (by read_more: its sections)
    source: str  # what served the sections (an edge URL, "origin", a store's URL)
    index: ChunkIndex | None = None  # the object's checked index (what read_more reads by)
    key: str = ""  # the object's key


class IndexCache:
    """Indexes of version-2 objects, as checked against the digests manifests record:
    a reader that reads one object in several parts (a layer-ordered load reads each
    chunk once per group of layers) fetches and parses its index once.

    An entry is found only by the object's key, size and index digest together, the
    three things its check was made against, so a cached index is exactly what a
    fetch would have checked. Bounded by the indexes' bytes (least recently used
    dropped first); safe to share between threads."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, int, str], tuple[ChunkIndex, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _key(ref: ObjectRef) -> tuple[str, int, str]:
        assert ref.index is not None
        return ref.key, ref.bytes, ref.index.sha256

    def get(self, ref: ObjectRef) -> ChunkIndex | None:
        with self._lock:
            found = self._entries.get(self._key(ref))
            if found is None:
                return None
            self._entries.move_to_end(self._key(ref))
            return found[0]

    def put(self, ref: ObjectRef, index: ChunkIndex, size: int) -> None:
        """Keep ``index``, checked against ``ref`` (``size``: its bytes)."""
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(self._key(ref), None)
            self._bytes -= old[1] if old is not None else 0
            self._entries[self._key(ref)] = (index, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


def read_part(reader: Reader, ref: ObjectRef, part: Part | None, *, name: str,
              indexes: IndexCache | None = None, **fetch_options: Any) -> PartRead:  # fmt: skip
    """``part`` of the version-2 object ``ref`` names (None: all its layers and heads;
    of a nested object, the tiers of the level ``ref`` is for unless the part says):
    its index, checked against the digest ``ref`` records (or found in ``indexes``,
    where it is kept), then the byte runs holding the part's sections, each section
    checked against its sha256 in the index before it is kept. A source that serves
    bad bytes fails its check (an edge reader then tries the next)."""
    if ref.index is None:
        raise FormatError(f"{name} is a version-1 object: it is read whole")
    index = indexes.get(ref) if indexes is not None else None
    index_bytes, index_source = 0, ""
    if index is None:
        digest = ref.index.sha256

        def index_holds(data: bytes) -> None:
            parse_index(data, name=name, object_size=ref.bytes, digest=digest)

        got = reader.fetch(ObjectSpan(ref, 0, ref.index.bytes), check=index_holds,
                           **fetch_options)  # fmt: skip
        index = parse_index(got.data, name=name, object_size=ref.bytes, digest=digest,
                            verify_digest=False)  # fmt: skip
        check_object_tiers(index.header, index.tiers, name)
        index_bytes, index_source = len(got.data), got.source
        if indexes is not None:
            indexes.put(ref, index, index_bytes)
    layers, _, heads = index.header.shape[:3]
    if part is None or part.tiers is None:
        part = level_part(ref, part, layers, heads) or Part.whole(layers, heads)
    try:
        wanted = index.part_ids(part)
    except FormatError as exc:
        raise FormatError(f"{name}: {exc}") from None
    sections, nbytes, source = _read_sections(reader, ref, index, wanted, name, fetch_options)
    return PartRead(index.header, Body(2, sections=sections), part, index_bytes + nbytes,
                    source or index_source, index, ref.key)  # fmt: skip


def read_more(reader: Reader, ref: ObjectRef, held: PartRead, *, name: str,
              **fetch_options: Any) -> PartRead:  # fmt: skip
    """``held`` (a part of a nested object, read at fewer tiers) refined to the tiers of
    the level ``ref`` is for: only the sections ``held`` lacks are fetched, each checked
    against the index ``held`` was read by; the result holds both (its ``nbytes``: the
    bytes fetched now)."""
    if held.index is None or ref.key != held.key or ref.tiers is None or ref.index is None:
        raise InputError(f"{name}: a refinement needs a held part of the same nested object")
    part = replace(held.part, tiers=ref.tiers.count)
    if part.tier_count(held.index.tiers) <= held.part.tier_count(held.index.tiers):
        raise InputError(f"{name}: level of {ref.tiers.count} tiers refines nothing held")
    try:
        wanted = [i for i in held.index.part_ids(part) if i not in held.body.sections]
    except FormatError as exc:
        raise FormatError(f"{name}: {exc}") from None
    sections, nbytes, source = _read_sections(reader, ref, held.index, wanted, name,
                                              fetch_options)  # fmt: skip
    assert held.body.sections is not None
    merged = {**held.body.sections, **sections}
    return PartRead(held.header, Body(2, sections=merged), part, nbytes, source or held.source,
                    held.index, held.key)  # fmt: skip


def _read_sections(
    reader: Reader, ref: ObjectRef, index: ChunkIndex, wanted: list[int], name: str,
    fetch_options: dict[str, Any],
) -> tuple[dict[int, memoryview], int, str]:  # fmt: skip
    """Sections ``wanted`` of the object, fetched as runs of adjacent bytes, each
    section checked against its sha256 in ``index``: (sections, bytes, the source of
    the last run)."""
    nbytes, source = 0, ""
    sections: dict[int, memoryview] = {}
    for start, end, ids in index.runs(wanted):

        def run_holds(data: bytes, start: int = start, ids: list[int] = ids) -> None:
            view = memoryview(data)
            for i in ids:
                at = index.offsets[i] - start
                index.check_section(i, view[at : at + index.lengths[i]], name)

        got = reader.fetch(ObjectSpan(ref, start, end), check=run_holds, **fetch_options)
        view = memoryview(got.data)
        nbytes += len(got.data)
        source = got.source
        for i in ids:
            at = index.offsets[i] - start
            sections[i] = view[at : at + index.lengths[i]]
    return sections, nbytes, source


def decode_into(
    data: bytes | PartRead,
    dest: ChunkDest,
    *,
    name: str = "chunk object",
    profile: CodecProfile | None = None,
    verified: bool = False,
    chunk_hash: str | None = None,
    part: Part | None = None,
) -> ChunkHeader:
    """A container object decoded into ``dest`` (a tensor view or paged blocks): the
    one decode path. ``verified=True`` says the caller has checked ``data`` against a
    trusted sha256 (the manifest's), so the trailer is not hashed again;
    ``chunk_hash``, the chunk the object must hold, and the destination's shape are
    checked before anything is decoded.

    Values are written as they are decoded: a rANS stream found corrupt at its end
    (which its sha256 cannot catch when its publisher made it so) raises after
    writing, and the caller must treat ``dest`` as not loaded.

    ``part`` (default: all of it) is the layers and heads ``dest`` holds; ``data`` is
    the whole object, or that part of it as :func:`read_part` fetched it."""
    header, body = open_chunk(data, name=name, verified=verified, chunk_hash=chunk_hash)
    _decode(header, body, dest, profile, name, part)
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
    if ref.tiers is not None:  # a nested level: the index and its tiers, each checked
        read = read_part(reader, ref, None, name=f"object {ref.key}")
        return decode_into(read, dest, name=f"object {ref.key}", profile=profile,
                           chunk_hash=entry.hash, part=read.part)  # fmt: skip
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
    tiers: int | None = None,
) -> tuple[ChunkHeader, torch.Tensor]:
    """:func:`decode_into` a tensor: ``out`` (of the chunk's shape, possibly a slice of
    a larger cache tensor), else a new one on ``device`` in the codec's own dtype
    (float16 for ``fp16`` and ``int8``, float32 for ladder levels); of a nested object,
    its first ``tiers`` tiers (default: all). Returns the header and the tensor."""
    import torch

    header, body = open_chunk(data, name=name, verified=verified, chunk_hash=chunk_hash)
    whole = Part.whole(header.shape[0], header.shape[2], tiers)
    if out is None:
        codec = codec_for(header.codec, name)
        if body.payload is not None:  # checked before a tensor is allocated
            codec.check_payload(header, body.payload, profile, name)
        else:
            assert body.sections is not None
            codec.check_sections(header, body.sections, whole, profile, name)
        out = torch.empty(header.shape, dtype=getattr(torch, codec.natural_dtype), device=device)
    _decode(header, body, TensorDest(out), profile, name, whole)
    return header, out


def _decode(header: ChunkHeader, body: Body, dest: ChunkDest, profile: CodecProfile | None,
            name: str, part: Part | None) -> None:  # fmt: skip
    codec = codec_for(header.codec, name)
    part = part or Part.whole(header.shape[0], header.shape[2])
    if not part.fits(header.shape):
        raise FormatError(f"{name}: part {part} is not within shape {list(header.shape)}")
    dest.check(part.shape(header.shape), name)  # before anything is written
    if body.sections is not None:
        codec.decode_sections(header, body.sections, part, dest, profile, name)
        return
    assert body.payload is not None
    if part.is_whole(header.shape):
        codec.decode_into(header, body.payload, dest, profile, name)
        return
    # A version-1 object has no sections: decoded whole, the part kept.
    import torch

    codec.check_payload(header, body.payload, profile, name)
    staged = torch.empty(header.shape, dtype=torch.float32)
    codec.decode_into(header, body.payload, TensorDest(staged), profile, name)
    (l0, l1), (h0, h1) = part.layers, part.heads
    dest.write(staged[l0:l1, :, h0:h1].contiguous())


def open_chunk(
    data: bytes | PartRead, *, name: str = "chunk object", verified: bool = False,
    chunk_hash: str | None = None,
) -> tuple[ChunkHeader, Body]:  # fmt: skip
    """A container's header and body, its digests checked (unless ``verified``) and
    the chunk it holds checked against ``chunk_hash`` (when given). A part read was
    checked section by section as it arrived."""
    if isinstance(data, PartRead):
        header, body = data.header, data.body  # its index was checked as it was read
    else:
        header, body = unpack(data, name=name, verify_digest=not verified)
        if body.sections is not None:
            layers, _, heads = header.shape[:3]
            check_object_tiers(header, len(body.sections) // (layers * heads), name)
    if chunk_hash is not None and header.chunk_hash != chunk_hash:
        raise FormatError(f"{name} holds another chunk than its manifest says")
    return header, body


def check_object_tiers(header: ChunkHeader, tiers: int, name: str) -> None:
    """Refuse a version-2 object holding another number of tiers of sections than its
    codec's objects hold (``docs/format.md``: extra sections would be bytes that no
    reader decodes). A codec this reader does not know is refused where it decodes."""
    codec = known_codec(header.codec)
    expected = None if codec is None else codec.object_tiers(header, name)
    if expected is not None and tiers != expected:
        raise FormatError(f"{name} holds {tiers} tiers of sections; a {header.codec} object "
                          f"like it holds {expected}")  # fmt: skip


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
    numba's cache: the rANS decoders, the transformed ladder's inverse, and the casts
    of :mod:`kvcdn.kernels.cast`) and, on a CUDA device,
    the Triton decoders (independent and nested, about 0.5 s each) for ``dtype``
    outputs of ``dim`` channels, and the transformed ladder's Triton inverse. Once per
    process, device and dtype."""
    import torch

    dtype = dtype or torch.float32
    key = (str(torch.device(device).type), str(dtype))
    with _warm_lock:
        if ("cpu", "") not in _warmed:
            import kvcdn.kernels.cast  # noqa: F401 (its kernels are loaded as it is imported)
            from kvcdn.kernels import nested as nested_kernels
            from kvcdn.kernels import rans_numba, transform

            rans_numba.warm_up()
            nested_kernels.warm_up()
            transform.warm_up()
            _warmed.add(("cpu", ""))  # the compiled kernels are the process's
        if key[0] == "cuda" and key not in _warmed and rans.triton_available():
            from kvcdn.kernels import nested_triton, rans_triton, transform_triton

            rans_triton.warm_up(device, dtype, dim)
            nested_triton.warm_up(device, dtype, dim)
            transform_triton.warm_up(device, dim)  # the KLT ladder's inverse
            _warmed.add(key)
