"""Writing and reading tokens in vLLM's paged KV layouts, exactly.

The CPU layout is written with vLLM's own op and read back through the
permutation kvcdn observes it to apply (needs vLLM); the token-major CUDA
(FlashAttention) layout is written and read by indexing, on the CPU here and
on a GPU when there is one.
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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_layout_written_by_vllms_op_reads_back_exactly(dtype):
    from kvcdn.sdk.vllm import _PagedLayout

    layers, heads, dim, blocks, tokens = 3, 3, 64, 12, 700
    identity = ModelIdentity(
        name="test", fingerprint="0" * 64, layout=KVLayout(layers, heads, dim, "float32"),
        vocab_size=100, context_window=4096, folder="",
    )  # fmt: skip
    shape = (blocks, heads, BLOCK, 2 * dim)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype) for i in range(layers)
    }
    paged = _PagedLayout.detect(caches, identity, BLOCK)
    assert paged.kind == "cpu"
    kv = torch.randn((layers, 2, heads, tokens, dim)).to(dtype).float()
    block_ids = [7, 2, 9]
    paged.write(kv[:, :, :, :300], block_ids, 0)
    paged.write(kv[:, :, :, 300:], block_ids, 300)
    assert torch.equal(paged.read(block_ids, tokens), kv)
    assert not torch.stack([c[[0, 1, 3, 4, 5, 6, 8, 10, 11]] for c in caches.values()]).any()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_layout_kvcdn_does_not_know_is_refused():
    from kvcdn.errors import KvcdnError
    from kvcdn.sdk.vllm import _PagedLayout

    identity = ModelIdentity(
        name="test", fingerprint="0" * 64, layout=KVLayout(1, 3, 64, "float32"),
        vocab_size=100, context_window=4096, folder="",
    )  # fmt: skip
    with pytest.raises(KvcdnError, match="layout"):
        _PagedLayout.detect({"model.layers.0.attn": torch.zeros((4, 3, 64, BLOCK))},
                            identity, BLOCK)  # fmt: skip
    with pytest.raises(KvcdnError, match="float KV"):
        _PagedLayout.detect({"model.layers.0.attn": torch.zeros((4, 3, BLOCK, 128),
                                                                dtype=torch.int8)},
                            identity, BLOCK)  # fmt: skip
