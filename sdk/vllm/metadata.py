"""What the scheduler tells the workers each step, what the workers tell the scheduler,
and the block arithmetic both sides share."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvcdn.manifest import Manifest


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens ``[start, end)`` of ``manifest`` into ``block_ids``' slots (the
    request's blocks from token 0); ``sync``: within the step (docs/vllm.md)."""

    req_id: str
    manifest: Manifest
    start: int
    end: int
    block_ids: list[int]
    quality: str
    deadline_s: float | None
    sync: bool = False
    tenant: str = ""  # whose store it reads (ConnectorSetup.tenant_of; "": unsalted)

    def unfilled(self, loaded_to: int, block_size: int) -> set[int]:
        """The blocks vLLM must recompute after this load stopped at token ``loaded_to``."""
        return unfilled_blocks(self.block_ids, self.start, self.end, loaded_to, block_size)

    def loaded_to(self, failed: set[int], block_size: int) -> int:
        """Where this load stopped, from the blocks vLLM was told failed: the first
        failed block's first token (never before ``start``), else ``end``."""
        for index in range(self.start // block_size, -(-self.end // block_size)):
            if self.block_ids[index] in failed:
                return max(self.start, index * block_size)
        return self.end


def unfilled_blocks(block_ids: list[int], start: int, end: int, loaded_to: int,
                    block_size: int) -> set[int]:  # fmt: skip
    """The blocks of a load of tokens ``[start, end)`` that stopped at ``loaded_to``,
    for vLLM to recompute: the block holding the first token not loaded and every
    claimed block after it, never one wholly vLLM's own before ``start`` (a
    prefix-cache hit other requests may share; a load from inside a chunk that
    failed in that chunk stopped at the chunk's start, before ``start``)."""
    loaded_to = max(loaded_to, start)
    if loaded_to >= end:
        return set()
    bs = block_size
    return {b for i, b in enumerate(block_ids)
            if (i + 1) * bs > loaded_to and i * bs < end and (i + 1) * bs > start}  # fmt: skip


@dataclass(frozen=True)
class CaptureSpec:
    """Copy the KV of the first ``tokens`` tokens out of ``block_ids`` to ``path``."""

    req_id: str
    tokens: int
    block_ids: list[int]
    path: str


@dataclass
class KvcdnMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)
    idle: bool = False  # the step runs no model
    scheduled_tokens: int = 0  # tokens the step computes (its forward pass is timed)


@dataclass
class KvcdnWorkerMeta(KVConnectorWorkerMetadata):
    """What workers tell the scheduler: vLLM's prefill speed as they time it, and why
    a worker cannot load (the scheduler then claims nothing)."""

    seconds_per_token: float | None = None
    disabled: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvcdnWorkerMeta)
        speeds = [s for s in (self.seconds_per_token, other.seconds_per_token) if s]
        return KvcdnWorkerMeta(max(speeds, default=None), self.disabled or other.disabled)
