"""The nested ladder's CPU decoder sixteen groups at a time (AVX-512 or AVX2, :mod:`.simd`).

The same streams, values and end checks as :func:`kvcdn.kernels.nested.decode`, bit
for bit; the lanes of one vector are sixteen groups (layer, K/V, head), not the
lanes of one group: a group's stream is sequential (its four states share one word
position), but groups are independent, so each vector lane keeps one group's state
``i``, word position and bounds, and every table lookup and word read is a gather.

* The base: one step per (token, lane ``d``) decodes lane ``d`` of all sixteen groups,
  states taken in turn as the format interleaves them.
* A refinement: groups split different lanes, so step ``q`` decodes each group's
  ``q``-th coded lane: its parent index is gathered from wherever the lane's last
  index lies (the base's row or an earlier tier's step), and the new index is stored
  in the step's own row (a store: a scatter back into the base's row cost a sixth of
  the refinements' time); a group with fewer coded lanes steps through a table of one
  symbol of probability 1 for the last steps, which changes nothing (no masks). To
  waste few steps, :func:`block_order` puts groups that code about as many lanes in
  every tier in the same block (tiers 1-5 of the embedded model: 1,601 steps a token
  against 1,849 with the groups sorted by their counts, and 0.74 of the steps busy),
  and :func:`decode` shares the blocks out so that each thread takes as many steps.
* A ternary table needs no lookup: its symbol is the count of its two cut points at
  or below the slot, its start and next cut are blends of them.
* A base step looks up one 32-bit entry a slot (:class:`VectorTables`: the slot's
  symbol, its frequency and the slot's offset in it), not the slot's symbol and then
  the symbol's entry: the second gather was about 40% of the base's time, more than
  the larger tables cost (16 KB each, the bases' only: a block's outgrow a Zen 4's
  L2 cache). The rANS kernel took 0.82-0.96x its time by tier there.
* Contexts (the previous token's symbol in the lane): a base step takes its table from
  a row it set at the previous token, context 0's plus ``1 + sign(index)`` tables;
  a refinement's cut points are blended from the nine contexts' by the previous
  symbol, then the parent.
* Values: each group's row of the token gathered from its lanes' last indices and written
  as sixteen consecutive floats, ``mean + float32(n) * scale`` rounded twice as the
  scalar kernel rounds them.

* A block's start (its groups' tables, ranges, means and scales, each refinement step's
  parent rows and cut points) depends on the profile and the groups alone: made once,
  :class:`BlockSetup`, it is read by every chunk's decode from there (filled for every
  chunk, it took 0.4 ms of a ``nearlossless`` chunk's 7).

The last block of the order (wherever the threads' share puts it) is filled with
copies of its last group: they decode it again and write the same values to the same
places. Word reads are clamped to each
group's stream as in the scalar kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numba import njit

from . import parallel
from .nested import STATES, _pow3
from .rans import PROB_BITS, RANS_L
from .simd import W, gather, gather_pair, load, minimum, put_values, select, sra, store

_MASK = (1 << PROB_BITS) - 1
_SLOTS = 1 << PROB_BITS
_MAX_ELEMENTS = 1 << 31  # the instructions' indices are signed 32-bit
_MAX_LO = 1 << 20  # a base range's start, in steps: its indices times 3^6 stay 32-bit
#: Words one read takes from a stream's clamped position on: the four a step of each
#: state may need (the four states take at most one each before the next read).
WORDS_READ = 4


class VectorTables(NamedTuple):
    """The base tables as :func:`decode` reads them, made once per profile by
    :func:`vector_tables`: ``entries`` (``uint32 [tables * 4096]``), each slot's
    ``symbol | freq - 1 << 8 | (slot - start) << 20``, for the base tables only (the
    refinements' are their cut points, in the :class:`BlockSetup`), each base's
    contexts' tables next to each other; ``index`` (``int64 [n]``), where each decode
    table's base starts among them (-1: a table no base starts at); ``contexts``, the
    tables of each base (3, or 1 for a profile without contexts); ``source``, ``n``,
    the decode tables they were made from."""

    entries: np.ndarray
    index: np.ndarray
    contexts: int
    source: int

    @property
    def tables(self) -> int:
        return len(self.entries) // _SLOTS


def vector_tables(lut: np.ndarray, cum: np.ndarray, base_tid: np.ndarray, stride: int
                  ) -> VectorTables:  # fmt: skip
    """The :class:`VectorTables` of the packed decode tables ``lut [n, 4096]`` (the
    slot's symbol in its low byte) and their starts ``cum [n, symbols]``
    (:func:`kvcdn.kernels.nested.decode`'s), for streams whose base starts at table
    ``base_tid [G, D]`` with contexts ``stride`` tables apart (three of them; one where
    ``stride`` is 0). 2.5 MB for the embedded model's 52 bases."""
    lut = np.asarray(lut, dtype=np.uint32).reshape(-1, _SLOTS)
    base_tid = np.asarray(base_tid, dtype=np.int64)
    contexts = 3 if stride else 1
    if base_tid.size and (int(base_tid.min()) < 0
                          or int(base_tid.max()) + (contexts - 1) * stride >= len(lut)):
        raise ValueError("a stream's table is not one of the decode tables")
    bases = np.unique(base_tid)
    tables = (bases[:, None] + np.arange(contexts) * stride).reshape(-1)
    slot = lut[tables].astype(np.int64)
    symbol = slot & 0xFF
    starts = np.asarray(cum, dtype=np.int64)[tables]
    if tables.size and int(symbol.max()) >= starts.shape[1]:
        raise ValueError("a base table's slots are not its symbols' frequencies")
    edges = np.concatenate([starts, np.full((len(tables), 1), _SLOTS)], axis=1)
    row = np.arange(len(tables))[:, None]
    start = edges[row, symbol]
    freq = edges[row, symbol + 1] - start
    bias = np.arange(_SLOTS) - start  # the slot's offset within its symbol's slots
    if np.any(freq < 1) or np.any(bias < 0) or np.any(bias >= freq):
        raise ValueError("a base table's slots are not its symbols' frequencies")
    entries = symbol | (freq - 1) << 8 | bias << 20
    if entries.size >= _MAX_ELEMENTS:  # the kernel's indices are signed 32-bit
        raise ValueError("too many base tables for the vector decoder")
    index = np.full(len(lut), -1, dtype=np.int64)
    index[bases] = np.arange(len(bases)) * contexts
    entries = entries.astype(np.uint32).reshape(-1)
    for a in (entries, index):
        a.flags.writeable = False  # shared by every chunk's decode
    return VectorTables(entries, index, contexts, len(lut))


def usable(out: np.ndarray, words: np.ndarray, lut: np.ndarray, wbeg: np.ndarray,
           wend: np.ndarray, lo: np.ndarray | None = None) -> bool:  # fmt: skip
    """Whether :func:`decode` takes these arrays: a host with the instructions, a
    group row of whole vectors, contiguous within a token, contiguous words (its gathers
    read from the first one's address), tables, words and base ranges (``lo``) that
    32-bit indices reach, and three words after every stream's last (each read takes
    four: the codec's words end with padding words)."""
    from .simd import AVAILABLE

    return (
        AVAILABLE
        and out.ndim == 3
        and out.dtype == np.float32
        and words.dtype == np.uint16
        and words.ndim == 1
        and words.strides == (2,)  # its gathers read from the first word's address on
        and lut.dtype == np.uint32
        and out.shape[2] % W == 0
        and out.strides[2] == out.itemsize
        and out.strides[0] % out.itemsize == 0  # every row starts at an element
        and out.strides[1] % out.itemsize == 0
        and len(words) < _MAX_ELEMENTS
        and lut.size < _MAX_ELEMENTS
        and int(np.maximum(wend - 1, wbeg).max(initial=0)) + WORDS_READ <= len(words)
        # its indices are 32-bit: ranges far past any profile's (the parser's ±128)
        and (lo is None or int(np.abs(np.asarray(lo, dtype=np.int64)).max(initial=0)) < _MAX_LO)
    )


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _word(p, last, read, pair0, pair1):  # pragma: no cover - jitted
    """``words[min(p, last)]`` of each lane from the four words read at ``read`` (``min``
    of an earlier position and ``last``; ``p`` at most three past that position):
    ``pair0`` the first two, ``pair1`` the next two."""
    off = minimum(p, last) - read
    pair = select(off >> 1, pair1, pair0)
    return (pair >> ((off & 1) << 4)) & 0xFFFF


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _base_step(x, p, last, read, pair0, pair1, at, rows, first, low, entries, n, codes
               ):  # pragma: no cover - jitted  # fmt: skip
    """Lane ``at // W`` of every group from its states ``x`` (word position ``p``, its
    words read as :func:`_word` takes them): (new states, new position); the indices
    go to ``n[at:at + W]``. ``rows[at:]``: each group's table at this token, which the
    step sets for the next one (its ``first[at:]``, context 0's, plus ``1 + sign`` of
    the index tables, masked by ``codes``: 3, or 0 where a stream's base is one table,
    so that no setup of another stride can point past the tables)."""
    e = gather(entries, load(rows, at) + (x & _MASK))  # the table's first slot + the slot
    v = (((e >> 8) & 0xFFF) + 1) * (x >> PROB_BITS) + (e >> 20)
    take = v < RANS_L
    w = _word(p, last, read, pair0, pair1)
    index = (e & 0xFF) + load(low, at)
    store(n, at, index)
    context = 1 + ((0 - index) >> 31) + sra(index, 31)  # 1 + sign(index), unsigned lanes
    store(rows, at, load(first, at) + ((context & codes) << PROB_BITS))
    return (v << (take << 4)) | (w & (0 - take)), p + take


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _refine_step(x, p, last, read, pair0, pair1, at, coded, cuts, skip, prev, n
                 ):  # pragma: no cover - jitted  # fmt: skip
    """Coded lane ``at`` of a tier (``coded[at * W:]``: where each group's parent index
    lies in ``n``; ``prev[at * W:]`` its symbol at the previous token): (new states,
    new position; its words read as :func:`_word` takes them); the new indices go to
    ``n[at * W:]``. A ternary table is its two cut points (``cuts[(at - skip) * 9 * W:]``,
    ``skip`` the base's rows: ``first | second << 16`` per context ``3 min(|parent|, 2) +
    prev``). A group past its last coded lane steps through a table of one symbol of
    probability 1, which leaves its state, and so its position, as they are, and writes
    an index nothing reads."""
    where = load(coded, at * W)
    parent = gather(n, where)
    sign = sra(parent, 31)
    size = (parent ^ sign) - sign
    # the previous symbol's three candidates first: loads that need not wait for the
    # parent (a gather of the context's cut points from all nine waited for it)
    before = load(prev, at * W)
    one, two = before & 1, before >> 1  # the symbol is 0, 1 or 2
    c = (at - skip) * 9 * W
    middle = select(two, load(cuts, c + 2 * W), select(one, load(cuts, c + W), load(cuts, c)))
    near = select(two, load(cuts, c + 5 * W),
                  select(one, load(cuts, c + 4 * W), load(cuts, c + 3 * W)))
    far = select(two, load(cuts, c + 8 * W),
                 select(one, load(cuts, c + 7 * W), load(cuts, c + 6 * W)))
    cut = select(size > 1, far, select(size != 0, near, middle))  # min(|parent|, 2)
    first, second = cut & 0xFFFF, cut >> 16
    slot = x & _MASK
    above_first, above_second = first <= slot, second <= slot
    start = select(above_second, second, select(above_first, first, 0))
    end = select(above_second, _SLOTS, select(above_first, second, first))
    v = (end - start) * (x >> PROB_BITS) + slot - start
    take = v < RANS_L
    w = _word(p, last, read, pair0, pair1)
    store(prev, at * W, above_first + above_second)
    step = above_first + above_second - 1  # counted from the mean's side
    # step * sign(parent) (1 for 0) without a multiply: negated where sign is all ones
    store(n, at * W, parent * 3 + ((step ^ sign) - sign))
    return (v << (take << 4)) | (w & (0 - take)), p + take


@njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
def _decode_blocks(b0, b1, blocks, order, k, words, wbeg, wend, states, entries, tier_at,
                   row_at, most, first, low, mu, scale, fin, coded, cuts, prev0, stride, out,
                   status):  # pragma: no cover  # fmt: skip
    """Blocks ``blocks[b0:b1]`` of ``W`` groups (block ``b``: ``order[b * W:]``), tiers
    ``0..k``, each started from its part of a :class:`BlockSetup` (``tier_at`` to
    ``prev0``; ``most`` its largest block's rows)."""
    G, T, D = out.shape
    R = k + 1
    group_stride, token_stride = out.strides[0] // 4, out.strides[1] // 4
    rows = np.empty(D * W, np.uint32)  # lane-major: [d * W + lane]
    codes = np.uint32(3) if stride else np.uint32(0)
    context_1 = np.uint32(_SLOTS if stride else 0)  # a stream's contexts are adjacent
    prev = np.zeros(most * W, np.uint32)  # [at * W + lane]: the previous token's symbols
    xs = np.empty(R * STATES * W, np.uint32)
    pos = np.empty(R * W, np.uint32)
    last = np.empty(R * W, np.uint32)
    # indices: the base's [d * W + lane], then a row per refinement step [at * W + lane]
    n = np.zeros(most * W, np.uint32)
    groups = np.empty(W, np.int64)
    for at_block in range(b0, b1):
        block = blocks[at_block]
        # the block's setup (the same for every chunk of these groups): views
        lanes = block * D * W
        first_b, low_b = first[lanes : lanes + D * W], low[lanes : lanes + D * W]
        mu_b, scale_b, fin_b = (mu[lanes : lanes + D * W], scale[lanes : lanes + D * W],
                                fin[lanes : lanes + D * W])  # fmt: skip
        r0, r1 = row_at[block], row_at[block + 1]
        coded_b = coded[r0 * W : r1 * W]
        cuts_b = cuts[(r0 - block * D) * 9 * W :]  # its refinement rows: from row D on
        for i in range(D * W):
            rows[i] = first_b[i] + context_1
        for i in range(D * W, (r1 - r0) * W):
            prev[i] = prev0[r0 * W + i]
        for lane in range(W):
            g = order[min(block * W + lane, G - 1)]
            groups[lane] = g
            for r in range(R):
                for i in range(STATES):
                    xs[(r * STATES + i) * W + lane] = states[r, g, i]
                pos[r * W + lane] = wbeg[r, g]
                last[r * W + lane] = max(wend[r, g] - 1, wbeg[r, g])
        for t in range(T):
            x0, x1, x2, x3 = load(xs, 0), load(xs, W), load(xs, 2 * W), load(xs, 3 * W)
            p, end = load(pos, 0), load(last, 0)
            for d in range(0, D, 4):
                # the next four words of each stream in two reads, before the steps
                # that may take them (a read a step waited for the step before it)
                read = minimum(p, end)
                r0w, r1w = gather_pair(words, read), gather_pair(words, read + 2)
                x0, p = _base_step(x0, p, end, read, r0w, r1w, d * W, rows, first_b, low_b,
                                   entries, n, codes)  # fmt: skip
                x1, p = _base_step(x1, p, end, read, r0w, r1w, (d + 1) * W, rows, first_b,
                                   low_b, entries, n, codes)  # fmt: skip
                x2, p = _base_step(x2, p, end, read, r0w, r1w, (d + 2) * W, rows, first_b,
                                   low_b, entries, n, codes)  # fmt: skip
                x3, p = _base_step(x3, p, end, read, r0w, r1w, (d + 3) * W, rows, first_b,
                                   low_b, entries, n, codes)  # fmt: skip
            store(xs, 0, x0)
            store(xs, W, x1)
            store(xs, 2 * W, x2)
            store(xs, 3 * W, x3)
            store(pos, 0, p)
            for r in range(1, R):
                o = r * STATES * W
                x0, x1 = load(xs, o), load(xs, o + W)
                x2, x3 = load(xs, o + 2 * W), load(xs, o + 3 * W)
                p, end = load(pos, r * W), load(last, r * W)
                a, e = tier_at[block, r], tier_at[block, r + 1]
                while a < e:
                    read = minimum(p, end)
                    r0w, r1w = gather_pair(words, read), gather_pair(words, read + 2)
                    x0, p = _refine_step(x0, p, end, read, r0w, r1w, a, coded_b, cuts_b, D, prev,
                                         n)  # fmt: skip
                    if a + 1 < e:
                        x1, p = _refine_step(x1, p, end, read, r0w, r1w, a + 1, coded_b, cuts_b, D,
                                             prev, n)  # fmt: skip
                    if a + 2 < e:
                        x2, p = _refine_step(x2, p, end, read, r0w, r1w, a + 2, coded_b, cuts_b, D,
                                             prev, n)  # fmt: skip
                    if a + 3 < e:
                        x3, p = _refine_step(x3, p, end, read, r0w, r1w, a + 3, coded_b, cuts_b, D,
                                             prev, n)  # fmt: skip
                    a += 4
                store(xs, o, x0)
                store(xs, o + W, x1)
                store(xs, o + 2 * W, x2)
                store(xs, o + 3 * W, x3)
                store(pos, r * W, p)
            for lane in range(W):
                row = groups[lane] * group_stride + t * token_stride
                for d in range(0, D, W):
                    put_values(out, row + d, gather(n, load(fin_b, lane * D + d)), mu_b,
                               scale_b, lane * D + d)  # fmt: skip
        for lane in range(W):
            g = groups[lane]
            ok = True
            for r in range(R):
                if pos[r * W + lane] != wend[r, g]:
                    ok = False
                for i in range(STATES):
                    if xs[(r * STATES + i) * W + lane] != RANS_L:
                        ok = False
            status[g] = 0 if ok else 1


@njit(cache=True, nogil=True, error_model="numpy")
def _setup_blocks(k, order, depth, top, lo, base, refine_tid, cut_of, mean, fine, stride
                  ):  # pragma: no cover - jitted  # fmt: skip
    """:class:`BlockSetup`'s arrays (see it) for the blocks of ``order``."""
    G, D = depth.shape[1], depth.shape[2]
    R = k + 1
    B = (G + W - 1) // W
    tier_at = np.zeros((B, R + 1), np.int64)
    row_at = np.zeros(B + 1, np.int64)
    for b in range(B):  # each tier's steps in each block: the most lanes a group codes
        tier_at[b, 0], tier_at[b, 1] = 0, D
        for r in range(1, R):
            most = 0
            for lane in range(W):
                g = order[min(b * W + lane, G - 1)]
                q = 0
                for d in range(D):
                    if depth[r, g, d] != depth[r - 1, g, d]:
                        q += 1
                most = max(most, q)
            tier_at[b, r + 1] = tier_at[b, r] + most
        row_at[b + 1] = row_at[b] + tier_at[b, R]
    first = np.empty(B * D * W, np.uint32)
    low = np.empty(B * D * W, np.uint32)
    mu = np.empty(B * D * W, np.float32)
    scale = np.empty(B * D * W, np.float32)
    fin = np.empty(B * D * W, np.uint32)
    coded = np.zeros(row_at[B] * W, np.uint32)
    prev0 = np.zeros(row_at[B] * W, np.uint32)
    cuts = np.empty((row_at[B] - B * D) * 9 * W, np.uint32)  # refinement rows only
    for b in range(B):
        lanes, r0 = b * D * W, row_at[b]
        c0 = r0 - b * D  # the block's first refinement row among all blocks' refinement rows
        for lane in range(W):
            g = order[min(b * W + lane, G - 1)]
            for d in range(D):
                first[lanes + d * W + lane] = base[g, d] * _SLOTS
                low[lanes + d * W + lane] = np.uint32(np.int64(lo[g, d]) & 0xFFFFFFFF)
                fin[lanes + lane * D + d] = d * W + lane
                mu[lanes + lane * D + d] = mean[g, d]
                scale[lanes + lane * D + d] = (np.float32(_pow3(top[g, d] - depth[k, g, d]))
                                               * fine[g, d])  # fmt: skip
            for r in range(1, R):
                q = 0
                for d in range(D):
                    if depth[r, g, d] == depth[r - 1, g, d]:
                        continue
                    at = tier_at[b, r] + q
                    q += 1
                    coded[(r0 + at) * W + lane] = fin[lanes + lane * D + d]
                    fin[lanes + lane * D + d] = at * W + lane
                    prev0[(r0 + at) * W + lane] = 1
                    for parent in range(3):  # the parent's context, then the symbol's
                        tab = refine_tid[r - 1, parent, g, d]
                        for before in range(3):
                            c = ((c0 + at - D) * 9 + parent * 3 + before) * W + lane
                            cuts[c] = cut_of[tab + before * stride]
                # past its coded lanes: a table of one symbol of probability 1, which
                # changes nothing, and an index nothing reads (its own row's)
                for at in range(tier_at[b, r] + q, tier_at[b, r + 1]):
                    coded[(r0 + at) * W + lane] = at * W + lane
                    for c in range(9):
                        cuts[((c0 + at - D) * 9 + c) * W + lane] = _SLOTS | (_SLOTS << 16)
    return tier_at, row_at, first, low, mu, scale, fin, coded, cuts, prev0


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """How :func:`decode` takes a part's groups at tiers ``0..k``: ``order``, the groups
    in the order the blocks take them (:func:`block_order`), and ``steps``, each block's
    refinement steps a token (:func:`block_steps`). Made once per tiers and part by a
    decoder of many chunks (the codec keeps it with the profile): the order takes 1-2
    ms, and the steps and the threads' share of them took 0.085 ms of every chunk."""

    order: np.ndarray
    steps: np.ndarray
    _shared: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def blocks(self) -> np.ndarray:
        """The blocks in the order :func:`parallel.run` shares them out to the kernels'
        threads now (:func:`parallel.balance` of their steps), made once per count."""
        threads = parallel.get_threads()
        found = self._shared.get(threads)
        if found is None:
            found = self._shared[threads] = parallel.balance(self.steps)
        return found


def plan_blocks(k: int, depth: np.ndarray) -> BlockPlan:
    """The :class:`BlockPlan` of tiers ``0..k`` of groups of ``depth [R, G, D]``."""
    order = block_order(k, depth)
    steps = block_steps(k, depth, order)
    for a in (order, steps):
        a.flags.writeable = False  # kept with the profile and read by every chunk's decode
    return BlockPlan(order, steps)


@dataclass(frozen=True, eq=False)
class BlockSetup:
    """What each of a plan's blocks starts from, the same for every chunk of its groups
    at tiers ``0..k`` (made from the profile's arrays alone): each group's base tables,
    ranges, means and scales, where its lanes' last indices lie, and each refinement
    step's parent rows, previous symbols and cut points (nine contexts). Made once by
    :func:`block_setup` (the codec keeps it with the profile), so that a chunk's decode
    starts each block from views of it: filling these for every chunk took 0.4 ms of a
    ``nearlossless`` chunk's 7. Its memory: 28 bytes a lane of each group (and of a last
    block's copies), and 704 bytes each step of each block (nine cut points for sixteen
    lanes, a parent row and a previous symbol): 1.5 MB for all six tiers of the embedded
    model (1,601 steps), made in about 1 ms.

    The kernel reads these indices without checks: they are made here, within the
    blocks' own rows, and :func:`decode` takes a setup only for groups, lanes, tiers,
    stride and tables of its arrays' shapes (a setup of other arrays of those shapes
    decodes wrong values, never outside the arrays)."""

    plan: BlockPlan
    k: int
    shape: tuple[int, int, int]  # the depth's (tiers, groups, lanes)
    stride: int
    tables: int  # the vector tables it starts base steps in: at most this many
    arrays: tuple[np.ndarray, ...]  # _setup_blocks's, in its order
    most: int  # the rows of its largest block


def block_setup(plan: BlockPlan, k: int, depth: np.ndarray, lo: np.ndarray,
                base_tid: np.ndarray, refine_tid: np.ndarray, cum: np.ndarray,
                mean: np.ndarray, fine: np.ndarray, stride: int, tables: VectorTables
                ) -> BlockSetup:  # fmt: skip
    """The :class:`BlockSetup` of ``plan``'s blocks at tiers ``0..k`` (arrays as
    :func:`decode` takes them, the bases' ``tables`` as :func:`vector_tables` makes
    them); ValueError if the plan's order is not one of these groups."""
    R, G, D = depth.shape
    order = plan.order
    if not _permutes(order, G):
        raise ValueError("the block plan is not one of these groups")
    if len(plan.steps) != -(-G // W):
        raise ValueError("the block plan is not one of these groups")
    if not 0 <= k < R or np.shape(refine_tid) != (R - 1, 3, G, D) or any(
        np.shape(a) != (G, D) for a in (lo, base_tid, mean, fine)
    ):
        raise ValueError("the block setup's arrays do not fit the depth's tiers and groups")
    for tid in (base_tid, refine_tid):  # what the setup reads its tables at
        if np.size(tid) and (int(np.min(tid)) < 0 or int(np.max(tid)) + 2 * stride >= len(cum)):
            raise ValueError("a stream's table is not one of the decode tables")
    contexts = 3 if stride else 1
    if tables.source != len(cum) or tables.contexts != contexts:
        raise ValueError("the vector tables are not those of these decode tables")
    base = tables.index[np.asarray(base_tid, dtype=np.int64)]
    if base.size and (int(base.min()) < 0 or int(base.max()) + contexts > tables.tables):
        raise ValueError("a stream's base table is not one of the vector tables")
    cum = np.asarray(cum, dtype=np.int64)
    cut_of = (cum[:, 1] | (cum[:, 2] << 16)).astype(np.uint32)  # each ternary table's cuts
    depth = np.ascontiguousarray(depth, dtype=np.int64)
    arrays = _setup_blocks(
        k, order, depth, np.ascontiguousarray(depth[-1]),
        *(np.ascontiguousarray(a, dtype=np.int64) for a in (lo, base, refine_tid)), cut_of,
        *(np.ascontiguousarray(a, dtype=np.float32) for a in (mean, fine)), int(stride),
    )  # fmt: skip
    for a in arrays:
        a.flags.writeable = False  # shared by every chunk's decode
    row_at = arrays[1]
    return BlockSetup(plan, k, (R, G, D), stride, int(base.max(initial=0)) + contexts, arrays,
                      int(np.diff(row_at).max(initial=0)))  # fmt: skip


def _permutes(a: np.ndarray, n: int) -> bool:
    """Whether ``a`` is an int64 permutation of ``0..n-1`` (what the kernel indexes by)."""
    return a.dtype == np.int64 and a.shape == (n,) and np.array_equal(np.sort(a), np.arange(n))


def block_order(k: int, depth: np.ndarray) -> np.ndarray:
    """The groups in the order the blocks take them, ``W`` at a time (the last block the
    rest): a block steps through the most lanes any of its groups codes in each
    refinement tier, so blocks gather groups that code about as many in every tier.
    Greedy (a block starts from the group coding the most lanes left and takes the
    groups that add the fewest steps) and the groups sorted by their tiers' counts,
    each then with groups swapped between blocks while a swap saves steps; the better
    of the two. Tiers 1-5 of the embedded model's 180 groups: 1,601 steps a token
    against 1,849 sorted. 1-2 ms for 180 groups, 60-130 ms for 1,280; a decoder of many
    chunks makes it once per tiers and groups (the codec keeps it with the profile)."""
    G = depth.shape[1]
    if k == 0:
        return np.arange(G, dtype=np.int64)
    counts = coded_lanes(k, depth)
    by = np.argsort(-counts.sum(axis=0), kind="stable")  # the most coded lanes first
    tried = [_swapped(counts, W, start) for start in (_greedy(counts, W, by),
             np.lexsort(counts[::-1]).astype(np.int64))]  # fmt: skip
    return min(tried, key=lambda order: int(block_steps(k, depth, order).sum()))


def coded_lanes(k: int, depth: np.ndarray) -> np.ndarray:
    """``[k, G]``: how many lanes each group codes in each refinement tier ``1..k``."""
    return (depth[1 : k + 1] != depth[:k]).sum(axis=2).astype(np.int64)


def block_steps(k: int, depth: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The refinement steps a token of each block takes (blocks of ``order``, ``W`` groups
    at a time), the same for every token: what a block costs beyond the base's."""
    G = depth.shape[1]
    if k == 0:
        return np.zeros(-(-G // W), dtype=np.int64)
    counts = coded_lanes(k, depth)[:, order]
    padded = np.concatenate([counts, np.repeat(counts[:, -1:], -G % W, axis=1)], axis=1)
    return padded.reshape(k, -1, W).max(axis=2).sum(axis=0)


@njit(cache=True, nogil=True)
def _greedy(counts, width, by):  # pragma: no cover - jitted
    """Blocks filled one after another, each from the group coding the most lanes left
    (``by``: the groups in that order), with the groups that add the fewest steps."""
    k, G = counts.shape
    nb = (G + width - 1) // width
    used = np.zeros(G, np.bool_)
    member = np.zeros((nb, width), np.int64)
    top = np.zeros((nb, k), np.int64)  # each block's steps in each tier
    for b in range(nb):
        for s in range(min(width, G - b * width)):
            pick, least = -1, np.int64(1) << 62
            for q in range(G):
                g = by[q]
                if used[g]:
                    continue
                if s == 0:  # the block's first: the most lanes left
                    pick = g
                    break
                more = 0
                for r in range(k):
                    more += max(counts[r, g] - top[b, r], 0)
                if more < least:  # ties: the one coding the most lanes
                    pick, least = g, more
                    if more == 0:
                        break
            used[pick] = True
            member[b, s] = pick
            for r in range(k):
                top[b, r] = max(top[b, r], counts[r, pick])
    return member.reshape(-1)[:G].copy()  # every block full but the last


@njit(cache=True, nogil=True)
def _swapped(counts, width, order):  # pragma: no cover - jitted
    """``order`` with groups swapped between its blocks while a swap saves steps."""
    k, G = counts.shape
    nb = (G + width - 1) // width
    member = np.zeros((nb, width), np.int64)
    size = np.zeros(nb, np.int64)
    for at in range(G):
        member[at // width, at % width] = order[at]
        size[at // width] += 1
    # swaps: each block's steps without one of its groups are its tiers' largest
    # count, or the second largest where the group is the one with the largest
    best = np.zeros((nb, k), np.int64)
    which = np.zeros((nb, k), np.int64)  # the slot holding the largest
    second = np.zeros((nb, k), np.int64)
    for b in range(nb):
        _block_stats(counts, member, size, b, best, which, second)
    for _sweep in range(8):
        swapped = False
        for a in range(nb):
            for b in range(a + 1, nb):
                for i in range(size[a]):
                    for j in range(size[b]):
                        gi, gj = member[a, i], member[b, j]
                        change = 0
                        for r in range(k):
                            rest_a = second[a, r] if which[a, r] == i else best[a, r]
                            rest_b = second[b, r] if which[b, r] == j else best[b, r]
                            change += (max(rest_a, counts[r, gj]) - best[a, r]
                                       + max(rest_b, counts[r, gi]) - best[b, r])  # fmt: skip
                        if change < 0:
                            member[a, i], member[b, j] = gj, gi
                            _block_stats(counts, member, size, a, best, which, second)
                            _block_stats(counts, member, size, b, best, which, second)
                            swapped = True
        if not swapped:
            break
    return member.reshape(-1)[:G].copy()


@njit(cache=True, nogil=True)
def _block_stats(counts, member, size, b, best, which, second):  # pragma: no cover - jitted
    for r in range(counts.shape[0]):
        best[b, r], which[b, r], second[b, r] = -1, 0, 0
        for s in range(size[b]):
            c = counts[r, member[b, s]]
            if c > best[b, r]:
                second[b, r] = max(best[b, r], 0)
                best[b, r], which[b, r] = c, s
            elif c > second[b, r]:
                second[b, r] = c


def decode(k: int, words: np.ndarray, wbeg: np.ndarray, wend: np.ndarray, states: np.ndarray,
           lut: np.ndarray, cum: np.ndarray, mean: np.ndarray, fine: np.ndarray,
           depth: np.ndarray, lo: np.ndarray, base_tid: np.ndarray, refine_tid: np.ndarray,
           stride: int, out: np.ndarray, status: np.ndarray,
           tables: VectorTables | None = None,
           setup: BlockSetup | None = None) -> None:  # fmt: skip
    """:func:`kvcdn.kernels.nested.decode`'s work on arrays it has checked and typed
    (where :func:`usable`): each group's end check into ``status``. ``tables``:
    :func:`vector_tables` of ``lut``, ``cum``, ``base_tid`` and ``stride``, made now if
    not given; ``setup``: :func:`block_setup` of :func:`plan_blocks` and these
    arrays, likewise. The blocks are shared out so that each thread takes about as many
    refinement steps."""
    G = out.shape[0]
    if tables is None:
        tables = vector_tables(lut, cum, base_tid, stride)
    entries = tables.entries
    if (tables.source != lut.size // _SLOTS or entries.dtype != np.uint32 or entries.ndim != 1
            or not entries.flags.c_contiguous):  # fmt: skip  # its gathers ignore strides
        raise ValueError("the vector tables are not those of these decode tables")
    if setup is None:
        setup = block_setup(plan_blocks(k, depth), k, depth, lo, base_tid, refine_tid, cum,
                            mean, fine, stride, tables)  # fmt: skip
    # the kernel does not check the setup's indices: it must be one of arrays like these
    if (setup.k != k or setup.shape != depth.shape or setup.stride != stride
            or setup.tables > tables.tables):  # fmt: skip
        raise ValueError("the block setup is not one of these groups and tables")
    order, blocks = setup.plan.order, setup.plan.blocks()
    # the order again: its setup checked it, but a plan the caller made can change since
    if not (_permutes(blocks, -(-G // W)) and _permutes(order, G)):
        raise ValueError("the block plan is not one of these groups")
    parallel.run(
        _decode_blocks, len(blocks), blocks, order, k, words, wbeg, wend, states,
        entries, *setup.arrays[:2], setup.most, *setup.arrays[2:], stride, out, status,
    )  # fmt: skip
