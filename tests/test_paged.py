"""Writing and reading tokens in vLLM's paged KV layouts, exactly.

The CPU layout is written by kvcdn's kernel (bit-identical to vLLM's own op) and
read back through the permutation kvcdn observes the op to apply (needs vLLM);
the token-major CUDA (FlashAttention) layout is written and read by indexing, on
the CPU here and on a GPU when there is one.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from kvcdn.kernels.paged import gather_token_major, scatter_token_major
from kvcdn.kv import KVLayout
from kvcdn.models import ModelIdentity

BLOCK = 256


def _slots(block_ids: list[int], tokens: int) -> torch.Tensor:
    pos = torch.arange(tokens)
    return torch.tensor(block_ids)[pos // BLOCK] * BLOCK + pos % BLOCK


def _token_major_round_trip(device: str, dtype: torch.dtype) -> float:
    gen = torch.Generator().manual_seed(0)
    heads, dim, tokens, blocks = 8, 128, 2048, 64
    cache = torch.zeros((2, blocks, BLOCK, heads, dim), dtype=dtype, device=device)
    k = torch.randn((tokens, heads, dim), generator=gen).to(dtype).to(device)
    v = torch.randn((tokens, heads, dim), generator=gen).to(dtype).to(device)
    block_ids = [int(b) for b in torch.randperm(blocks, generator=gen)[: tokens // BLOCK]]
    slots = _slots(block_ids, tokens).to(device)
    started = time.perf_counter()
    scatter_token_major(cache[0], k, slots)
    scatter_token_major(cache[1], v, slots)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    # the reference: each token's row, put by hand where its slot says
    for t in (0, 1, BLOCK - 1, BLOCK, tokens - 1):
        b, o = block_ids[t // BLOCK], t % BLOCK
        assert torch.equal(cache[0, b, o], k[t]) and torch.equal(cache[1, b, o], v[t])
    assert torch.equal(gather_token_major(cache[0], slots), k)
    assert torch.equal(gather_token_major(cache[1], slots), v)
    untouched = sorted(set(range(blocks)) - set(block_ids))
    assert not cache[:, untouched].any()
    return seconds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_major_layout_round_trip_on_cpu(dtype):
    _token_major_round_trip("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_major_layout_round_trip_on_cuda(dtype):
    _token_major_round_trip("cuda", dtype)  # loads the kernels
    seconds = min(_token_major_round_trip("cuda", dtype) for _ in range(5))
    print(f"CUDA write of 2,048 tokens x 8 heads x 128 ({dtype}): {seconds * 1e3:.3f} ms")


def _identity(layers: int, heads: int, dim: int) -> ModelIdentity:
    return ModelIdentity(
        name="test", fingerprint="0" * 64, layout=KVLayout(layers, heads, dim, "float32"),
        vocab_size=100, context_window=4096, folder="",
    )  # fmt: skip


def _cpu_caches(layers: int, shape: tuple[int, ...], dtype: torch.dtype, stacked: bool
                ) -> dict[str, torch.Tensor]:  # fmt: skip
    """Layer caches as vLLM allocates them (``stacked``: equal steps in one buffer),
    or as separate tensors (kvcdn then writes each with vLLM's op)."""
    if stacked:
        buffer = torch.zeros((layers, *shape), dtype=dtype)
        return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(layers)}
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype)
            for i in range(layers)}  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("stacked", [True, False], ids=["one-buffer", "separate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_layout_written_by_kvcdn_reads_back_exactly(dtype, stacked):
    from kvcdn.sdk.vllm.layout import PagedLayout

    layers, heads, dim, blocks, tokens = 3, 3, 64, 12, 700
    caches = _cpu_caches(layers, (blocks, heads, BLOCK, 2 * dim), dtype, stacked)
    paged = PagedLayout.detect(caches, _identity(layers, heads, dim), BLOCK)
    assert paged.kind == "cpu"
    kv = torch.randn((layers, 2, heads, tokens, dim)).to(dtype).float()
    block_ids = [7, 2, 9]
    paged.write(kv[:, :, :, :300], block_ids, 0)
    paged.write(kv[:, :, :, 300:], block_ids, 300)
    assert torch.equal(paged.read(block_ids, tokens), kv)
    assert not torch.stack([c[[0, 1, 3, 4, 5, 6, 8, 10, 11]] for c in caches.values()]).any()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("block_size", [16, 64, 256])  # vLLM picks its CPU kernel by block size
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kvcdns_cpu_write_is_bit_identical_to_vllms_op(dtype, block_size):
    """The numba kernel (one pass over a vLLM-style buffer) against vLLM's own
    ``cpu_attn_reshape_and_cache``, on unrounded float32 values (so bfloat16 rounding
    is compared too), infinities and a subnormal, with writes that start and end
    inside blocks."""
    from kvcdn.sdk.vllm.layout import PagedLayout

    layers, heads, dim, blocks, tokens = 3, 3, 64, 60, 700
    shape = (blocks, heads, block_size, 2 * dim)
    ours, theirs = (_cpu_caches(layers, shape, dtype, stacked=True) for _ in range(2))
    identity = _identity(layers, heads, dim)
    paged, reference = (PagedLayout.detect(c, identity, block_size) for c in (ours, theirs))
    assert paged._rows is not None  # the kernel's path, not the op's
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn((layers, 2, heads, tokens, dim), generator=gen) * 3
    kv[0, 0, 0, 0, :3] = torch.tensor([float("inf"), -float("inf"), 1e-40])
    block_ids = torch.randperm(blocks, generator=gen)[: -(-tokens // block_size)].tolist()
    for lo, hi in ((0, 300), (300, 301), (301, tokens)):
        paged.write(kv[:, :, :, lo:hi], block_ids, lo)
        reference.write_with_op(kv[:, :, :, lo:hi], block_ids, lo)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for name in ours:
        assert torch.equal(ours[name].view(bits), theirs[name].view(bits)), name
    assert ours["model.layers.0.self_attn.attn"].any()


def test_permuted_write_refuses_what_does_not_fit():
    import numpy as np

    from kvcdn.kernels.paged_cpu import write_permuted
    from kvcdn.kernels.permuted import PermutedBlocks

    cache = np.zeros((2, 4, 3, 2, 16 * 8), dtype=np.uint16)  # 2 layers, 4 blocks of 16
    kv = np.zeros((2, 2, 3, 20, 8), dtype=np.float32)
    pos = np.arange(16 * 8)

    def into(blocks, first=0, lo=0, hi=20, k_pos=pos, tokens=20, dim=8):
        return PermutedBlocks(cache, np.array(blocks), first, lo, hi, k_pos, k_pos, tokens, dim)

    write_permuted(kv, into([3, 0]))
    write_permuted(kv, into([3, 0, 4], first=12, lo=0, hi=20))  # the unused id is not read
    with pytest.raises(ValueError, match="outside the cache"):
        write_permuted(kv, into([3, 4]))
    with pytest.raises(ValueError, match="do not fit"):
        write_permuted(kv, into([3, 0], first=20))
    with pytest.raises(ValueError, match="tokens"):
        write_permuted(kv, into([3, 0], lo=5, hi=21))
    with pytest.raises(ValueError, match="float32"):
        write_permuted(kv.astype(np.float64), into([3, 0]))
    with pytest.raises(ValueError, match="permutations"):
        write_permuted(kv, into([3, 0], k_pos=pos[:-1]))
    # values of another shape than the destination's chunk (4 lanes would make blocks
    # of 32 tokens: the kernel would write into blocks the claim does not own)
    with pytest.raises(ValueError, match="lanes given"):
        write_permuted(np.zeros((2, 2, 3, 40, 4), dtype=np.float32), into([3, 0], hi=40))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_layout_kvcdn_does_not_know_is_refused():
    from kvcdn.errors import KvcdnError
    from kvcdn.sdk.vllm.layout import PagedLayout

    identity = _identity(1, 3, 64)
    with pytest.raises(KvcdnError, match="layout"):
        PagedLayout.detect({"model.layers.0.attn": torch.zeros((4, 3, 64, BLOCK))},
                            identity, BLOCK)  # fmt: skip
    with pytest.raises(KvcdnError, match="float KV"):
        PagedLayout.detect({"model.layers.0.attn": torch.zeros((4, 3, BLOCK, 128),
                                                                dtype=torch.int8)},
                            identity, BLOCK)  # fmt: skip


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_tensor_parallel_rank_holds_the_heads_vllm_gives_it():
    """vLLM splits KV heads evenly over ranks, or replicates each over ``size / heads``
    consecutive ranks when there are more ranks than heads (QKVParallelLinear)."""
    from kvcdn.errors import KvcdnError
    from kvcdn.sdk.vllm.layout import rank_heads

    assert rank_heads(4, 0, 1) == (0, 4)
    assert [rank_heads(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [rank_heads(8, r, 8) for r in range(8)] == [(h, h + 1) for h in range(8)]
    assert [rank_heads(2, r, 8) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    with pytest.raises(KvcdnError, match="do not split"):
        rank_heads(3, 0, 2)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_pipeline_stage_holds_its_layers_and_a_rank_its_heads():
    """A stage's caches carry the global layer numbers of its layers; a rank's, its
    share of the heads: the layout knows which part of each object it loads."""
    from kvcdn.container import Part
    from kvcdn.errors import KvcdnError
    from kvcdn.sdk.vllm.layout import PagedLayout

    caches = _cpu_caches(4, (8, 2, BLOCK, 128), torch.bfloat16, stacked=True)
    stage = {n.replace(f".{i}.", f".{i + 4}."): t
             for i, (n, t) in enumerate(caches.items())}  # layers 4-7 of 8  # fmt: skip
    paged = PagedLayout.detect(stage, _identity(8, 4, 64), BLOCK, (1, 2))
    assert paged.part == Part((4, 8), (2, 4))
    assert sorted(paged.caches) == [0, 1, 2, 3]
    gap = dict(list(stage.items())[:1] + list(stage.items())[2:])
    with pytest.raises(KvcdnError, match="layers"):
        PagedLayout.detect(gap, _identity(8, 4, 64), BLOCK, (1, 2))
