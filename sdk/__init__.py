"""The kvcdn SDK: what applications call to answer from published documents.

from kvcdn import sdk
ctx = sdk.load_context("sed-manual", store="s3://bucket/kv")
# or through edge nodes, falling back to the store:
ctx = sdk.load_context("sed-manual", edges=["http://edge-a:8080", "http://edge-b:8080"],
                       store="s3://bucket/kv")
print(ctx.generate("How do I edit a file in place?").text)
# several documents in one context (CacheBlend):
ctx = sdk.load_contexts(["sed-manual", "grep-manual"], store="s3://bucket/kv")
"""

from kvcdn.signing import TrustPolicy

from .blend import BlendedContext, load_contexts
from .context import Answer, Context, LoadPlan, answer_with_prefill, forget_links, load_context
from .edges import EdgeAdmin, EdgeStore, plan_warm, rendezvous

__all__ = [
    "Answer",
    "BlendedContext",
    "Context",
    "EdgeAdmin",
    "EdgeStore",
    "LoadPlan",
    "TrustPolicy",
    "answer_with_prefill",
    "forget_links",
    "load_context",
    "load_contexts",
    "plan_warm",
    "rendezvous",
]
