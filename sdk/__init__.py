"""The kvcdn SDK: what applications call to answer from published documents.

    from kvcdn import sdk

    with sdk.Client(store="s3://bucket/kv") as client:
        ctx = client.load_context("sed-manual")
        print(ctx.generate("How do I edit a file in place?").text)

        # through edge nodes, falling back to the store, loading only signed KV:
        edged = client.with_options(store="s3://bucket/kv", trust="publishers.trust",
                                    edges=["http://edge-a:8080", "http://edge-b:8080"])
        # several documents in one context (CacheBlend):
        both = edged.load_contexts(["sed-manual", "grep-manual"])

``sdk.load_context(...)`` and ``sdk.load_contexts(...)`` are the same loads on
a default client, for scripts.
"""

from kvcdn.cacheblend import BlendReport
from kvcdn.errors import (
    AccessDenied,
    ArgumentError,
    DocumentTooLong,
    FingerprintMismatch,
    FormatError,
    InputError,
    IntegrityError,
    KvcdnError,
    NotFound,
    RollbackError,
    StoreError,
    TrustError,
)
from kvcdn.signing import TrustPolicy
from kvcdn.store import Cancel, FetchCancelled, Fetched, Reader

from .client import (
    RECOMPUTE_RATIO,
    Client,
    default_client,
    forget_links,
    load_context,
    load_contexts,
)
from .context import Answer, BaseContext, BlendedContext, Context, LoadPlan, answer_with_prefill
from .edges import (
    EdgeAdmin,
    EdgeStore,
    Rejected,
    WarmJobStatus,
    WarmOutcome,
    plan_warm,
    rendezvous,
    warm_edges,
)
from .loader import AUTO
from .streaming import ChunkReport
from .targets import CacheTarget, KVTarget, TensorTarget

__all__ = [
    "AUTO",
    "RECOMPUTE_RATIO",
    "AccessDenied",
    "Answer",
    "ArgumentError",
    "BaseContext",
    "BlendReport",
    "BlendedContext",
    "CacheTarget",
    "Cancel",
    "ChunkReport",
    "Client",
    "Context",
    "DocumentTooLong",
    "EdgeAdmin",
    "EdgeStore",
    "FetchCancelled",
    "Fetched",
    "FingerprintMismatch",
    "FormatError",
    "InputError",
    "IntegrityError",
    "KVTarget",
    "KvcdnError",
    "LoadPlan",
    "NotFound",
    "Reader",
    "Rejected",
    "RollbackError",
    "StoreError",
    "TensorTarget",
    "TrustError",
    "TrustPolicy",
    "WarmJobStatus",
    "WarmOutcome",
    "answer_with_prefill",
    "default_client",
    "forget_links",
    "load_context",
    "load_contexts",
    "plan_warm",
    "rendezvous",
    "warm_edges",
]
