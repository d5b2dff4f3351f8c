"""How much a lossy KV changes what the model says next.

The measure used by calibration and by ``bench/codec.py``: take a context
of real text and the tokens that follow it; run the continuation once on the
exact KV of the context (the reference) and once on a reconstructed KV, and
compare the two next-token distributions at every continuation position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InputError

if TYPE_CHECKING:
    import torch

    from .models import LoadedModel


@dataclass
class Sample:
    """A context's exact KV and the reference logits of its continuation."""

    kv: torch.Tensor  # float32 [L, 2, H, T, D] on CPU
    continuation: list[int]
    logits: torch.Tensor  # float32 [len(continuation), vocab]


def make_sample(
    model: LoadedModel, text: str, context_tokens: int, continuation_tokens: int = 257
) -> Sample:
    """Tokenise ``text``; its first ``context_tokens`` are the context."""
    ids = model.document_ids(text)
    if len(ids) < context_tokens + continuation_tokens:
        raise InputError(
            f"a quality sample needs {context_tokens + continuation_tokens} tokens; "
            f"the text has {len(ids)}"
        )
    ctx = ids[:context_tokens]
    cont = ids[context_tokens : context_tokens + continuation_tokens]
    kv = model.prefill(ctx).float().cpu()
    return Sample(kv, cont, continuation_logits(model, kv, cont))


def continuation_logits(model: LoadedModel, kv: torch.Tensor, cont: list[int]) -> torch.Tensor:
    import torch

    cache = model.cache_from_kv(kv)
    with torch.inference_mode():
        ids = torch.tensor([cont], device=model.device)
        return model.model(ids, past_key_values=cache, use_cache=True).logits[0].float().cpu()


def compare(sample: Sample, logits: torch.Tensor) -> dict[str, float]:
    """``kl`` (mean KL(reference || candidate), nats), ``ppl_delta_pct``, ``top1_agree``."""
    import torch

    ref = torch.log_softmax(sample.logits, -1)
    cand = torch.log_softmax(logits, -1)
    kl = (ref.exp() * (ref - cand)).sum(-1).mean().item()
    targets = torch.tensor(sample.continuation[1:])[:, None]
    nll_ref = -ref[:-1].gather(1, targets).mean().item()
    nll = -cand[:-1].gather(1, targets).mean().item()
    top1 = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
    return {
        "kl": max(kl, 0.0),
        "ppl_delta_pct": (math.exp(nll - nll_ref) - 1.0) * 100.0,
        "top1_agree": top1,
    }


def measure(model: LoadedModel, sample: Sample, kv: torch.Tensor) -> dict[str, float]:
    """Quality of ``kv`` (a reconstruction of ``sample.kv``) against the exact KV."""
    return compare(sample, continuation_logits(model, kv, sample.continuation))
