"""CacheBlend: one KV cache for several documents, from their separately computed caches.

Each published document's KV was computed alone, from position 0. Put one
after another, two things are wrong with them:

- **positions**: rotary embeddings make keys depend on their position; a
  document placed at offset ``p`` needs its keys rotated by ``p`` more
  (:func:`kvcdn.kernels.rope.rotate_keys`). :func:`check_positions` proves
  on the model itself that this gives the keys the model computes at ``p``;
- **cross-attention**: a later document's tokens never attended to the
  earlier ones. CacheBlend (Yao et al., EuroSys 2025) recomputes a few
  tokens: those whose KV deviates most from a fresh computation (HKVD
  tokens). The first layers run on every token; at ``check_layers`` the
  tokens with the largest deviation of their fresh KV from the reused one
  are kept, fewer at each check (gradual filtering), down to
  ``recompute_ratio`` of the reused tokens, and only they go through the
  rest of the layer and the layers after, attending to the fused cache:
  reused KV everywhere except at the recomputed tokens. The first document
  is a true prefix: its cache is what a prefill computes, so none of the
  budget goes to it.

When the query (the question) is known, the choice is query-aware: a token
deviating much matters only if the answer reads it, so each deviation is
weighted by the attention the query's last token pays that token in the
deeper layers, measured by running the query over the reused cache first.
On the embedded model this about halves the KL of the answer to a full prefill's
at the same ratio (docs/blend.md). The query is then computed with the
chosen tokens, so the answer's first token comes out of the blend.

Tokens with no cache (separators between documents) are computed at every
layer. With ``recompute_ratio=1`` every token is recomputed at every layer,
which is a full prefill; with 0 nothing is (full reuse).

The layer loop drives the model's own modules (norms, projections, MLP,
rotary embedding) for decoder layers shaped like Llama's (Llama, Mistral,
Qwen2 and the like); other architectures are refused.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import BlendUnsupported, InputError

if TYPE_CHECKING:
    import torch

    from .models import LoadedModel

log = logging.getLogger(__name__)

#: Layers at which the most deviating tokens are kept (0-based): every token
#: goes through layers 0 and 1, and its K and V are computed at layer 2; the
#: first check keeps twice the ratio, the second the ratio (gradual
#: filtering, as in the paper). On the embedded model, choosing at layers 2
#: and 3 rather than 1 and 2 brings the answer's KL to a full prefill's about
#: a fifth lower for one more layer of work.
CHECK_LAYERS = (2, 3)
#: A query-aware choice weighs each token's deviation by the attention the
#: query's last token pays it from this fraction of the depth on: the deeper
#: layers, where the answer is made. On the embedded model, from a third down
#: brought the answer's KL to a full prefill lower than from the first layers
#: (early attention is local and spread out) and than from the last few alone.
QUERY_ATTENTION_FROM = 1 / 3
#: Unsupported rotary schemes: their frequencies depend on the sequence length.
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}
# The self-check's tolerance on keys, relative to their largest magnitude.
_POSITION_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Piece:
    """A run of tokens in the blended sequence: a document's (with its KV) or a separator's.

    ``kv`` (``[L, 2, H, len(ids), D]``) was computed at positions from
    ``kv_start``; ``None`` means the tokens have no cache and are computed.
    """

    ids: list[int]
    kv: torch.Tensor | None = None
    kv_start: int = 0


@dataclass
class BlendReport:
    tokens: int  # in the blended sequence
    reused: int  # tokens that came with a cache
    recomputed: int  # reused tokens recomputed through every layer (HKVD tokens)
    computed: int  # tokens without a cache, computed at every layer (separators)
    recompute_ratio: float
    query: int = 0  # tokens of the query that weighed the choice (0: chosen without one)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Blended:
    """What :func:`blend` returns."""

    kv: torch.Tensor  # [L, 2, H, T, D]: the fused KV of the pieces, then of the query if given
    report: BlendReport
    #: the next-token logits after the query (``[vocab]``), when a query was given
    query_logits: torch.Tensor | None = None


def _decoder(loaded: LoadedModel):
    base = getattr(loaded.model, "model", None)
    layers = getattr(base, "layers", None)
    if (
        base is None
        or layers is None
        or not all(hasattr(base, n) for n in ("rotary_emb", "norm"))
        or not hasattr(loaded.model, "lm_head")
    ):
        raise BlendUnsupported(f"{loaded.name}: blending supports decoder models like Llama's")
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        needed = ("input_layernorm", "post_attention_layernorm", "mlp")
        if (
            attn is None
            or not all(hasattr(layer, n) for n in needed)
            or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        ):
            raise BlendUnsupported(
                f"{loaded.name}: its decoder layers are not shaped like Llama's; cannot blend"
            )
    return base


def rope_frequencies(loaded: LoadedModel) -> torch.Tensor:
    """The model's rotary frequencies (``[head_dim / 2]``), scaling included."""
    rotary = _decoder(loaded).rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise BlendUnsupported(
            f"{loaded.name} uses '{rope_type}' rotary scaling, whose frequencies depend on "
            "the sequence length: its cached keys cannot be moved to other positions"
        )
    return rotary.inv_freq.detach().float()


