"""CacheBlend on the real model: positions, selective recompute, refusals, the CLI."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch
from click.testing import CliRunner

from kvcdn import sdk
from kvcdn.cacheblend import check_positions, position_error, rope_frequencies
from kvcdn.catalog import read_manifest
from kvcdn.cli.main import cli
from kvcdn.errors import BlendUnsupported, FingerprintMismatch, InputError
from kvcdn.kernels.rope import rotate_keys
from kvcdn.keys import latest_key, manifest_key
from kvcdn.manifest import pointer_bytes
from kvcdn.models import LoadedModel, crop_cache
from kvcdn.publish import publish
from kvcdn.store import open_store
from tests.cli_json import parsed

PAGES = ("sed", "grep", "tar")
QUESTION = "Which command searches file contents, and which one edits a stream?"


def _man(page: str) -> str:
    out = subprocess.run(
        f"man -P cat {page} | col -bx", shell=True, capture_output=True, text=True, check=True,
        env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return out.stdout


@pytest.fixture(scope="module")
def store(model, tmp_path_factory):
    """Three real man pages (their first ~200 tokens) published at fp16 and int8."""
    folder = tmp_path_factory.mktemp("blend-store")
    target = open_store(str(folder))
    prefix = len(model.prefix_ids())
    for page in PAGES:
        ids = model.document_ids(_man(page))[prefix : prefix + 200]
        publish(
            text=model.tokenizer.decode(ids), name=page, model=model, store=target,
            levels=("fp16", "int8"),
        )  # fmt: skip
    return str(folder)


def test_rotations_compose_and_keep_norms():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    keys = torch.randn(3, 5, 64)
    twice = rotate_keys(rotate_keys(keys, 100, inv_freq), 23, inv_freq)
    assert torch.allclose(twice, rotate_keys(keys, 123, inv_freq), atol=1e-4)
    assert torch.allclose(rotate_keys(keys, 0, inv_freq), keys)
    assert torch.allclose(rotate_keys(keys, 777, inv_freq).norm(dim=-1), keys.norm(dim=-1))
    back = rotate_keys(rotate_keys(keys, 500, inv_freq), -500, inv_freq)
    assert torch.allclose(back, keys, atol=1e-4)


def test_position_self_check_on_the_real_model(model):
    """Keys published at 0 and re-rotated to p are the model's own keys at p."""
    worst = check_positions(model)
    assert worst < 1e-4
    ids = model.tokenizer("kvcdn moves cached keys", add_special_tokens=False).input_ids
    assert position_error(model, 1500, ids) < 1e-4
    # the check can fail: keys left at their old positions are far from the model's
    at_zero = model.prefill(ids)
    cache_at = model.model(
        torch.tensor([ids]), position_ids=torch.arange(1500, 1500 + len(ids))[None], use_cache=True
    ).past_key_values
    unmoved = (at_zero[:, 0] - torch.stack([la.keys[0] for la in cache_at.layers])).abs().max()
    assert unmoved > 0.1 * at_zero[:, 0].abs().max()


