"""`kvcdn ls` and `kvcdn inspect`: what a store holds."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from . import reports
from .app import (
    _emit_json,
    _mb,
    _open,
    _signer_text,
    _trust,
    cli,
    endpoint_option,
    json_option,
    out,
    store_option,
    trust_option,
)


@cli.command("ls")
@store_option
@endpoint_option
@json_option
def ls(store: str | None, endpoint_url: str | None, as_json: bool) -> None:
    """List the documents in the store and their versions."""
    from kvcdn.catalog import list_documents
    from kvcdn.errors import NotFound

    try:
        target = _open(store, endpoint_url)
    except NotFound as exc:
        if (store or "").startswith(("s3://", "s3a://")):
            raise
        # a folder that was never published to holds nothing
        if as_json:
            _emit_json([])
        else:
            out.print(f"no documents: {escape(str(exc))}")
        return
    docs = list_documents(target)
    if as_json:
        _emit_json(reports.listing(docs))
        return
    if not docs:
        out.print(f"no documents in {escape(target.url)}")
        return
    table = Table(title=f"documents in {target.url}")
    table.add_column("name")
    table.add_column("latest", justify="right")
    table.add_column("versions")
    for d in docs:
        table.add_row(d.name, str(d.latest), ", ".join(map(str, d.versions)))
    out.print(table)


@cli.command()
@click.argument("ref", metavar="NAME[@VERSION]")
@store_option
@endpoint_option
@trust_option
@json_option
def inspect(
    ref: str, store: str | None, endpoint_url: str | None, trust_file: Path | None, as_json: bool
) -> None:
    """Show a document version: signer, model, levels, sizes, bits per element, chunks."""
    from kvcdn.catalog import parse_ref, read_manifest

    name, version = parse_ref(ref)
    trust = _trust(trust_file)
    m = read_manifest(_open(store, endpoint_url), name, version, trust=trust)
    if as_json:
        _emit_json(reports.inspected(m))
        return
    out.print(
        f"[bold]{escape(m.name)}@{m.version}[/]  model {escape(m.model_name)} "
        f"({m.model_fingerprint[:12]})  {m.token_count} tokens in {len(m.chunks)} chunks of "
        f"{m.chunk_tokens}  published {m.created_at}"
    )
    out.print(escape(_signer_text(reports.signer(m.signer))))
    layout = m.kv_layout
    out.print(
        f"KV layout: {layout['layers']} layers × {layout['kv_heads']} KV heads × "
        f"{layout['head_dim']} head dim ({layout['dtype']})"
    )
    table = Table(title="levels (quality: measured against exact KV on calibration texts)")
    for col in ("level", "codec", "bytes", "bits/element", "KL", "PPL Δ", "top-1"):
        table.add_column(col, justify="left" if col in ("level", "codec") else "right")
    for lv_name, lv in m.levels.items():
        q = lv.quality
        table.add_row(
            lv_name,
            lv.codec,
            _mb(lv.total_bytes) if lv.total_bytes else "-",
            f"{lv.bits_per_element:.2f}",
            f"{q['kl']:.4f}" if "kl" in q else "-",
            f"{q['ppl_delta_pct']:+.2f}%" if "ppl_delta_pct" in q else "-",
            f"{q['top1_agree']:.1%}" if "top1_agree" in q else "-",
        )
    out.print(table)
    chunks = Table(title="chunks")
    for col in ("#", "tokens", "hash", *m.levels):
        chunks.add_column(col)
    for c in m.chunks:
        chunks.add_row(
            str(c.index),
            f"{c.start}–{c.end}",
            c.hash[:12],
            *(_mb(c.objects[lv].bytes) if lv in c.objects else "-" for lv in m.levels),
        )
    out.print(chunks)


# ---- calibrate ----------------------------------------------------------------