def position_error(loaded: LoadedModel, offset: int, ids: Sequence[int]) -> float:
    """How far keys computed at position 0 and rotated to ``offset`` are from the
    model's own keys for the same tokens at ``offset`` (relative max error, all layers).

    Attention with rotary embeddings sees only relative positions, so a
    document computed alone from ``offset`` has the same hidden states as
    from 0 and keys that differ exactly by the rotation; values are equal.
    """
    import torch
    from transformers import DynamicCache

    from kvcdn.kernels.rope import rotate_keys

    from .models import kv_from_cache

    inv_freq = rope_frequencies(loaded)
    ids_t = torch.tensor([list(ids)], device=loaded.device)
    kvs = []
    for start in (0, offset):
        cache = DynamicCache(config=loaded.model.config)
        positions = torch.arange(start, start + len(ids), device=loaded.device)[None]
        with torch.inference_mode():
            loaded.model(ids_t, position_ids=positions, past_key_values=cache, use_cache=True)
        kvs.append(kv_from_cache(cache).float())
    at_zero, at_offset = kvs
    moved = rotate_keys(at_zero[:, 0], offset, inv_freq)
    scale = at_offset[:, 0].abs().max().clamp_min(1e-12)
    key_error = float((moved - at_offset[:, 0]).abs().max() / scale)
    value_scale = at_offset[:, 1].abs().max().clamp_min(1e-12)
    value_error = float((at_zero[:, 1] - at_offset[:, 1]).abs().max() / value_scale)
    return max(key_error, value_error)


