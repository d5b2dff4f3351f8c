"""vLLM as a publisher's prefill (``kvcdn publish --engine vllm``): an engine whose
kvcdn connector captures each prompt's KV when its prefill completes."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch

from kvcdn.errors import KvcdnError
from kvcdn.models import model_identity

from .config import CAPTURE_PARAM, LOAD_PARAM
from .layout import read_capture

#: What ``dtype`` may be given to :func:`engine_dtype`: vLLM's own names.
ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU runs bfloat16 matrix products at speed: oneDNN's bfloat16
    kernels need AVX-512 (or AMX). Without them (AVX2-only CPUs such as AMD's Zen 2 and
    3) torch falls back to kernels about 7x slower than float32's."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN, or without the query
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def engine_dtype(dtype: str = "auto", *, cuda: bool | None = None) -> str:
    """The dtype to start a vLLM engine with. ``dtype`` as given, but ``"auto"`` is
    vLLM's own choice (the model's dtype; bfloat16 on a CPU) on a GPU and on a CPU
    that computes bfloat16 at speed, and float32 on a CPU that does not, where vLLM's
    bfloat16 prefill runs several times slower than float32's (``kvcdn publish`` of 981
    tokens with the embedded model on an AMD EPYC: 13.4 s of prefill against 4.2 s).
    ``cuda``: whether the engine runs on a GPU (default: whether torch sees one)."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: one of {', '.join(ENGINE_DTYPES)}")
    if cuda is None:
        cuda = torch.cuda.is_available()
    if dtype != "auto" or cuda or cpu_computes_bfloat16():
        return dtype
    return "float32"


def producer_config(capture_dir: str, model: str | None = None, *, role: str = "kv_producer",
                    **extra: Any) -> Any:  # fmt: skip
    """vLLM's ``KVTransferConfig`` for this connector capturing into ``capture_dir``."""
    from vllm.config import KVTransferConfig

    config: dict[str, Any] = {"capture_dir": capture_dir, **extra}
    if model is not None:
        config["model"] = model
    return KVTransferConfig(
        kv_connector="KvcdnConnector", kv_connector_module_path="kvcdn.sdk.vllm", kv_role=role,
        kv_load_failure_policy="recompute", kv_connector_extra_config=config,
    )  # fmt: skip


class VllmPrefill:
    """vLLM as a publisher's prefill: ``prefill(ids)`` runs a document's tokens
    through ``llm`` (whose kvcdn connector captures into ``capture_dir``, see
    :func:`producer_config`) and returns their KV ``[L, 2, H, T, D]`` as float32:
    what ``kvcdn publish --engine vllm`` encodes and publishes."""

    def __init__(self, llm: Any, capture_dir: str, layers: int, kv_heads: int) -> None:
        self.llm = llm
        self.capture_dir = Path(capture_dir)
        self.layers, self.kv_heads = layers, kv_heads

    @classmethod
    def start(cls, model: str | None, capture_dir: str, *, block_size: int = 256,
              dtype: str = "auto", **engine: Any) -> VllmPrefill:  # fmt: skip
        """A vLLM engine for ``model`` (a kvcdn model name) with a capturing connector,
        computing in ``dtype`` (resolved by :func:`engine_dtype`); ``engine``: more of
        ``vllm.LLM``'s arguments (``tensor_parallel_size``: each worker captures its
        heads, put together here)."""
        from vllm import LLM

        identity = model_identity(model)
        llm = LLM(
            model=identity.folder,
            kv_transfer_config=producer_config(capture_dir, model or identity.name),
            block_size=block_size, enable_prefix_caching=False,
            max_model_len=identity.context_window, dtype=engine_dtype(dtype), **engine,
        )  # fmt: skip
        return cls(llm, capture_dir, identity.layout.layers, identity.layout.kv_heads)

    def __call__(self, ids: list[int]) -> torch.Tensor:
        from vllm import SamplingParams

        capture_id = uuid.uuid4().hex
        params = SamplingParams(max_tokens=1, extra_args={
            "kv_transfer_params": {CAPTURE_PARAM: capture_id, LOAD_PARAM: False}})  # fmt: skip
        self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        kv = read_capture(str(self.capture_dir), capture_id, self.layers, self.kv_heads)
        if kv is None:
            raise KvcdnError("vLLM ran the prefill but its KV was not captured (see its log)")
        return kv
