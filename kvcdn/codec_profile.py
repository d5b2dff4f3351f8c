"""Codec profiles: what one model's KV codec knows before it sees a document.

A profile is measured once per model (:mod:`kvcdn.calibrate`) and stored as
one content-addressed object that every manifest names; nothing of it is
shipped per chunk. It holds, for every stream (layer, K/V, head, channel):

* the channel's calibrated mean, subtracted before quantisation;
* per level, the quantiser step. Steps follow a Fisher-information weighting:
  ``step = strength * sqrt(mean_fisher / fisher) * rms_sd``, so a channel whose
  errors move the model's output more gets finer steps (reverse
  water-filling with the model's own sensitivity as the metric). Every step
  is rounded to 4 significant bits, which makes ``symbol * step`` exact in
  float32 and so every decoder kernel bit-exact;
* per level, the id of its static 12-bit rANS table. Tables are shared by
  streams whose symbol spread (channel sd / step) falls in the same third of
  an octave, and are built from the calibration symbols of exactly those
  streams; that keeps the decode tables small enough to stay in cache.

Serialised as safetensors (a strict, pickle-free tensor format) with a JSON
``kvcdn`` entry in its metadata; :func:`parse_profile` validates every field
and array before use. Specified in ``docs/format.md``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import FingerprintMismatch, FormatError
from .jsonfmt import loads
from .kv import KVLayout
from .manifest import MAX_PROFILE_BYTES

PROFILE_FORMAT = "kvcdn-codec-profile"
PROFILE_VERSION = 1
MAX_TABLES = 4096

#: The ladder, best first. Each level is calibrated to the mean next-token KL
#: divergence (against exact KV) given here, measured on the calibration texts.
LADDER: dict[str, float] = {
    "nearlossless": 0.0008,
    "high": 0.002,
    "default": 0.006,
    "low": 0.015,
    "lowest": 0.04,
}


#: The nested ladder's tiers, coarsest first: a base below the ladder, then one
#: refinement per ladder level, each calibrated to that level's KL.
NESTED_TIERS: tuple[str, ...] = ("minimal", "lowest", "low", "default", "high", "nearlossless")
#: Splits of a stream, at most: indices stay below 2**17, so ``index * step`` is exact.
MAX_NESTED_DEPTH = 6
#: Contexts of a refinement symbol by its parent cell (kvcdn.progressive.CONTEXTS).
NESTED_CONTEXTS = 3
#: ``nested.contexts`` of a profile whose tables also depend on the previous token's
#: symbol: 3 base tables a stream (the previous base index below, at or above 0) and
#: 3 x 3 refinement tables (parent cell, previous symbol); without it (profiles made
#: before), one base table and 3 refinement tables.
PREVIOUS_TOKEN = "previous-token"
PREVIOUS_BASE_CONTEXTS = 3
PREVIOUS_REFINE_CONTEXTS = NESTED_CONTEXTS * 3
#: ``nested.transform`` of a profile whose nested ladder codes coefficients, not
#: channels (:class:`NestedTransform`).
KLT_TRANSFORM = "klt-v1"
#: A synthesis matrix's entries, at most (a calibrated one's are about ``1 /
#: sqrt(fisher)``: bounded, so that no decoded value overflows float32).
MAX_SYNTHESIS = 1e12
#: Rotary tables a transform keeps (:meth:`NestedTransform.rope_tables`): the chunks of
#: 32K-token documents at 256 tokens a chunk, 8 MB for 64-channel heads.
ROPE_TABLES_KEPT = 128

#: Derived values a profile keeps (:meth:`CodecProfile.derived`): a few devices times
#: the parts a reader decodes (a tensor-parallel rank's heads, a pipeline stage's layers).
DERIVED_KEPT = 64


def round_to_4_bits(x: np.ndarray) -> np.ndarray:
    """Round positive floats to 4 significant bits (m * 2**k, 8 <= m < 16)."""
    x = np.asarray(x, dtype=np.float64)
    mant, exp = np.frexp(x)  # x = mant * 2**exp, 0.5 <= mant < 1
    return np.ldexp(np.round(mant * 16.0) / 16.0, exp).astype(np.float32)


@dataclass
class LevelSpec:
    name: str
    strength: float
    step: np.ndarray  # float32 [L, 2, H, D]
    table_id: np.ndarray  # uint16 [L, 2, H, D]
    quality: dict[str, float] = field(default_factory=dict)  # measured on calibration texts


@dataclass
class NestedTransform:
    """What the nested ladder codes in place of each head's channels
    (:mod:`kvcdn.kernels.transform`): coefficients ``y = M^-1 u``, where ``u`` is the
    head's values with keys' rotary embedding taken back (when ``inv_freq`` is given)
    and ``M`` the head's synthesis matrix. Calibrated as a KLT: ``M = diag(1 /
    sqrt(fisher)) B``, ``B`` the eigenvectors of the head's Fisher-weighted covariance
    (``docs/levels.md``), so that one step serves every coefficient."""

    mean: np.ndarray  # float32 [L, 2, H, D]: the coefficients' calibrated mean
    synthesis: np.ndarray  # float32 [L, 2, H, D, D]: M, values = M @ coefficients
    inv_freq: np.ndarray | None  # float64 [D / 2]: the keys' rotary frequencies, or None
    # derived, cached: the kernels' layout and the encoder's inverse
    _transposed: Any = field(default=None, init=False, repr=False, compare=False)
    _analysis: Any = field(default=None, init=False, repr=False, compare=False)
    _rope: Any = field(default=None, init=False, repr=False, compare=False)
    _rope_lock: Any = field(default_factory=threading.Lock, init=False, repr=False,
                            compare=False)  # fmt: skip

    def transposed(self) -> np.ndarray:
        """``M`` transposed per group ``[G, D, D]``, as the decoders take it."""
        if self._transposed is None:
            D = self.synthesis.shape[-1]
            m = self.synthesis.reshape(-1, D, D)
            self._transposed = np.ascontiguousarray(np.swapaxes(m, 1, 2))
        return self._transposed

    def analysis(self) -> np.ndarray:
        """``M``'s inverse per group ``[G, D, D]`` (float64), as the encoder takes it."""
        if self._analysis is None:
            D = self.synthesis.shape[-1]
            try:
                self._analysis = np.linalg.inv(self.synthesis.reshape(-1, D, D).astype(np.float64))
            except np.linalg.LinAlgError:
                raise FormatError("the codec profile's transform has a singular matrix: "
                                  "nothing can be encoded with it") from None  # fmt: skip
        return self._analysis

    def rotate(self, gids: np.ndarray, heads: int) -> np.ndarray:
        """Which of groups ``gids`` (layer, K/V, head order) are keys turned by RoPE."""
        keys = (np.asarray(gids) // heads) % 2 == 0
        return keys if self.inv_freq is not None else np.zeros_like(keys)

    def rope_tables(self, first: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The rotary tables of positions ``first .. first + tokens`` (read-only), kept
        for the last :data:`ROPE_TABLES_KEPT` spans asked for: every document's chunks
        start at the same positions, and computing them took 0.15 ms of a 256-token
        chunk's decode (2-3%)."""
        from kvcdn.kernels.transform import rope_tables

        if self.inv_freq is None:
            empty = np.zeros((tokens, self.synthesis.shape[-1] // 2), dtype=np.float32)
            empty.flags.writeable = False  # as kept ones are: one kernel signature
            return empty, empty
        key = (first, tokens)
        with self._rope_lock:
            if self._rope is None:
                self._rope = OrderedDict()
            found = self._rope.get(key)
            if found is not None:
                self._rope.move_to_end(key)
                return found
        found = rope_tables(self.inv_freq, first, tokens)
        for table in found:
            table.flags.writeable = False
        with self._rope_lock:
            self._rope[key] = found
            while len(self._rope) > ROPE_TABLES_KEPT:
                self._rope.popitem(last=False)
        return found

    def coefficients(self, x: np.ndarray, gids: np.ndarray, heads: int, first: int
                     ) -> np.ndarray:  # fmt: skip
        """Coefficients ``[G, T, D]`` of values ``x [G, T, D]`` of groups ``gids``, whose
        first token is at position ``first``."""
        from kvcdn.kernels.transform import analyse

        cos, sin = self.rope_tables(first, x.shape[1])
        return analyse(x, self.analysis()[gids], self.rotate(gids, heads), cos, sin)

    def values_into(self, y: np.ndarray, gids: np.ndarray, heads: int, first: int,
                    out: np.ndarray) -> None:  # fmt: skip
        """Values of coefficients ``y [G, T, D]`` into ``out`` (which may be ``y``), to
        the bit as ``docs/format.md`` specifies."""
        from kvcdn.kernels.transform import synthesise

        cos, sin = self.rope_tables(first, y.shape[1])
        g = np.asarray(gids)
        # a whole chunk's or a rank's groups are consecutive: a view, not a copy of their
        # matrices for every chunk
        consecutive = len(g) > 0 and np.array_equal(g, np.arange(g[0], g[0] + len(g)))
        rows = slice(int(g[0]), int(g[0]) + len(g)) if consecutive else g
        synthesise(y, self.transposed()[rows], self.rotate(g, heads), cos, sin, out)


@dataclass
class NestedSpec:
    """The nested ladder (:mod:`kvcdn.progressive`): per stream ``[L, 2, H, D]``, the
    finest tier's step and how many times each tier has split the stream; the base's
    step is ``fine_step * 3**depth[-1]``."""

    tiers: tuple[str, ...]  # names, coarsest first
    base_strength: float
    fine_step: np.ndarray  # float32 [L, 2, H, D], 4 significant bits
    depth: np.ndarray  # uint8 [tiers, L, 2, H, D]: depth[0] == 0, +0 or +1 a tier
    # uint16 [B, L, 2, H, D], B = 1 or PREVIOUS_BASE_CONTEXTS (previous_token)
    base_table: np.ndarray
    # uint16 [tiers - 1, C, L, 2, H, D], C = NESTED_CONTEXTS or PREVIOUS_REFINE_CONTEXTS
    refine_table: np.ndarray
    quality: dict[str, dict[str, float]] = field(default_factory=dict)  # per tier
    #: None: the streams are the channels, around the profile's ``mean``
    transform: NestedTransform | None = None

    def tier(self, name: str) -> int:
        return self.tiers.index(name)

    @property
    def previous_token(self) -> bool:
        """Whether a symbol's table also depends on the previous token's symbol."""
        return self.base_table.shape[0] == PREVIOUS_BASE_CONTEXTS


@dataclass
class CodecProfile:
    model_fingerprint: str
    layout: KVLayout
    sinks: int  # the document's first tokens, kept exact (fp16)
    mean: np.ndarray  # float32 [L, 2, H, D]
    freqs: np.ndarray  # uint32 [n_tables, n_symbols], rows sum to 4096
    table_lo: np.ndarray  # int32 [n_tables]: the signed value of symbol index 0
    table_size: np.ndarray  # int32 [n_tables]: symbols in use (the rest have frequency 0)
    levels: dict[str, LevelSpec]
    calibration: dict[str, Any] = field(default_factory=dict)
    nested: NestedSpec | None = None
    # derived, cached: never copied by dataclasses.replace (init=False), reset by changed()
    _bytes: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _sha256: str | None = field(default=None, init=False, repr=False, compare=False)
    _decode_tables: Any = field(default=None, init=False, repr=False, compare=False)
    _table_starts: Any = field(default=None, init=False, repr=False, compare=False)
    _per_level: dict[str, Any] = field(default_factory=dict, init=False, repr=False,
                                       compare=False)  # fmt: skip
    _derived: OrderedDict[Hashable, Any] = field(default_factory=OrderedDict, init=False,
                                                 repr=False, compare=False)  # fmt: skip
    _derived_lock: Any = field(default_factory=threading.Lock, init=False, repr=False,
                               compare=False)  # fmt: skip

    # ---- identity ----------------------------------------------------------
    def changed(self) -> None:
        """Forget what was derived from the fields (bytes, hash, kernel tables), after
        one was changed."""
        self._bytes = self._sha256 = self._decode_tables = self._table_starts = None
        self._per_level = {}
        self._derived = OrderedDict()

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``key`` and kept with the profile: a GPU decoder's
        tables on its device (the decode tables alone are 6 MB, which every chunk would
        otherwise copy to the device again). At most :data:`DERIVED_KEPT` are kept, the
        one used longest ago dropped first."""
        found = self._derived.get(key)
        if found is not None:
            with self._derived_lock:  # used now: the last to be dropped
                if key in self._derived:
                    self._derived.move_to_end(key)
        if found is None:
            found = make()  # outside the lock: two threads may both make it, once
            with self._derived_lock:
                while len(self._derived) >= DERIVED_KEPT:
                    self._derived.pop(next(iter(self._derived)))
                self._derived[key] = found
        return found

    def to_bytes(self) -> bytes:
        if self._bytes is None:
            self._bytes = _serialise(self)
        return self._bytes

    @property
    def sha256(self) -> str:
        """The sha256 of :meth:`to_bytes`, hashed once (every decode compares it with its
        container's, 0.2 ms a chunk when hashed each time)."""
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self.to_bytes()).hexdigest()
        return self._sha256

    def check_model(self, fingerprint: str, what: str = "codec profile") -> None:
        if fingerprint != self.model_fingerprint:
            raise FingerprintMismatch(
                f"{what} was calibrated for model {self.model_fingerprint[:12]}, "
                f"not for {fingerprint[:12]}; a profile only fits the model it was measured on"
            )

    # ---- what the kernels need ---------------------------------------------
    def decode_tables(self) -> np.ndarray:
        """Packed rANS decode tables ``[n_tables, 4096]`` (built once): those of the
        ladder's levels and of the nested base; a nested refinement's ternary tables are
        decoded from their cut points (``table_starts``), and their rows stay zeros
        (most of a profile's tables since the previous token is a context: 21 MB of
        rows, about 40 ms to build)."""
        if self._decode_tables is None:
            from kvcdn.kernels.rans import build_decode_table

            used = [spec.table_id.reshape(-1) for spec in self.levels.values()]
            if self.nested is not None:
                used.append(self.nested.base_table.reshape(-1))
            rows = np.concatenate(used) if used else np.zeros(0, dtype=np.int64)
            self._decode_tables = build_decode_table(self.freqs, rows)
        return self._decode_tables

    def table_starts(self) -> np.ndarray:
        """Each table's symbol starts ``[n_tables, 256]`` (uint32, built once)."""
        if self._table_starts is None:
            from kvcdn.kernels.rans import cumulative

            self._table_starts = cumulative(self.freqs)
        return self._table_starts

    def dequant(self, level: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(table_id, scale, offset), each ``[G, D]``: value = index * scale + offset."""
        return self._level_arrays(level)[:3]

    def quantiser(self, level: str) -> tuple[np.ndarray, ...]:
        """(mean, step, lo, size, table_id), each ``[G, D]``, for the fused encoder."""
        tid, scale, _, lo, size = self._level_arrays(level)
        return self.mean.reshape(tid.shape), scale, lo, size, tid

    def _level_arrays(self, level: str) -> tuple[np.ndarray, ...]:
        cached = self._per_level.get(level)
        if cached is None:
            spec = self.levels[level]
            G = self.layout.layers * 2 * self.layout.kv_heads
            tid = np.ascontiguousarray(spec.table_id.reshape(G, -1).astype(np.int32))
            scale = np.ascontiguousarray(spec.step.reshape(G, -1).astype(np.float32))
            lo = self.table_lo[tid].astype(np.int32)
            # lo * scale is exact (8-bit integer times a 4-significant-bit float).
            offset = (lo.astype(np.float32) * scale + self.mean.reshape(G, -1)).astype(np.float32)
            size = self.table_size[tid].astype(np.int32)
            cached = self._per_level[level] = (tid, scale, offset, lo, size)
        return cached

    def nested_arrays(self) -> tuple[Any, ...]:
        """What the nested kernels take (:mod:`kvcdn.kernels.nested`), per group ``[G,
        D]``: (mean, fine step, depth ``[R, G, D]``, base lo, base size, base table (the
        first context's), refinement tables ``[R - 1, 3, G, D]`` (per parent context,
        the first previous symbol's), and the stride between a context's tables: 1
        where the tables depend on the previous token, 0 in profiles made before)."""
        cached = self._per_level.get("\0nested")
        if cached is None:
            spec = self.nested
            assert spec is not None
            G = self.layout.layers * 2 * self.layout.kv_heads
            tiers = len(spec.tiers)
            base = spec.base_table[0].reshape(G, -1).astype(np.int64)
            refine = spec.refine_table[:, :: spec.refine_table.shape[1] // NESTED_CONTEXTS]
            mean = self.mean if spec.transform is None else spec.transform.mean
            cached = self._per_level["\0nested"] = (
                mean.reshape(G, -1),
                spec.fine_step.reshape(G, -1),
                spec.depth.reshape(tiers, G, -1).astype(np.int64),
                self.table_lo[base].astype(np.int64),
                self.table_size[base].astype(np.int64),
                base,
                refine.reshape(tiers - 1, NESTED_CONTEXTS, G, -1).astype(np.int64),
                int(spec.previous_token),
            )
        return cached

    def quantise(self, level: str, x: np.ndarray) -> np.ndarray:
        """KV ``[L, 2, H, T, D]`` (float32) -> symbol indices ``[G, T, D]`` (uint8)."""
        spec = self.levels[level]
        L, two, H, T, D = x.shape
        mean = self.mean[:, :, :, None, :]
        step = spec.step[:, :, :, None, :]
        q = np.rint((x - mean) / step)
        tid = spec.table_id.astype(np.int64)
        lo = self.table_lo[tid][:, :, :, None, :]
        hi = lo + self.table_size[tid][:, :, :, None, :] - 1
        idx = np.clip(q, lo, hi) - lo
        return idx.reshape(L * two * H, T, D).astype(np.uint8)


# ---- serialisation ----------------------------------------------------------


def _serialise(p: CodecProfile) -> bytes:
    from safetensors.numpy import save

    tensors: dict[str, np.ndarray] = {
        "mean": p.mean.astype(np.float32),
        "freqs": p.freqs.astype(np.uint16 if p.freqs.max() < 65536 else np.uint32),
        "table_lo": p.table_lo.astype(np.int32),
        "table_size": p.table_size.astype(np.int32),
    }
    for name, spec in p.levels.items():
        tensors[f"levels.{name}.step"] = spec.step.astype(np.float32)
        tensors[f"levels.{name}.table_id"] = spec.table_id.astype(np.uint16)
    nested = p.nested
    if nested is not None:
        tensors["nested.fine_step"] = nested.fine_step.astype(np.float32)
        tensors["nested.depth"] = nested.depth.astype(np.uint8)
        base = nested.base_table if nested.previous_token else nested.base_table[0]
        tensors["nested.base_table"] = base.astype(np.uint16)
        tensors["nested.refine_table"] = nested.refine_table.astype(np.uint16)
    meta = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model_fingerprint": p.model_fingerprint,
        "layout": p.layout.to_json(),
        "sinks": p.sinks,
        "levels": {
            name: {"strength": spec.strength, "quality": spec.quality}
            for name, spec in p.levels.items()
        },
        "calibration": p.calibration,
    }
    if nested is not None:
        meta["nested"] = {"tiers": list(nested.tiers), "base_strength": nested.base_strength,
                          "quality": nested.quality}  # fmt: skip
        if nested.previous_token:
            meta["nested"]["contexts"] = PREVIOUS_TOKEN
        if (tf := nested.transform) is not None:
            meta["nested"]["transform"] = KLT_TRANSFORM
            tensors["nested.transform.mean"] = tf.mean.astype(np.float32)
            tensors["nested.transform.synthesis"] = tf.synthesis.astype(np.float32)
            if tf.inv_freq is not None:
                tensors["nested.transform.inv_freq"] = tf.inv_freq.astype(np.float64)
    return save(tensors, metadata={"kvcdn": json.dumps(meta, sort_keys=True)})


def parse_profile(data: bytes, *, name: str = "codec profile") -> CodecProfile:
    """Validate and load a serialised profile; raises :class:`FormatError`."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    if len(data) > MAX_PROFILE_BYTES:
        raise FormatError(f"{name} is {len(data)} bytes, more than a profile can be")
    if len(data) < 8:
        raise FormatError(f"{name} is truncated")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise FormatError(f"{name}: header length {header_len} runs past the end")
    try:
        header = loads(bytes(data[8 : 8 + header_len]), what=name, max_bytes=header_len)
        meta = loads(header["__metadata__"]["kvcdn"].encode(), what=name, max_bytes=header_len)
        arrays = load(bytes(data))
    except (ValueError, KeyError, TypeError, AttributeError, SafetensorError) as exc:
        raise FormatError(f"{name} is not a kvcdn codec profile: {exc}") from None
    bad = _Check(name)
    if not isinstance(meta, dict) or meta.get("format") != PROFILE_FORMAT:
        raise bad("it is not a kvcdn codec profile")
    if meta.get("version") != PROFILE_VERSION:
        raise bad(f"profile version {meta.get('version')!r} is not supported")
    lay = bad.dict(meta.get("layout"), "layout")
    layout = KVLayout(
        layers=bad.int(lay.get("layers"), "layout.layers", 1, 4096),
        kv_heads=bad.int(lay.get("kv_heads"), "layout.kv_heads", 1, 4096),
        head_dim=bad.int(lay.get("head_dim"), "layout.head_dim", 1, 4096),
        dtype=bad.str(lay.get("dtype"), "layout.dtype"),
    )
    stream_shape = (layout.layers, 2, layout.kv_heads, layout.head_dim)
    mean = bad.array(arrays, "mean", np.float32, stream_shape)
    freqs = arrays.get("freqs")
    if freqs is None or freqs.ndim != 2 or freqs.dtype not in (np.uint16, np.uint32):
        raise bad("freqs must be a 2-D unsigned array")
    n_tables, n_sym = freqs.shape
    if not 1 <= n_tables <= MAX_TABLES or not 1 <= n_sym <= 256:
        raise bad(f"freqs has an impossible shape {freqs.shape}")
    freqs = freqs.astype(np.uint32)
    if np.any(freqs.sum(axis=1) != 4096):
        raise bad("every rANS table must sum to 4096")
    table_lo = bad.array(arrays, "table_lo", np.int32, (n_tables,))
    table_size = bad.array(arrays, "table_size", np.int32, (n_tables,))
    if np.any(table_size < 1) or np.any(table_size > n_sym) or np.any(np.abs(table_lo) > 4096):
        raise bad("table ranges out of bounds")
    used = np.arange(n_sym)[None, :] < table_size[:, None]
    if np.any(freqs[used] == 0) or np.any(freqs[~used] != 0):
        raise bad("a table gives zero frequency to a symbol in its range, or weight outside it")
    levels: dict[str, LevelSpec] = {}
    for lname, lmeta in bad.dict(meta.get("levels"), "levels").items():
        if lname not in LADDER:
            raise bad(f"unknown level {lname!r}")
        lmeta = bad.dict(lmeta, f"levels.{lname}")
        step = bad.array(arrays, f"levels.{lname}.step", np.float32, stream_shape)
        if (
            not np.all(np.isfinite(step))
            or np.any(step <= 0)
            or np.any(round_to_4_bits(step) != step)
        ):
            raise bad(f"levels.{lname}.step must be positive with 4 significant bits")
        tid = bad.array(arrays, f"levels.{lname}.table_id", np.uint16, stream_shape)
        if np.any(tid >= n_tables):
            raise bad(f"levels.{lname}.table_id names a table that does not exist")
        quality = bad.dict(lmeta.get("quality", {}), f"levels.{lname}.quality")
        levels[lname] = LevelSpec(
            name=lname,
            strength=float(bad.num(lmeta.get("strength"), f"levels.{lname}.strength")),
            step=step,
            table_id=tid,
            quality={
                k: float(bad.num(v, f"levels.{lname}.quality.{k}")) for k, v in quality.items()
            },
        )
    if not levels:
        raise bad("it defines no levels")
    levels = {n: levels[n] for n in LADDER if n in levels}  # in ladder order, as calibrated
    if not np.all(np.isfinite(mean)):
        raise bad("mean has non-finite values")
    fingerprint = bad.str(meta.get("model_fingerprint"), "model_fingerprint")
    sinks = bad.int(meta.get("sinks"), "sinks", 0, 4096)
    profile = CodecProfile(
        model_fingerprint=fingerprint,
        layout=layout,
        sinks=sinks,
        mean=mean,
        freqs=freqs,
        table_lo=table_lo,
        table_size=table_size,
        levels=levels,
        calibration=bad.dict(meta.get("calibration", {}), "calibration"),
        nested=_parse_nested(meta.get("nested"), arrays, stream_shape, table_lo, table_size,
                             bad),  # fmt: skip
    )
    profile._bytes = bytes(data)
    return profile


def _parse_nested(
    meta: Any, arrays: dict[str, np.ndarray], shape: tuple[int, ...], table_lo: np.ndarray,
    table_size: np.ndarray, bad: _Check,
) -> NestedSpec | None:  # fmt: skip
    """The nested ladder of a profile, every array checked (None: the profile has none)."""
    if meta is None:
        return None
    meta = bad.dict(meta, "nested")
    tiers = meta.get("tiers")
    if not isinstance(tiers, list) or tuple(tiers) != NESTED_TIERS[: len(tiers)] or len(tiers) < 2:
        raise bad(f"nested.tiers must start {list(NESTED_TIERS[:2])} in ladder order")
    n = len(tiers)
    fine = bad.array(arrays, "nested.fine_step", np.float32, shape)
    if not np.all(np.isfinite(fine)) or np.any(fine <= 0) or np.any(round_to_4_bits(fine) != fine):
        raise bad("nested.fine_step must be positive with 4 significant bits")
    depth = bad.array(arrays, "nested.depth", np.uint8, (n, *shape)).astype(np.int64)
    steps = np.diff(depth, axis=0)
    if np.any(depth[0] != 0) or np.any((steps != 0) & (steps != 1)):
        raise bad("nested.depth must start at 0 and grow by 0 or 1 a tier")
    if depth[-1].max() > MAX_NESTED_DEPTH:
        raise bad(f"nested.depth goes past {MAX_NESTED_DEPTH} splits")
    contexts = meta.get("contexts")
    if contexts not in (None, PREVIOUS_TOKEN):
        raise bad(f"nested.contexts must be {PREVIOUS_TOKEN!r} or absent")
    if contexts == PREVIOUS_TOKEN:
        base = bad.array(arrays, "nested.base_table", np.uint16, (PREVIOUS_BASE_CONTEXTS, *shape))
        refine_contexts = PREVIOUS_REFINE_CONTEXTS
    else:
        base = bad.array(arrays, "nested.base_table", np.uint16, shape)[None]
        refine_contexts = NESTED_CONTEXTS
    refine = bad.array(arrays, "nested.refine_table", np.uint16, (n - 1, refine_contexts, *shape))
    if np.any(base >= len(table_lo)) or np.any(refine >= len(table_lo)):
        raise bad("a nested table id names a table that does not exist")
    if np.any(table_lo[base] < -128) or np.any(table_lo[base] + table_size[base] > 128):
        raise bad("a nested base table reaches past 8-bit indices")
    if np.any(table_lo[base] != table_lo[base[0]]) or np.any(
            table_size[base] != table_size[base[0]]):  # fmt: skip
        raise bad("a stream's nested base tables must span the same range in every context")
    if contexts == PREVIOUS_TOKEN:  # the kernels find a context's table by its offset
        step = np.arange(PREVIOUS_BASE_CONTEXTS).reshape(-1, *[1] * len(shape))
        by_parent = refine.reshape(n - 1, NESTED_CONTEXTS, 3, *shape)
        if np.any(base != base[0] + step) or np.any(
                by_parent != by_parent[:, :, :1] + step[None, None]):  # fmt: skip
            raise bad("a stream's nested tables of one parent context must be consecutive")
    if np.any(table_lo[refine] != 0) or np.any(table_size[refine] != 3):
        raise bad("a nested refinement table must code the three symbols 0, 1, 2")
    quality = bad.dict(meta.get("quality", {}), "nested.quality")
    transform = _parse_transform(meta.get("transform"), arrays, shape, bad)
    return NestedSpec(
        tiers=tuple(tiers),
        base_strength=bad.num(meta.get("base_strength"), "nested.base_strength"),
        fine_step=fine,
        depth=depth.astype(np.uint8),
        base_table=base,
        refine_table=refine,
        quality={
            str(t): {k: bad.num(v, f"nested.quality.{t}.{k}")
                     for k, v in bad.dict(q, f"nested.quality.{t}").items()}
            for t, q in quality.items()
        },
        transform=transform,
    )  # fmt: skip


def _parse_transform(name: Any, arrays: dict[str, np.ndarray], shape: tuple[int, ...],
                     bad: _Check) -> NestedTransform | None:  # fmt: skip
    """The nested ladder's transform, every array checked (None: it has none)."""
    if name is None:
        if any(k.startswith("nested.transform.") for k in arrays):
            raise bad("nested.transform arrays without nested.transform")
        return None
    if name != KLT_TRANSFORM:
        raise bad(f"nested.transform must be {KLT_TRANSFORM!r} or absent")
    dim = shape[-1]
    if dim % 2:
        raise bad("a nested transform needs an even head_dim")
    mean = bad.array(arrays, "nested.transform.mean", np.float32, shape)
    synthesis = bad.array(arrays, "nested.transform.synthesis", np.float32, (*shape, dim))
    if not np.all(np.isfinite(mean)) or not np.all(np.abs(synthesis) <= MAX_SYNTHESIS):
        raise bad("nested.transform has non-finite or out-of-range values")
    inv_freq = None
    if "nested.transform.inv_freq" in arrays:
        inv_freq = bad.array(arrays, "nested.transform.inv_freq", np.float64, (dim // 2,))
        if not np.all(np.isfinite(inv_freq)) or np.any(inv_freq < 0) or np.any(inv_freq > 4):
            raise bad("nested.transform.inv_freq must be rotary frequencies in [0, 4]")
    return NestedTransform(mean=mean, synthesis=synthesis, inv_freq=inv_freq)


class _Check:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, what: str) -> FormatError:
        return FormatError(f"{self.name}: {what}")

    def dict(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self(f"{where} must be an object")
        return v

    def str(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not v:
            raise self(f"{where} must be a non-empty string")
        return v

    def int(self, v: Any, where: str, lo: int, hi: int) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self(f"{where} must be an integer in [{lo}, {hi}]")
        return v

    def num(self, v: Any, where: str) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise self(f"{where} must be a finite number")
        return float(v)

    def array(self, arrays: dict, key: str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        a = arrays.get(key)
        if a is None:
            raise self(f"array {key} is missing")
        if a.dtype != dtype or a.shape != shape:
            raise self(
                f"array {key} is {a.dtype}{list(a.shape)}, expected {np.dtype(dtype)}{list(shape)}"
            )
        return a
