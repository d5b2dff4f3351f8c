"""KV layout and chunking: how a document's tokens become chunks with identities.

A chunk's identity is a prefix-chained hash: sha256 over the model fingerprint,
the previous chunk's hash and this chunk's token ids. A chunk's KV depends on
every token before it, so two chunks are interchangeable exactly when their
whole prefix is; the chain makes that one comparison of hashes, and lets an
unchanged prefix be shared across versions and documents.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV: ``[layers, 2, kv_heads, tokens, head_dim]``."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # the dtype the model computes KV in

    def elements(self, tokens: int) -> int:
        """Number of K and V elements for ``tokens`` tokens."""
        return self.layers * 2 * self.kv_heads * tokens * self.head_dim

    def to_json(self) -> dict:
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int  # first token, inclusive
    end: int  # last token, exclusive
    hash: str  # hex sha256 of the chain up to and including this chunk


def chain_hash(fingerprint: str, previous: str, token_ids: list[int]) -> str:
    digest = hashlib.sha256()
    digest.update(b"kvcdn-chunk-v1\0")
    digest.update(fingerprint.encode())
    digest.update(b"\0")
    digest.update(previous.encode())
    digest.update(b"\0")
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.hexdigest()


def split_chunks(fingerprint: str, token_ids: list[int], chunk_tokens: int) -> list[Chunk]:
    """Cut ``token_ids`` into chunks of ``chunk_tokens`` (the last may be shorter)."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    chunks: list[Chunk] = []
    previous = ""
    for index, start in enumerate(range(0, len(token_ids), chunk_tokens)):
        end = min(start + chunk_tokens, len(token_ids))
        previous = chain_hash(fingerprint, previous, token_ids[start:end])
        chunks.append(Chunk(index=index, start=start, end=end, hash=previous))
    return chunks
