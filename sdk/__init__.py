"""The kvcdn SDK: what applications call to answer from published documents.

from kvcdn import sdk
ctx = sdk.load_context("sed-manual", store="s3://bucket/kv")
print(ctx.generate("How do I edit a file in place?").text)
"""

from .context import Answer, Context, LoadPlan, answer_with_prefill, load_context

__all__ = ["Answer", "Context", "LoadPlan", "answer_with_prefill", "load_context"]
