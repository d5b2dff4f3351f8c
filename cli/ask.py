"""`kvcdn ask` and `kvcdn demo`: answers from published KV, beside a full prefill."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape

if TYPE_CHECKING:
    from kvcdn import sdk

from . import reports
from .app import (
    _emit_json,
    _mb,
    _open,
    _progress,
    _progress_callback,
    _read_token,
    _signer_text,
    _trust,
    cli,
    device_option,
    endpoint_option,
    err,
    json_option,
    model_option,
    out,
    require_expiry_option,
    store_option,
    trust_option,
)

DEMO_QUESTION = "What is sed?"


@cli.command()
@click.argument("args", nargs=-1, required=True, metavar="DOC... QUESTION")
@click.option(
    "--docs",
    "several",
    is_flag=True,
    help="The arguments are several documents, then the question: answer from all of them "
    "at once (CacheBlend). Implied by more than one DOC.",
)
@click.option(
    "--recompute-ratio",
    type=click.FloatRange(0.0, 1.0),
    default=0.15,
    show_default=True,
    help="With several documents: the fraction of their tokens recomputed so that later "
    "documents attend to earlier ones (1 is a full prefill).",
)
@click.option(
    "--no-blend",
    is_flag=True,
    help="With several documents: only concatenate their caches (full reuse, no recompute).",
)
@click.option(
    "--separator",
    metavar="TEXT",
    help="With several documents: the text between two of them. [default: the model's chat "
    "template's boundary between two user turns]",
)
@click.option(
    "--quality",
    "--level",
    "quality",
    default="auto",
    show_default=True,
    help="'auto': choose each chunk's level (or recompute it) by the link, the device and "
    "--deadline; a level name loads every chunk at that level; 'text' recomputes everything.",
)
@click.option(
    "--deadline",
    "deadline_s",
    type=click.FloatRange(min=0.0, min_open=True),
    metavar="SECONDS",
    help="Time-to-first-token deadline for --quality auto: the best quality that arrives in "
    "time. [default: none, every chunk at the best level]",
)
@click.option(
    "--compare",
    is_flag=True,
    help="Also answer after a full prefill and print both times to first token.",
)
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1, 4096))
@click.option(
    "--edge",
    "edges",
    multiple=True,
    metavar="URL",
    help="Read through this edge node (repeat for several; failover in placement order, "
    "then --store if given).",
)
@click.option(
    "--edge-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the edges' read token.",
)
@model_option
@store_option
@endpoint_option
@trust_option
@require_expiry_option
@device_option
@json_option
def ask(
    args: tuple[str, ...],
    several: bool,
    recompute_ratio: float,
    no_blend: bool,
    separator: str | None,
    quality: str,
    deadline_s: float | None,
    compare: bool,
    max_new_tokens: int,
    edges: tuple[str, ...],
    edge_token_file: Path | None,
    model: str | None,
    store: str | None,
    endpoint_url: str | None,
    trust_file: Path | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Answer QUESTION from the published KV cache of DOC (or of several DOCs).

    DOC is a document name (name or name@version), or the path of a document
    that was published. With several, their caches are blended into one
    (CacheBlend): placed one after another, moved to their new positions, and
    --recompute-ratio of their tokens recomputed so that the model reads them
    as one prompt. The tokens recomputed are those that matter most to
    QUESTION; --compare then prefills that same prompt.

    With --trust, only KV signed by a trusted publisher key is loaded.

    \b
      kvcdn ask sed-manual "How do I edit a file in place?" --compare
      kvcdn ask sed-manual "..." --deadline 0.5 --edge http://edge-a:8080
      kvcdn ask sed-manual "..." --quality default     # every chunk at one level
      kvcdn ask --docs sed-manual grep-manual "How do both ignore case?" --compare
    """
    if len(args) < 2:
        raise click.UsageError("give a document and a question (DOC... QUESTION)")
    docs, question = list(args[:-1]), args[-1]
    _check_asked(docs, question)  # before the model spends seconds loading
    from kvcdn import sdk

    trust = _trust(trust_file)
    client = sdk.Client(
        _open(store, endpoint_url) if store or not edges else None,
        edges=list(edges) or None,
        edge_token=_read_token(edge_token_file),
        trust=trust,
        device=device,
    )
    if several or len(docs) > 1:
        result = _ask_blended(
            docs,
            question,
            recompute_ratio=0.0 if no_blend else recompute_ratio,
            separator=separator,
            quality=quality,
            deadline_s=deadline_s,
            compare=compare,
            max_new_tokens=max_new_tokens,
            model=model,
            client=client,
        )
    else:
        result = _ask(
            docs[0], question, quality, deadline_s, compare, max_new_tokens, model, client
        )
    if as_json:
        _emit_json(result)
    else:
        _print_answers(result)


