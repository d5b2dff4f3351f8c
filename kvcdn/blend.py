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
  remaining layers, attending to the fused cache: reused KV everywhere
  except at the recomputed tokens. The first document is a true prefix:
  its cache is what a prefill computes, so none of the budget goes to it.

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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import BlendUnsupported, InputError

if TYPE_CHECKING:
    import torch

    from .models import LoadedModel

log = logging.getLogger(__name__)

#: Layers after which the most deviating tokens are kept (0-based): every
#: token goes through layers 0 to 2; the first check keeps twice the ratio,
#: the second the ratio (gradual filtering, as in the paper). On the embedded
#: model, choosing at layers 2 and 3 rather than 1 and 2 brings the answer's
#: KL to a full prefill's about a fifth lower for one more layer of work.
CHECK_LAYERS = (2, 3)
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
    seconds: dict[str, float] = field(default_factory=dict)


def _decoder(loaded: LoadedModel):
    base = getattr(loaded.model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(base, "rotary_emb"):
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


_checked: dict[tuple[str, str], float] = {}
_checked_lock = threading.Lock()


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

    Runs once per model and device in a process (a few short forward passes).
    Returns the largest relative error seen.
    """
    rope_frequencies(loaded)  # refuses length-dependent scaling first
    key = (loaded.fingerprint, loaded.device)
    with _checked_lock:
        if key in _checked:
            return _checked[key]
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
    with _checked_lock:
        _checked[key] = worst
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
) -> tuple[torch.Tensor, BlendReport]:
    """The fused KV ``[L, 2, H, len(ids), D]`` of ``pieces`` placed one after another.

    ``ids`` are the pieces' tokens, concatenated. ``pieces`` may be a callable
    that returns them: it is called only when the first cached KV is needed,
    so loading the caches overlaps the layers that run on every token.

    The first ``exact_prefix`` tokens' cache is what a prefill computes (the
    first document, at its own positions, attends to nothing it lacks), so
    the recompute budget, ``recompute_ratio`` of all reused tokens, goes to
    the tokens after it. ``recompute_ratio=1`` recomputes every token.
    """
    import torch

    from kvcdn.kernels.rope import rotate_keys

    if not 0.0 <= recompute_ratio <= 1.0:
        raise InputError(f"recompute_ratio must be between 0 and 1, not {recompute_ratio}")
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    base = _decoder(loaded)
    inv_freq = rope_frequencies(loaded)
    check_positions(loaded)
    layers = list(base.layers)
    n_layers, kv_heads, head_dim = len(layers), loaded.layout.kv_heads, loaded.layout.head_dim
    device = loaded.device
    dtype = next(loaded.model.parameters()).dtype
    total = len(ids)
    check_layers = CHECK_LAYERS if check_layers is None else check_layers
    checks = sorted(c for c in set(check_layers) if c < n_layers - 1) if recompute_ratio > 0 else []
    if recompute_ratio >= 1.0:
        checks = []  # everything is recomputed: nothing to choose

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
        if at != total:
            raise InputError(f"the pieces hold {at} tokens, the sequence {total}")
        seconds["place"] = time.perf_counter() - t

    n_reused_budget: int | None = None
    with torch.inference_mode():
        ids_t = torch.tensor([list(ids)], device=device)
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
            if checks and index == checks[0] and not got_pieces:
                place_caches(from_layer=index)
            if active.numel() == 0:
                break  # every token reused as is
            last = index == n_layers - 1
            hidden, k, v = _layer(layer, hidden, active, cos, sin, kv[index], last)
            if checks and index in checks:
                # deviation of the fresh KV from the reused one, per token
                deviation = (k - kv[index, 0, :, active]).float().pow(2).sum(dim=(0, 2)) + (
                    v - kv[index, 1, :, active]
                ).float().pow(2).sum(dim=(0, 2))
                reusable = cached[active] & (active >= exact_prefix)
                if n_reused_budget is None:
                    n_reused_budget = int(cached.sum())
                step = checks.index(index)
                keep_frac = recompute_ratio * (len(checks) - step)
                n_keep = min(int(reusable.sum()), math.ceil(keep_frac * n_reused_budget))
                # tokens without a cache stay; the exact prefix's go
                deviation[~cached[active]] = math.inf
                deviation[active < exact_prefix] = -math.inf
                n_fresh = int((~cached[active]).sum())
                keep = torch.topk(deviation, n_keep + n_fresh).indices.sort().values
                kv[index, 0, :, active] = k
                kv[index, 1, :, active] = v
                active, hidden = active[keep], hidden[keep]
            else:
                kv[index, 0, :, active] = k
                kv[index, 1, :, active] = v
    if not got_pieces:
        place_caches()
    reused = int(cached.sum())
    recomputed = int(cached[active].sum())
    computed = total - reused
    seconds["blend"] = time.perf_counter() - started
    report = BlendReport(total, reused, recomputed, computed, recompute_ratio, seconds)
    log.info(
        "blended %d tokens: %d reused, %d of them recomputed (%.0f%%), %d computed; %.2f s",
        total,
        reused,
        recomputed,
        100 * recomputed / max(1, reused),
        computed,
        seconds["blend"],
    )
    return kv, report


def _layer(
    layer,
    hidden: torch.Tensor,
    active: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    last: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer for the ``active`` tokens, attending to ``kv`` (``[2, H, T, D]``)
    with theirs in place. Returns their new hidden states and their fresh K and V
    (``[H, n, D]``, keys rotated)."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    n = active.shape[0]
    x = layer.input_layernorm(hidden)
    head_dim = kv.shape[-1]
    k = attn.k_proj(x).view(n, -1, head_dim)
    v = attn.v_proj(x).view(n, -1, head_dim).transpose(0, 1)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    k = k.transpose(0, 1)
    q = attn.q_proj(x).view(n, -1, head_dim)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    q = q.transpose(0, 1)
    q, k = apply_rotary_pos_emb(q[None], k[None], cos[:, active], sin[:, active])
    q, k = q[0], k[0]
    if last:  # nothing reads the last layer's output but its KV
        return hidden, k, v
    keys = kv[0].clone()
    values = kv[1].clone()
    keys[:, active] = k
    values[:, active] = v
    total = keys.shape[1]
    mask = torch.arange(total, device=active.device)[None, :] <= active[:, None]  # causal
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None],
        keys[None],
        values[None],
        attn_mask=mask[None, None],
        scale=getattr(attn, "scaling", head_dim**-0.5),
        enable_gqa=True,
    )[0]  # [heads, n, D]
    hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(n, -1))
    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden, k, v
