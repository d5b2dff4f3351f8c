"""KV targets: where a load decodes a document's chunks.

The loader never builds a cache itself. It asks a target for the place that
chunk ``[start, end)`` of the document goes to (all layers, keys and values: a
:class:`~kvcdn.codecs.ChunkDest`), decodes or recomputes the chunk straight into
it, and hands the target back.
A target for transformers is one tensor that a ``DynamicCache`` is then laid
over (no copy); a target for blending is a plain tensor; a serving engine's
target maps the same slices onto its own paged blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvcdn.codecs import ChunkDest, TensorDest
from kvcdn.container import Part

if TYPE_CHECKING:
    import torch

    from kvcdn.models import LoadedModel


class KVTarget(Protocol):
    """Where one document's KV goes, ``[L, 2, H, T, D]`` by token position."""

    #: The document's tokens: every position in ``[0, tokens)`` is written once.
    tokens: int
    #: The layers and KV heads the target holds (a tensor- or pipeline-parallel rank's
    #: share): its chunks' places hold only those. None: all of them.
    part: Part | None

    def chunk(self, start: int, end: int) -> ChunkDest:
        """Where the KV ``[L, 2, H, end - start, D]`` of tokens ``[start, end)`` goes: a
        tensor view, or paged blocks the decoders write in their own layout."""
        ...

    def prefix(self, end: int) -> torch.Tensor:
        """The KV of tokens ``[0, end)``, all written already (what recomputing the
        chunk at ``end`` attends to)."""
        ...

    def commit(self, start: int, end: int) -> None:
        """Tokens ``[start, end)`` of :meth:`chunk` hold their verified KV now (a
        target that stages chunks writes them to where they belong)."""
        ...

    def finish(self) -> None:
        """Every chunk is in: build what the target hands out (a cache over the KV)."""
        ...


class TensorTarget:
    """A document's KV in one tensor ``[L, 2, H, T, D]`` on the model's device, in its
    dtype: what blending reads, and what a transformers cache is laid over."""

    part: Part | None = None

    def __init__(self, loaded: LoadedModel, tokens: int) -> None:
        import torch

        layout = loaded.layout
        self.tokens = tokens
        self.kv = torch.empty(
            (layout.layers, 2, layout.kv_heads, tokens, layout.head_dim),
            dtype=loaded.dtype,
            device=loaded.device,
        )

    def chunk(self, start: int, end: int) -> TensorDest:
        return TensorDest(self.kv[:, :, :, start:end])

    def prefix(self, end: int) -> torch.Tensor:
        return self.kv[:, :, :, :end]

    def commit(self, start: int, end: int) -> None:
        pass  # chunks are decoded in place

    def finish(self) -> None:
        pass  # the tensor is the result


class CacheTarget(TensorTarget):
    """A transformers ``DynamicCache`` filled in place: its layers are views of the
    tensor the chunks were decoded into (:meth:`LoadedModel.cache_from_kv`)."""

    def __init__(self, loaded: LoadedModel, tokens: int) -> None:
        super().__init__(loaded, tokens)
        self.loaded = loaded
        self._cache: Any = None

    def finish(self) -> None:
        self._cache = self.loaded.cache_from_kv(self.kv)

    def cache(self) -> Any:
        """The transformers cache over the loaded KV (after :meth:`finish`)."""
        if self._cache is None:
            self.finish()
        return self._cache