def _check_asked(docs: list[str], question: str) -> None:
    """Names and the question, checked without the model: mistakes fail at once."""
    from kvcdn.catalog import parse_ref
    from kvcdn.document import is_document_path
    from kvcdn.errors import InputError

    if not question.strip():
        raise InputError("the question is empty")
    for doc in docs:
        if not is_document_path(doc):
            parse_ref(doc)


def _ask_blended(
    docs: list[str],
    question: str,
    *,
    recompute_ratio: float,
    separator: str | None,
    quality: str,
    deadline_s: float | None,
    compare: bool,
    max_new_tokens: int,
    model: str | None,
    client: sdk.Client,
) -> dict[str, Any]:
    with err.status(f"loading and blending {len(docs)} documents…"):
        ctx = client.load_contexts(
            docs,
            model=model,
            recompute_ratio=recompute_ratio,
            separator=separator,
            quality=quality,
            deadline_s=deadline_s,
            question=question,
        )
    return _answered(ctx, question, compare, max_new_tokens, ctx.manifests, ctx.plans,
                     ready_s=ctx.ready_s, blend_report=ctx.blend)  # fmt: skip


def _answered(
    ctx: sdk.BaseContext,
    question: str,
    compare: bool,
    max_new_tokens: int,
    manifests: list[Any],
    plans: list[sdk.LoadPlan],
    *,
    ready_s: float,
    blend_report: Any,
) -> dict[str, Any]:
    """Answer from the loaded KV (and, with ``compare``, after a full prefill): the
    ``--json`` report of ``ask``."""
    answer = ctx.generate(question, max_new_tokens=max_new_tokens)
    prefill = None
    if compare:
        with err.status("answering after a full prefill…"):
            prefill = ctx.answer_with_prefill(question, max_new_tokens=max_new_tokens)
    return reports.asked(
        question, manifests, plans, answer=answer, ready_s=ready_s,
        blend_report=blend_report, prefill=prefill,
    )  # fmt: skip


def _print_prefill(result: dict[str, Any]) -> None:
    if result["prefill"] is None:
        return
    pf = result["prefill"]
    out.print(f"\n[bold magenta]full prefill[/] first token after {pf['ttft_s']:.2f} s")
    out.print(escape(pf["answer"]))
    same = "same answer" if result["same_answer"] else "answers differ"
    out.print(f"\n[bold green]{result['speedup']:.1f}× faster to first token[/] ({same})")


def _ask(
    doc: str,
    question: str,
    quality: str,
    deadline_s: float | None,
    compare: bool,
    max_new_tokens: int,
    model: str | None,
    client: sdk.Client,
) -> dict[str, Any]:
    # the model loads inside, off the clock: a one-off cost of the process
    with err.status("loading…"):
        ctx = client.load_context(doc, model=model, quality=quality, deadline_s=deadline_s)
    return _answered(ctx, question, compare, max_new_tokens, [ctx.manifest], [ctx.plan],
                     ready_s=ctx.plan.ready_s, blend_report=None)  # fmt: skip


