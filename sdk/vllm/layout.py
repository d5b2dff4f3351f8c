"""vLLM's KV memory: its paged cache tensors, how kvcdn writes a chunk's tokens into
them and reads a prompt's back, and the KV target a load decodes into."""

from __future__ import annotations

import copy
import logging
import os
import re

import numpy as np
import torch

from kvcdn.codecs import BlocksDest, ChunkDest, TensorDest
from kvcdn.container import Part
from kvcdn.errors import KvcdnError
from kvcdn.kernels.paged import gather_token_major, scatter_token_major
from kvcdn.kernels.permuted import PermutedBlocks
from kvcdn.models import ModelIdentity

from .metadata import LoadSpec

log = logging.getLogger(__name__)


class PagedLayout:
    """vLLM's KV cache tensors, one per layer, and how to write and read tokens in them.

    On CPU (``CPU_ATTN``) each layer is ``[blocks, heads, block_size, 2 * head_dim]``
    whose interior order depends on the CPU's attention kernel (AMX, AVX-512):
    tokens are written with vLLM's own op, and read back through the permutation
    that op is observed to apply. On CUDA (FlashAttention's layout) each layer is
    ``[2, blocks, block_size, heads, head_dim]``: token-major, written and read by
    indexing (:mod:`kvcdn.kernels.paged`).
    """

    def __init__(self, caches: dict[int, torch.Tensor], kind: str, block_size: int,
                 heads: int, head_dim: int) -> None:  # fmt: skip
        self.caches = caches
        self.kind = kind
        self.block_size = block_size
        self.heads = heads
        self.head_dim = head_dim
        first = next(iter(caches.values()))
        self.dtype = first.dtype
        self.device = str(first.device)
        self._isa: str | None = None
        self._k_perm: torch.Tensor | None = None
        self._v_perm: torch.Tensor | None = None
        # the CPU layout written by kvcdn's kernel: the layers' blocks as one numpy view
        # [layers, blocks, heads, K|V, block_size * head_dim], and where each element goes
        self._rows: np.ndarray | None = None
        #: The layers and KV heads of the model these caches hold (all, unless vLLM
        #: runs tensor- or pipeline-parallel).
        self.part = Part.whole(len(caches), heads)
        self._k_pos: np.ndarray | None = None
        self._v_pos: np.ndarray | None = None
        if kind == "cpu":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            self._isa = _get_attn_isa(self.dtype, block_size, head_dim)
            if self.dtype in (torch.bfloat16, torch.float32):
                self._k_perm, self._v_perm = self._probe_cpu_order()
                self._k_pos = torch.argsort(self._k_perm).numpy()
                self._v_pos = torch.argsort(self._v_perm).numpy()
                self._rows = _stacked_rows(caches, heads, block_size * head_dim)

    @classmethod
    def detect(cls, kv_caches: dict[str, torch.Tensor], model: ModelIdentity,
               block_size: int, rank: tuple[int, int] = (0, 1)) -> PagedLayout:  # fmt: skip
        """The layout of this worker's caches: the layers it holds (all, or a pipeline
        stage's) and, at tensor-parallel ``rank`` ``(rank, size)``, its KV heads."""
        layout = model.layout
        by_layer: dict[int, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            m = re.search(r"layers\.(\d+)\.", name)
            if m is None:
                raise KvcdnError(f"unexpected KV cache layer name {name!r}")
            by_layer[int(m.group(1))] = tensor
        held = sorted(by_layer)
        if not held or held != list(range(held[0], held[-1] + 1)) or held[-1] >= layout.layers:
            raise KvcdnError(
                f"vLLM has KV for layers {held[:4]}..., {model.name} has {layout.layers}"
            )
        heads = rank_heads(layout.kv_heads, *rank)
        part = Part((held[0], held[-1] + 1), heads)
        caches = {layer - held[0]: tensor for layer, tensor in by_layer.items()}
        first = caches[0]
        if first.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise KvcdnError(f"vLLM's KV cache is {first.dtype}: kvcdn loads float KV only")
        h, d, bs = part.head_count, layout.head_dim, block_size
        shape = tuple(first.shape)
        if first.device.type == "cpu" and len(shape) == 4 and shape[1:] == (h, bs, 2 * d):
            kind = "cpu"
        elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, h, d):
            kind = "flash"
        else:
            raise KvcdnError(
                f"vLLM's KV cache layout {shape} on {first.device.type} is not one kvcdn writes "
                f"({h} heads x {d}, blocks of {bs})"
            )
        made = cls(caches, kind, bs, h, d)
        made.part = part
        return made

    def warm_up(self) -> None:
        """Load the decode and write kernels (and the planner's search) now, not on the
        first request's clock."""
        from kvcdn import codec
        from kvcdn.sdk import planner

        device = self.device
        try:
            codec.warm_up(device, torch.float32 if device == "cpu" else self.dtype, self.head_dim)
            empty = torch.empty((len(self.caches), 2, self.heads, 0, self.head_dim))
            self.write(empty.to(device), [], 0)
            into = self.permuted([], 0, 0, 0, 0)
            if into is not None:  # the decoders that write into these blocks
                from kvcdn.kernels import rans_numba

                rans_numba.warm_up_permuted(into)
            planner.warm_up()
        except Exception as exc:  # only a first load's speed depends on it
            log.info("kvcdn: warming the decoder up failed: %s", exc)

    def layers(self, first: int, end: int) -> PagedLayout:
        """The same caches, of this worker's layers ``[first, end)`` only (counted from its
        first): what a layer-ordered load fills one group at a time."""
        if not 0 <= first < end <= len(self.caches):
            raise ValueError(f"layers {first}..{end} are not within {len(self.caches)}")
        sub = copy.copy(self)
        sub.caches = {layer - first: self.caches[layer] for layer in range(first, end)}
        if self._rows is not None:
            sub._rows = self._rows[first:end]
        l0 = self.part.layers[0]
        sub.part = Part((l0 + first, l0 + end), self.part.heads)
        return sub

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        blocks = torch.tensor(block_ids, dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.long)
        return (blocks[positions // bs] * bs + positions % bs).to(self.device)

    def permuted(self, block_ids: list[int], first: int, tokens: int, lo: int, hi: int
                 ) -> PermutedBlocks | None:  # fmt: skip
        """Where kvcdn's CPU kernels write a chunk of ``tokens`` whose token 0 is the
        request's token ``first``, its tokens ``lo .. hi`` only; None for a layout they
        do not write."""
        if self._rows is None:
            return None
        from kvcdn.kernels.permuted import PermutedBlocks

        assert self._k_pos is not None and self._v_pos is not None
        blocks = np.asarray(block_ids, dtype=np.int64)
        return PermutedBlocks(self._rows, blocks, first, lo, hi, self._k_pos, self._v_pos,
                              tokens, self.head_dim)  # fmt: skip

    def write(self, kv: torch.Tensor, block_ids: list[int], start: int) -> None:
        """Write ``kv`` (``[L, 2, H, T, D]``, tokens ``start .. start + T``) into the slots
        of ``block_ids`` (the request's blocks from token 0)."""
        into = self.permuted(block_ids, start, kv.shape[3], 0, kv.shape[3])
        if into is not None and kv.device.type == "cpu" and kv.dtype == torch.float32:
            from kvcdn.kernels.paged_cpu import write_permuted

            write_permuted(kv.numpy(), into)
            return
        self.write_with_op(kv, block_ids, start)

    def write_with_op(self, kv: torch.Tensor, block_ids: list[int], start: int) -> None:
        """:meth:`write` with vLLM's own CPU op (float16 caches; the kernel's reference),
        or by indexing into the token-major layout."""
        slots = self._slots(block_ids, start, start + kv.shape[3])
        for layer, cache in self.caches.items():
            k = kv[layer, 0].transpose(0, 1).to(self.dtype).contiguous()  # [T, H, D]
            v = kv[layer, 1].transpose(0, 1).to(self.dtype).contiguous()
            if self.kind == "cpu":
                from vllm import _custom_ops as ops

                nb = cache.shape[0]
                kc, vc = cache.view(nb, self.heads, 2 * self.block_size, self.head_dim).chunk(2, 2)
                ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, self._isa)
            else:
                scatter_token_major(cache[0], k, slots)
                scatter_token_major(cache[1], v, slots)

    def read(self, block_ids: list[int], tokens: int) -> torch.Tensor:
        """The KV ``[L, 2, H, tokens, D]`` (float32, on the CPU) of the first ``tokens``
        tokens held in ``block_ids``."""
        slots = self._slots(block_ids, 0, tokens)
        out = torch.empty(
            (len(self.caches), 2, self.heads, tokens, self.head_dim), dtype=torch.float32
        )
        for layer, cache in self.caches.items():
            if self.kind == "cpu":
                k, v = self._read_cpu(cache, block_ids, tokens)
            else:
                k = gather_token_major(cache[0], slots)
                v = gather_token_major(cache[1], slots)
            out[layer, 0] = k.transpose(0, 1).float().cpu()
            out[layer, 1] = v.transpose(0, 1).float().cpu()
        return out

    def _read_cpu(self, cache: torch.Tensor, block_ids: list[int], tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """K and V ``[tokens, H, D]`` from CPU blocks, by the inverse of the write op."""
        if self._k_perm is None:
            self._k_perm, self._v_perm = self._probe_cpu_order()
        assert self._v_perm is not None
        h, d, bs = self.heads, self.head_dim, self.block_size
        n = -(-tokens // bs)
        blocks = cache[torch.tensor(block_ids[:n], dtype=torch.long)].view(n, h, 2, bs * d)
        k = torch.empty((n, h, bs * d), dtype=cache.dtype)
        v = torch.empty((n, h, bs * d), dtype=cache.dtype)
        k[:, :, self._k_perm] = blocks[:, :, 0]  # position p holds element perm[p]
        v[:, :, self._v_perm] = blocks[:, :, 1]
        k = k.view(n, h, bs, d).permute(0, 2, 1, 3).reshape(n * bs, h, d)[:tokens]
        v = v.view(n, h, bs, d).permute(0, 2, 1, 3).reshape(n * bs, h, d)[:tokens]
        return k, v

    def _probe_cpu_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where vLLM's CPU write op puts each element of a block's K and V.

        vLLM has no op that reads its CPU layout back, and the order differs by
        kernel (AMX packs pairs of tokens, AVX-512 transposes K). Writing each
        element's own index (in two bf16-exact parts below 256) through the op
        into a scratch block shows where it goes, once per process.
        """
        from vllm import _custom_ops as ops

        h, d, bs = self.heads, self.head_dim, self.block_size
        scratch = torch.zeros((1, h, bs, 2 * d), dtype=self.dtype)
        kc, vc = scratch.view(1, h, 2 * bs, d).chunk(2, 2)
        element = torch.arange(bs * d).view(bs, 1, d).expand(bs, h, d)  # index within a head
        seen = []
        for part in (element % 256, element // 256):
            scratch.zero_()
            p = part.to(self.dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(p, p, kc, vc, torch.arange(bs), self._isa)
            seen.append(scratch.view(h, 2, bs * d).long())
        where = seen[0] + 256 * seen[1]  # [H, 2, bs * d]: the element at each position
        k_perm, v_perm = where[0, 0], where[0, 1]
        expected = torch.arange(bs * d)
        if not (torch.equal(k_perm.sort().values, expected)
                and torch.equal(v_perm.sort().values, expected)
                and torch.equal(where[:, 0], k_perm.expand(h, -1))
                and torch.equal(where[:, 1], v_perm.expand(h, -1))):  # fmt: skip
            raise KvcdnError("vLLM's CPU KV layout is not a per-head permutation of tokens")
        return k_perm, v_perm


def _stacked_rows(caches: dict[int, torch.Tensor], heads: int, row: int) -> np.ndarray | None:
    """The CPU caches of layers ``0 .. L-1`` as one numpy view ``[L, blocks, heads, 2,
    row]`` (bfloat16 as uint16 bits), when the layers sit at equal steps in one buffer
    (as vLLM allocates them); None otherwise (each layer is then written by vLLM's op)."""
    first = caches[0]
    as_bits = torch.int16 if first.dtype == torch.bfloat16 else first.dtype
    nb = first.shape[0]
    layers = [caches[i].view(as_bits).view(nb, heads, 2, row) for i in range(len(caches))]
    base = layers[0]
    size = base.element_size()
    step = (layers[1].data_ptr() - base.data_ptr()) // size if len(layers) > 1 else base.numel()
    regular = step >= base.numel() and all(
        t.shape == base.shape and t.stride() == base.stride()
        and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and t.data_ptr() - base.data_ptr() == i * step * size
        for i, t in enumerate(layers)
    )  # fmt: skip
    if not regular:
        return None
    stacked = torch.as_strided(
        base, (len(layers), *base.shape), (step, *base.stride()), base.storage_offset()
    ).numpy()
    return stacked.view(np.uint16) if first.dtype == torch.bfloat16 else stacked


def rank_heads(kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The KV heads ``[first, end)`` tensor-parallel rank ``rank`` of ``size`` holds, as
    vLLM splits them: ``kv_heads / size`` each, or, with more ranks than heads, each
    head replicated on ``size / kv_heads`` consecutive ranks."""
    if size <= 1:
        return (0, kv_heads)
    if kv_heads % size == 0:
        n = kv_heads // size
        return (rank * n, rank * n + n)
    if size % kv_heads == 0:
        head = rank // (size // kv_heads)
        return (head, head + 1)
    raise KvcdnError(f"{kv_heads} KV heads do not split over {size} tensor-parallel ranks")


class PagedTarget:
    """A :class:`~kvcdn.sdk.KVTarget` over vLLM's blocks, of which only the tokens the
    load claimed are written (vLLM has the others). In vLLM's CPU layouts a chunk is
    decoded straight into the blocks; otherwise into a staging tensor of one chunk,
    written to the blocks once decoded from verified bytes (the loader decodes one
    chunk at a time, so one chunk is staged at a time)."""

    def __init__(self, layout: PagedLayout, spec: LoadSpec) -> None:
        self.layout = layout
        self.spec = spec
        self.tokens = spec.end
        self.part: Part | None = layout.part
        # decoded in float32 on the CPU (the codec's exact output), cast when written
        self.dtype = torch.float32 if layout.device == "cpu" else layout.dtype
        self._staged: dict[int, torch.Tensor] = {}

    def chunk(self, start: int, end: int) -> ChunkDest:
        lo, hi = max(start, self.spec.start), min(end, self.spec.end)
        into = self.layout.permuted(self.spec.block_ids, start, end - start, lo - start,
                                    max(lo, hi) - start)  # fmt: skip
        if into is not None:
            return BlocksDest(into)
        shape = (len(self.layout.caches), 2, self.layout.heads, end - start, self.layout.head_dim)
        staged = torch.empty(shape, dtype=self.dtype, device=self.layout.device)
        self._staged[start] = staged
        return TensorDest(staged)

    def prefix(self, end: int) -> torch.Tensor:
        raise KvcdnError("an engine's load does not recompute chunks")

    def finish(self) -> None:
        pass  # vLLM's blocks are the result

    def commit(self, start: int, end: int) -> None:
        staged = self._staged.pop(start, None)
        if staged is None:
            return  # decoded into the blocks
        lo, hi = max(start, self.spec.start), min(end, self.spec.end)
        if lo < hi:
            self.layout.write(staged[:, :, :, lo - start : hi - start], self.spec.block_ids, lo)


def write_capture(kv: torch.Tensor, path: str, part: Part, whole: Part) -> None:
    """A worker's captured KV ``kv`` (its ``part`` of the model's ``whole``) to ``path``
    as safetensors, atomically (a reader never sees part of it). A worker holding part
    of the heads or layers writes ``{ID}.part-{l0}-{l1}-{h0}-{h1}.safetensors`` beside
    where the whole would go; :func:`read_capture` puts the parts together."""
    from safetensors.torch import save_file

    if part != whole:
        (l0, l1), (h0, h1) = part.layers, part.heads
        path = f"{path.removesuffix('.safetensors')}.part-{l0}-{l1}-{h0}-{h1}.safetensors"
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file({"kv": kv.contiguous()}, tmp)
    os.replace(tmp, path)


_PART_FILE = re.compile(r"\.part-(\d+)-(\d+)-(\d+)-(\d+)\.safetensors$")


def read_capture(folder: str, capture_id: str, layers: int, heads: int) -> torch.Tensor | None:
    """The KV ``[L, 2, H, T, D]`` captured for ``capture_id`` in ``folder``: its one file,
    or its workers' parts put together (heads a tensor-parallel worker replicates are
    taken once), the files removed; None when nothing was captured.
    :class:`KvcdnError` when the parts do not cover every layer and head once."""
    from pathlib import Path

    from safetensors.torch import load_file

    base = Path(folder)
    whole = base / f"{capture_id}.safetensors"
    if whole.is_file():
        try:
            return load_file(whole)["kv"]
        finally:
            whole.unlink()
    files = sorted(base.glob(f"{capture_id}.part-*.safetensors"))
    if not files:
        return None
    out: torch.Tensor | None = None
    covered = torch.zeros((layers, heads), dtype=torch.bool)
    try:
        for path in files:
            m = _PART_FILE.search(path.name)
            kv = load_file(path)["kv"]
            if m is None:
                raise KvcdnError(f"unexpected capture file {path.name}")
            l0, l1, h0, h1 = map(int, m.groups())
            if not (0 <= l0 < l1 <= layers and 0 <= h0 < h1 <= heads) or kv.shape[:3] != (
                    l1 - l0, 2, h1 - h0):  # fmt: skip
                raise KvcdnError(f"capture part {path.name} does not fit {layers} x {heads}")
            if out is None:
                out = torch.empty((layers, 2, heads, *kv.shape[3:]), dtype=kv.dtype)
            out[l0:l1, :, h0:h1] = kv
            covered[l0:l1, h0:h1] = True
    finally:
        for path in files:
            path.unlink(missing_ok=True)
    if not bool(covered.all()):
        raise KvcdnError(f"the captured parts of {capture_id} miss some layers or heads")
    return out