def check_positions(loaded: LoadedModel) -> float:
    """Prove on ``loaded`` that re-rotated keys are the model's own; raise if not.

    A few short forward passes: callers run it once per model and device (an
    ``sdk.Client`` does) and tell :func:`blend` so. Returns the largest relative
    error seen.
    """
    rope_frequencies(loaded)  # refuses length-dependent scaling first
    ids = loaded.tokenizer(
        "The position self-check: keys moved by rotation must match the model's own.",
        add_special_tokens=False,
    ).input_ids[:24]
    tolerance = _POSITION_TOLERANCE.get(loaded.layout.dtype, 2e-2)
    worst = 0.0
    for offset in (1, 517, max(2, loaded.context_window // 2)):
        error = position_error(loaded, offset, ids)
        worst = max(worst, error)
        if not error <= tolerance:  # also catches NaN
            raise BlendUnsupported(
                f"{loaded.name} fails the position self-check: keys computed at 0 and "
                f"rotated to {offset} differ from the model's own by {error:.2e} "
                f"(relative; tolerance {tolerance:g}); its cached KV cannot be blended"
            )
    log.info("%s passes the position self-check (max relative error %.1e)", loaded.name, worst)
    return worst


def blend(
    loaded: LoadedModel,
    pieces: Sequence[Piece] | Callable[[], Sequence[Piece]],
    ids: Sequence[int],
    *,
    recompute_ratio: float,
    exact_prefix: int = 0,
    check_layers: Sequence[int] | None = None,
    query_ids: Sequence[int] | None = None,
    positions_checked: bool = False,
) -> Blended:
    """The fused KV ``[L, 2, H, len(ids), D]`` of ``pieces`` placed one after another.

    ``ids`` are the pieces' tokens, concatenated. ``pieces`` may be a callable
    that returns them: it is called only when the first cached KV is needed,
    so loading the caches overlaps the layers that run on every token.

    The first ``exact_prefix`` tokens' cache is what a prefill computes (the
    first document, at its own positions, attends to nothing it lacks), so
    the recompute budget, ``recompute_ratio`` of all reused tokens, goes to
    the tokens after it. ``recompute_ratio=1`` recomputes every token.

    ``query_ids``, the tokens that follow (the question), make the choice
    query-aware: each token's deviation is weighted by the attention the
    query's last token pays it in the deeper layers, read off a pass of the
    query over the reused cache (see :data:`QUERY_ATTENTION_FROM`). The query
    is then computed with the chosen tokens, as CacheBlend always recomputes
    it: the result holds its KV after the pieces' and the logits of the token
    that follows it, so the answer's first token needs no further pass.

    ``positions_checked``: :func:`check_positions` passed on this model and
    device already (otherwise it runs first).
    """
    import torch

    from kvcdn.kernels.rope import rotate_keys

    if not 0.0 <= recompute_ratio <= 1.0:
        raise InputError(f"recompute_ratio must be between 0 and 1, not {recompute_ratio}")
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    base = _decoder(loaded)
    inv_freq = rope_frequencies(loaded)
    if not positions_checked:
        check_positions(loaded)
    layers = list(base.layers)
    n_layers, kv_heads, head_dim = len(layers), loaded.layout.kv_heads, loaded.layout.head_dim
    device = loaded.device
    dtype = next(loaded.model.parameters()).dtype
    check_layers = CHECK_LAYERS if check_layers is None else check_layers
    checks = sorted(c for c in set(check_layers) if c < n_layers - 1)
    if not 0.0 < recompute_ratio < 1.0:
        checks = []  # nothing recomputed, or everything: nothing to choose
    query = list(query_ids or []) if checks else []
    n_context = len(ids)
    total = n_context + len(query)

    kv = torch.empty((n_layers, 2, kv_heads, total, head_dim), dtype=dtype, device=device)
    cached = torch.zeros(total, dtype=torch.bool, device=device)
    got_pieces: list[Sequence[Piece]] = []

    def place_caches(from_layer: int = 0) -> None:
        """Put every piece's reused KV, moved to its new positions, into ``kv`` (the
        layers from ``from_layer``: those before hold fresh KV already)."""
        t = time.perf_counter()
        resolved = pieces() if callable(pieces) else pieces
        seconds["wait_for_caches"] = time.perf_counter() - t
        got_pieces.append(resolved)
        t = time.perf_counter()
        at = 0
        for piece in resolved:
            n = len(piece.ids)
            if piece.kv is not None:
                if tuple(piece.kv.shape) != (n_layers, 2, kv_heads, n, head_dim):
                    raise InputError(
                        f"a piece of {n} tokens came with KV of shape {tuple(piece.kv.shape)}"
                    )
                src = piece.kv[from_layer:].to(device=device, dtype=dtype)
                delta = at - piece.kv_start
                keys = rotate_keys(src[:, 0], delta, inv_freq) if delta else src[:, 0]
                kv[from_layer:, 0, :, at : at + n] = keys
                kv[from_layer:, 1, :, at : at + n] = src[:, 1]
                cached[at : at + n] = True
            at += n
        if at != n_context:
            raise InputError(f"the pieces hold {at} tokens, the sequence {n_context}")
        seconds["place"] = time.perf_counter() - t

    weight: torch.Tensor | None = None
    query_logits: torch.Tensor | None = None
    n_reused_budget: int | None = None
    with torch.inference_mode():
        ids_t = torch.tensor([[*ids, *query]], device=device)
        positions = torch.arange(total, device=device)
        hidden = base.embed_tokens(ids_t)[0]  # [T, hidden]
        cos, sin = base.rotary_emb(hidden[None], positions[None])  # [1, T, D]
        active = positions.clone()  # the tokens computed at this layer, in order
        if not checks and recompute_ratio < 1.0:  # full reuse: caches needed from layer 0
            place_caches()
            active = positions[~cached]
            hidden = hidden[active]
        elif recompute_ratio >= 1.0:
            place_caches()  # validates the pieces; their KV is all overwritten
        for index, layer in enumerate(layers):
            if checks and index == checks[0]:
                if not got_pieces:
                    place_caches(from_layer=index)
                if query:
                    t = time.perf_counter()
                    weight = _query_attention(
                        layers, index, hidden, positions[~cached], cos, sin, kv
                    )
                    seconds["query_attention"] = time.perf_counter() - t
            if active.numel() == 0:
                break  # every token reused as is
            q, k, v = _project(layer, hidden, active, cos, sin, head_dim)
            if index in checks:
                # how far each token's fresh KV is from the reused one
                deviation = (k - kv[index, 0, :, active]).float().pow(2).sum(dim=(0, 2)) + (
                    v - kv[index, 1, :, active]
                ).float().pow(2).sum(dim=(0, 2))
                if weight is not None:
                    deviation *= weight[active]
                reusable = cached[active] & (active >= exact_prefix)
                if n_reused_budget is None:
                    n_reused_budget = int(cached.sum())
                step = checks.index(index)
                keep_frac = recompute_ratio * (len(checks) - step)
                n_keep = min(int(reusable.sum()), math.ceil(keep_frac * n_reused_budget))
                # the tokens without a cache (separators, the query) stay; the
                # exact prefix's go
                fresh = ~cached[active]
                deviation[fresh] = math.inf
                deviation[active < exact_prefix] = -math.inf
                keep = torch.topk(deviation, n_keep + int(fresh.sum())).indices.sort().values
                kv[index, 0, :, active] = k  # fresh KV for every token computed here
                kv[index, 1, :, active] = v
                active, hidden, q = active[keep], hidden[keep], q[:, keep]
            else:
                kv[index, 0, :, active] = k
                kv[index, 1, :, active] = v
            if index < n_layers - 1:
                hidden = _attend(layer, hidden, q, active, kv[index])
            elif query:  # of the last layer, only the query's last token's output is read
                last = _attend(layer, hidden[-1:], q[:, -1:], active[-1:], kv[index])
                query_logits = loaded.model.lm_head(base.norm(last))[0].float()
    if not got_pieces:
        place_caches()
    reused = int(cached.sum())
    recomputed = int(cached[active].sum())
    computed = n_context - reused
    seconds["blend"] = time.perf_counter() - started
    report = BlendReport(
        n_context, reused, recomputed, computed, recompute_ratio, len(query), seconds
    )
    log.info(
        "blended %d tokens: %d reused, %d of them recomputed (%.0f%%%s), %d computed; %.2f s",
        n_context,
        reused,
        recomputed,
        100 * recomputed / max(1, reused),
        ", chosen for a query" if query else "",
        computed,
        seconds["blend"],
    )
    return Blended(kv, report, query_logits)


def _query_attention(
    layers: list,
    start: int,
    hidden: torch.Tensor,
    probe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
) -> torch.Tensor:
    """How much the last token attends to each token (``[T]``), summed over heads and
    the layers from :data:`QUERY_ATTENTION_FROM` of the depth on.

    Runs the ``probe`` tokens (those without a cache: separators, then the
    query) from layer ``start`` on, over the reused cache in ``kv``, where it
    leaves their KV (recomputed afterwards, over the fused cache).
    ``hidden`` holds every token's hidden state at ``start``.
    """
    import torch

    n_layers = len(layers)
    head_dim = kv.shape[-1]
    first = max(start, math.ceil(n_layers * QUERY_ATTENTION_FROM))
    weight = torch.zeros(kv.shape[3], dtype=torch.float32, device=kv.device)
    h = hidden[probe]
    for index in range(start, n_layers):
        layer = layers[index]
        q, k, v = _project(layer, h, probe, cos, sin, head_dim)
        kv[index, 0, :, probe] = k
        kv[index, 1, :, probe] = v
        if index >= first:
            keys = kv[index, 0].float()  # [H, T, D]; the last token sees every position
            last = q[:, -1].float().view(keys.shape[0], -1, head_dim)  # [H, heads/H, D]
            scores = torch.einsum("hgd,htd->hgt", last, keys) * _scaling(layer, head_dim)
            weight += scores.softmax(dim=-1).sum(dim=(0, 1))
        if index < n_layers - 1:
            h = _attend(layer, h, q, probe, kv[index])
    return weight


def _scaling(layer, head_dim: int) -> float:
    return getattr(layer.self_attn, "scaling", head_dim**-0.5)


def _project(
    layer, hidden: torch.Tensor, active: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ``active`` tokens' queries (``[heads, n, D]``), keys and values
    (``[kv_heads, n, D]``) at ``layer``, rotated to their positions."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    n = active.shape[0]
    x = layer.input_layernorm(hidden)
    k = attn.k_proj(x).view(n, -1, head_dim)
    v = attn.v_proj(x).view(n, -1, head_dim).transpose(0, 1)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    q = attn.q_proj(x).view(n, -1, head_dim)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    q, k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[:, active], sin[:, active]
    )
    return q[0], k[0], v


def _attend(
    layer, hidden: torch.Tensor, q: torch.Tensor, active: torch.Tensor, kv: torch.Tensor
) -> torch.Tensor:
    """The rest of ``layer`` for the ``active`` tokens: attention over ``kv``
    (``[2, H, T, D]``, theirs in place), then the MLP. Returns their new hidden states."""
    import torch

    n, total, head_dim = active.shape[0], kv.shape[2], kv.shape[-1]
    if n == total:  # every token: plain causal attention
        mask, causal = None, True
    else:
        mask = (torch.arange(total, device=active.device)[None, :] <= active[:, None])[None, None]
        causal = False
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None],
        kv[0][None],
        kv[1][None],
        attn_mask=mask,
        is_causal=causal,
        scale=_scaling(layer, head_dim),
        enable_gqa=True,
    )[0]  # [heads, n, D]
    hidden = hidden + layer.self_attn.o_proj(out.transpose(0, 1).reshape(n, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