def _print_answers(result: dict[str, Any]) -> None:
    """``kvcdn ask``'s report for people, from the same dict ``--json`` prints."""
    kv, docs = result["kvcdn"], result["documents"]
    names = " + ".join(d["ref"] for d in docs)
    out.print(f"[bold]{escape(names)}[/] · {escape(result['question'])}")
    b = kv["blend"]
    if b is None:
        how = docs[0]["load"]["quality"]
    elif b["recompute_ratio"] > 0:
        how = f"blended, {b['recomputed']} of {b['reused']} tokens recomputed" + (
            " for the question" if b["chosen_for_question"] else ""
        )
    else:
        how = "concatenated, nothing recomputed"
    out.print(f"\n[bold cyan]kvcdn ({how})[/] first token after {kv['ttft_s']:.2f} s")
    for doc in docs:
        load = doc["load"]
        levels = ", ".join(f"{n}×{lv}" for lv, n in load["levels"].items())
        line = f"[dim]{escape(doc['ref']) + ': ' if b is not None else ''}{levels}"
        line += f"; {_mb(load['bytes'])}"
        if load["predicted_ttft_s"] is not None and b is None:
            line += f"; planned {load['predicted_ttft_s']:.2f} s"
        if load["deadline_s"] is not None and b is None:
            met = kv["ttft_s"] <= load["deadline_s"]
            line += f"; deadline {load['deadline_s']:g} s {'met' if met else '[red]missed[/]'}"
        out.print(f"{line}; {escape(_signer_text(doc['signed_by']))}[/]")
        sources = load["sources"]
        if any(source.startswith("http") or source == "origin" for source in sources):
            served = ", ".join(f"{escape(s)} ({n} chunks)" for s, n in sources.items())
            out.print(f"[dim]served by {served}[/]")
        _print_rejected(load["rejected"])
        _print_failed(load["chunks"])
    out.print(escape(kv["answer"]))
    _print_prefill(result)


def _print_failed(chunks: list[dict[str, Any]], shown: int = 5) -> None:
    """Chunks whose objects could not be used, and how they were loaded instead."""
    failed = [c for c in chunks if c["failed"]]
    for c in failed[:shown]:
        how = "recomputed from its text" if c["level"] == "text" else f"loaded at {c['level']}"
        err.print(f"[yellow]note:[/] chunk {c['index']} {how}: {escape('; '.join(c['failed']))}",
                  highlight=False)  # fmt: skip
    if len(failed) > shown:
        err.print(f"[yellow]note:[/] {len(failed) - shown} more chunks like these")


def _print_rejected(rejected: list[str]) -> None:
    for line in rejected:
        err.print(f"[yellow]warning:[/] {escape(line)} (skipped)", highlight=False)


@cli.command()
@store_option
@endpoint_option
@device_option
@json_option
def demo(store: str | None, endpoint_url: str | None, device: str | None, as_json: bool) -> None:
    """The whole loop on embedded defaults: publish a bundled document, ask it both ways.

    Publishes the sed manual with smollm2-135m to the store, then answers a
    question from the published KV cache and after a full prefill, and prints
    both times to first token.
    """
    from kvcdn import sdk
    from kvcdn.publish import publish as do_publish

    target = _open(store, endpoint_url, create=True)
    client = sdk.Client(target, device=device)
    source = resources.files("kvcdn.cli") / "data" / "sed-manual.txt"
    with resources.as_file(source) as path:
        t = time.perf_counter()
        with err.status("loading model (the first time, converting it: ~20 s)…"):
            loaded = client.model()  # kept by the client for the answer
        model_s = time.perf_counter() - t
        with _progress(not as_json) as progress:
            published = do_publish(
                path,
                model=loaded,
                store=target,
                progress=_progress_callback(progress, "sed-manual"),
            )
    setup = {
        "model_load_s": model_s,
        "materialise_s": loaded.materialise_s,
        "calibrate_s": published.seconds.get("calibrate", 0.0),
    }
    if not as_json:
        state = "already published" if published.unchanged else "published"
        out.print(
            f"[green]✓[/] {published.name}@{published.version} {state} to "
            f"{escape(target.url)} ({published.token_count} tokens)"
        )
        line = f"model loaded in {model_s:.1f} s"
        if setup["materialise_s"]:
            line += (
                f", of which {setup['materialise_s']:.1f} s converting it to a Hugging Face "
                "folder (once on this machine)"
            )
        if setup["calibrate_s"]:
            line += (
                f"; the publish calibrated the model's codec first, {setup['calibrate_s']:.1f} s "
                "(once per store)"
            )
        out.print(f"[dim]{line}[/]\n")
    result = _ask(
        f"{published.name}@{published.version}", DEMO_QUESTION, "auto", None, True, 48, None,
        client,
    )  # fmt: skip
    if as_json:
        _emit_json({"publish": reports.published(published), "setup": setup, "ask": result})
    else:
        _print_answers(result)