def test_a_length_dependent_rotary_scaling_is_refused(model):
    """A model whose rotary frequencies depend on the sequence length cannot be blended."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=model.model.config.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )  # fmt: skip
    dynamic = LoadedModel(model.source, LlamaForCausalLM(config).eval(), model.tokenizer, "cpu")
    with pytest.raises(BlendUnsupported, match="depend on the sequence length"):
        rope_frequencies(dynamic)
    with pytest.raises(BlendUnsupported):
        check_positions(dynamic)


def test_full_recompute_equals_full_prefill(model, store):
    ctx = sdk.load_contexts(list(PAGES), model=model, store=store, recompute_ratio=1.0)
    assert ctx.blend.recomputed == ctx.blend.reused > 500
    ours = ctx.generate(QUESTION, max_new_tokens=16)
    base = ctx.answer_with_prefill(QUESTION, max_new_tokens=16)
    assert ours.token_ids == base.token_ids
    assert torch.allclose(ours.first_token_logits, base.first_token_logits, atol=2e-3)
    # the blended cache is the prefill's cache, layer by layer
    from transformers import DynamicCache

    full = DynamicCache(config=model.model.config)
    with torch.inference_mode():
        model.model(torch.tensor([ctx.token_ids]), past_key_values=full, use_cache=True)
    for ours_layer, full_layer in zip(ctx.cache.layers, full.layers, strict=True):
        assert torch.allclose(ours_layer.keys, full_layer.keys, atol=2e-3)
        assert torch.allclose(ours_layer.values, full_layer.values, atol=2e-3)


def test_blend_is_deterministic_and_recomputes_the_ratio(model, store):
    runs = [
        sdk.load_contexts(list(PAGES), model=model, store=store, recompute_ratio=0.15)
        for _ in range(2)
    ]
    first, second = runs
    for a, b in zip(first.cache.layers, second.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    report = first.blend
    assert report.reused == sum(len(m.token_ids) for m in first.manifests) - 2 * len(
        first.model.prefix_ids()
    )
    assert report.recomputed == pytest.approx(0.15 * report.reused, abs=1)
    assert report.computed == 2 * len(model.separator_ids())
    assert all(set(p.chunk_levels) == {"fp16"} for p in first.plans)  # the best level


def _kl_to_prefill(model, ctx, question, reference_logits):
    q_ids = ctx._question_ids(question)
    with torch.inference_mode():
        logits = model.model(torch.tensor([q_ids]), past_key_values=ctx.cache).logits[0, -1]
    crop_cache(ctx.cache, len(ctx.token_ids))
    p = torch.log_softmax(reference_logits, -1)
    return float((p.exp() * (p - torch.log_softmax(logits.float(), -1))).sum())


def test_blending_is_closer_to_prefill_than_concatenation(model, store):
    """Recomputing 15% of the tokens brings the answer's distribution closer to a
    full prefill's than reusing every cache as it is (KL at the first answer token),
    and closer still when the tokens are chosen for the question."""
    reuse = sdk.load_contexts(list(PAGES), model=model, store=store, blend=False)
    assert reuse.blend.recomputed == 0
    blended = sdk.load_contexts(list(PAGES), model=model, store=store, recompute_ratio=0.15)
    assert reuse.token_ids == blended.token_ids
    reference = reuse.answer_with_prefill(QUESTION, max_new_tokens=1).first_token_logits
    kl_reuse = _kl_to_prefill(model, reuse, QUESTION, reference)
    kl_blend = _kl_to_prefill(model, blended, QUESTION, reference)
    assert kl_blend < kl_reuse
    chosen = sdk.load_contexts(
        list(PAGES), model=model, store=store, recompute_ratio=0.15, question=QUESTION
    )
    crop_cache(chosen.cache, len(chosen.token_ids))  # _kl_to_prefill feeds the question
    kl_chosen = _kl_to_prefill(model, chosen, QUESTION, reference)
    assert kl_chosen < kl_blend


def test_documents_of_another_model_or_tokenizer_are_refused(model, store):
    target = open_store(store)
    sed = read_manifest(target, "sed")
    for other, field, value in (
        ("sed-other-model", "model_fingerprint", "0" * 64),
        ("sed-other-tokenizer", "tokenizer", "another-tokenizer"),
    ):
        forged = dataclasses.replace(sed, name=other, **{field: value})
        target.put(manifest_key(other, 1), forged.dumps())
        target.put(latest_key(other), pointer_bytes(other, 1))
        what = "models" if field == "model_fingerprint" else "tokenizers"
        with pytest.raises(FingerprintMismatch, match=f"published for different {what}"):
            sdk.load_contexts(["grep", other], model=model, store=store)


def test_ask_several_documents(model, store):
    runner = CliRunner()
    args = ["ask", "--docs", *PAGES, QUESTION, "--store", store, "--max-new-tokens", "8"]
    out = runner.invoke(cli, [*args, "--compare", "--json"])
    assert out.exit_code == 0, out.output
    result = parsed("ask", out.stdout)
    assert [d["ref"] for d in result["documents"]] == [f"{p}@1" for p in PAGES]
    assert all(d["load"]["bytes"] > 0 for d in result["documents"])
    blend = result["kvcdn"]["blend"]
    assert blend["recomputed"] == pytest.approx(0.15 * blend["reused"], abs=1)
    assert result["prefill"]["answer"] and result["kvcdn"]["answer"]
    shown = runner.invoke(cli, [*args, "--no-blend"])
    assert shown.exit_code == 0 and "concatenated, nothing recomputed" in shown.output
    bad = runner.invoke(cli, [*args, "--recompute-ratio", "1.5"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    missing = runner.invoke(cli, ["ask", "--docs", "sed", "nope", QUESTION, "--store", store])
    assert missing.exit_code != 0 and "nope" in missing.output
    assert "Traceback" not in missing.output


def test_a_blend_chosen_for_the_question(model, store):
    """With the question known at load time, the blend computes it with the tokens
    it chose for it: answering it needs no further pass and gives what feeding the
    question over the same cache gives; another question crops it away first."""
    plain = sdk.load_contexts(list(PAGES), model=model, store=store, recompute_ratio=0.15)
    ctx = sdk.load_contexts(
        list(PAGES), model=model, store=store, recompute_ratio=0.15, question=QUESTION
    )
    q_ids = ctx._question_ids(QUESTION)
    assert ctx.blend.query == len(q_ids)
    assert ctx.blend.recomputed == plain.blend.recomputed  # the same budget, spent otherwise
    assert ctx.cache.get_seq_length() == len(ctx.token_ids) + len(q_ids)
    chosen = ctx.generate(QUESTION, max_new_tokens=12)
    assert ctx.cache.get_seq_length() == len(ctx.token_ids)  # ready for the next question
    fed, _, logits = model.greedy(ctx.cache, q_ids, 12)
    crop_cache(ctx.cache, len(ctx.token_ids))
    assert chosen.token_ids == fed
    assert torch.allclose(chosen.first_token_logits, logits, atol=2e-3)
    # a different cache from the plain blend's: other tokens were recomputed
    assert not torch.equal(ctx.cache.layers[-1].values, plain.cache.layers[-1].values)

    other = "What does tar do?"
    again = sdk.load_contexts(
        list(PAGES), model=model, store=store, recompute_ratio=0.15, question=QUESTION
    )
    answer = again.generate(other, max_new_tokens=8)
    expected, _, _ = model.greedy(ctx.cache, ctx._question_ids(other), 8)
    assert answer.token_ids == expected
    # nothing to choose at a ratio of 1: the question is not computed ahead
    full = sdk.load_contexts(
        list(PAGES), model=model, store=store, recompute_ratio=1.0, question=QUESTION
    )
    assert full.blend.query == 0 and full.cache.get_seq_length() == len(full.token_ids)
    with pytest.raises(InputError, match="question is empty"):
        sdk.load_contexts(list(PAGES), model=model, store=store, question="  ")
