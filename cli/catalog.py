"""`kvcdn ls` and `kvcdn inspect`: what a store holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from . import reports
from .app import (
    _emit_json,
    _mb,
    _open,
    _progress,
    _signer_text,
    _trust,
    cli,
    endpoint_option,
    json_option,
    out,
    parse_duration,
    require_expiry_option,
    store_option,
    trust_option,
)


@cli.command("ls")
@click.argument("prefix", required=False, default="")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="List at most this many documents (one page). [default: all]",
)
@click.option(
    "--after", metavar="NAME", help="Start after this document: the last name of the previous page."
)
@store_option
@endpoint_option
@json_option
def ls(prefix: str, limit: int | None, after: str | None, store: str | None,
       endpoint_url: str | None, as_json: bool) -> None:  # fmt: skip
    """List the documents whose name starts with PREFIX (all without one), their
    versions, and the latest: the version each document's latest pointer names,
    which readers load.

    Only the store's keys are listed, page by page, and each listed document's
    small pointer read (16 at a time), never a manifest, so a store of any size
    answers quickly. Documents come in key order; page through many with --limit
    and --after:

    \b
      kvcdn ls man- --limit 100
      kvcdn ls man- --limit 100 --after man-grep
    """
    from kvcdn.catalog import list_documents, pointed_versions
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
    docs = list_documents(target, prefix=prefix, after=after, limit=limit)
    pointers = pointed_versions(target, [d.name for d in docs])
    if as_json:
        _emit_json(reports.listing(docs, pointers))
        return
    if not docs:
        what = f"named {prefix}*" if prefix else ""
        out.print(f"no documents {what} in {escape(target.url)}" + (
            f" after {escape(after)}" if after else ""))  # fmt: skip
        return
    table = Table(title=f"documents in {target.url}")
    table.add_column("name")
    table.add_column("latest", justify="right")
    table.add_column("versions")
    for d in docs:
        pointed = pointers[d.name]
        latest = str(pointed) if pointed is not None else f"{d.latest} (no pointer)"
        table.add_row(escape(d.name), latest, _versions_text(d.versions))
    out.print(table)
    if limit is not None and len(docs) == limit:
        import shlex

        what = f"{shlex.quote(prefix)} " if prefix else ""
        more = f"kvcdn ls {what}--limit {limit} --after {shlex.quote(docs[-1].name)}"
        out.print(f"more may follow: {escape(more)}")


def _versions_text(versions: list[int]) -> str:
    if len(versions) <= 8:
        return ", ".join(map(str, versions))
    return f"{versions[0]}, {versions[1]}, … {versions[-2]}, {versions[-1]} ({len(versions)})"


@cli.command()
@click.argument("ref", metavar="NAME[@VERSION]")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@store_option
@endpoint_option
@json_option
def rm(ref: str, dry_run: bool, store: str | None, endpoint_url: str | None,
       as_json: bool) -> None:  # fmt: skip
    """Remove a document (every version) or one version of it.

    The versions' manifests go, with the latest pointer when it named one of
    them (it moves to the newest version left) and their index entries. Chunk
    objects stay, since other versions and documents may share them:
    `kvcdn gc` deletes those no version names any more.

    \b
      kvcdn rm bash-manual@3      # one version
      kvcdn rm bash-manual        # the whole document
      kvcdn gc                    # then free the space
    """
    from kvcdn.catalog import parse_ref
    from kvcdn.gc import remove

    name, version = parse_ref(ref)
    removal = remove(_open(store, endpoint_url), name, version, dry_run=dry_run)
    if as_json:
        _emit_json(reports.removed(removal, dry_run))
        return
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {escape(', '.join(removal.versions))} ({len(removal.keys)} keys, "
              f"{_mb(removal.bytes)} of manifests); objects are freed by `kvcdn gc`")  # fmt: skip


@cli.command()
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=None,
    help="Keep each document's newest N versions; remove older ones first. "
    "[default: keep every version]",
)
@click.option(
    "--grace",
    "grace",
    default="24h",
    show_default=True,
    metavar="DURATION",
    help="Never delete what was written or reused less than this long ago "
    "(30s, 15m, 6h, 2d): longer than any publish that may run meanwhile.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@store_option
@endpoint_option
@json_option
def gc(keep: int | None, grace: str, dry_run: bool, store: str | None,
       endpoint_url: str | None, as_json: bool) -> None:  # fmt: skip
    """Delete the chunk objects and codec profiles no version names any more.

    Objects are shared between versions and documents, so removing a version
    (`kvcdn rm`, or --keep here) leaves them; gc reads every kept manifest and
    deletes what none of them names, unless it is younger than the grace
    period. It is safe while documents are being published: a publish marks
    every object it reuses as new (docs/gc.md).

    \b
      kvcdn gc --dry-run          # what would go, and the bytes freed
      kvcdn gc --keep 3           # keep 3 versions of each document
    """
    from kvcdn.gc import collect

    target = _open(store, endpoint_url)
    with _progress(not as_json) as progress:
        bars: dict[str, Any] = {}

        def advance(stage: str, done: int, total: int) -> None:
            label = {"read": "reading manifests", "delete": "deleting"}.get(stage, stage)
            if stage not in bars:
                bars[stage] = progress.add_task(label, total=total)
            progress.update(bars[stage], completed=done, total=total)

        report = collect(target, keep=keep, grace_s=parse_duration(grace), dry_run=dry_run,
                         progress=advance)  # fmt: skip
    if as_json:
        _emit_json(reports.collected(report))
        return
    verb = "would delete" if report.dry_run else "deleted"
    if report.removal.versions:
        out.print(f"{'would remove' if report.dry_run else 'removed'} "
                  f"{len(report.removal.versions)} old version(s)")  # fmt: skip
    out.print(f"{verb} {len(report.deleted)} object(s) and profile(s): {_mb(report.freed_bytes)} "
              f"freed; {report.manifests} version(s) name {report.referenced} kept")  # fmt: skip
    if report.kept_young:
        young = _mb(report.kept_young_bytes)
        out.print(f"kept {report.kept_young} unreferenced object(s) ({young}) younger than {grace}")
    if report.kept_freshened:
        out.print(f"kept {report.kept_freshened} object(s) a publish reused while gc ran")


@cli.command()
@click.argument("refs", nargs=-1, metavar="[NAME[@VERSION]]...")
@store_option
@endpoint_option
@trust_option
@require_expiry_option
@json_option
def check(refs: tuple[str, ...], store: str | None, endpoint_url: str | None,
          trust_file: Path | None, as_json: bool) -> None:  # fmt: skip
    """Verify a store: every manifest reads, every object and profile a version names
    is there and hashes to what its key says, pointers and index entries name stored
    versions; with --trust, every manifest and pointer is signed by a trusted key.

    Names the documents (or versions) to check; without, the whole store is
    checked and the objects no version names are listed as orphans (what
    `kvcdn gc` would collect once old enough: left by a crashed or concurrent
    publish, or by `kvcdn rm`; not damage). Every object is read once, 16 at a
    time. Nothing is changed.

    Exit code 0: intact (orphans allowed); 5: something is missing or damaged;
    6: all that is wrong is trust (unsigned, signed by other keys, or a latest
    pointer past its signed expiry: `kvcdn refresh NAME` renews it).

    \b
      kvcdn check                       # the whole store, orphans listed
      kvcdn check sed-manual bash@3     # what these versions need
      kvcdn check --trust publishers.pub --json
    """
    from kvcdn.check import NOTICES, check_store

    target = _open(store, endpoint_url)
    with _progress(not as_json) as progress:
        bars: dict[str, Any] = {}

        def advance(stage: str, done: int, total: int) -> None:
            if stage not in bars:
                bars[stage] = progress.add_task(f"checking {stage}", total=total)
            progress.update(bars[stage], completed=done, total=total)

        report = check_store(target, refs, trust=_trust(trust_file), progress=advance)
    if as_json:
        _emit_json(reports.store_check(report))
    else:
        out.print(f"{escape(target.url)}: {report.documents} document(s), {report.versions} "
                  f"version(s), {report.objects} object(s) read ({_mb(report.bytes_read)}) "
                  f"in {report.seconds:.1f} s")  # fmt: skip
        for p in report.problems[:20]:
            users = f" (named by {', '.join(p.used_by[:3])})" if p.used_by else ""
            mark = "[yellow]![/]" if p.kind in NOTICES else "[red]✗[/]"
            out.print(f"{mark} {p.kind}: {escape(p.key)}{escape(users)}: {escape(p.detail)}")
        if len(report.problems) > 20:
            out.print(f"… {len(report.problems) - 20} more (--json lists all)")
        if report.whole_store and report.orphans:
            out.print(f"{len(report.orphans)} orphan(s), {_mb(report.orphan_bytes)}: named by "
                      "no version (`kvcdn gc` collects them once old enough)")  # fmt: skip
        if report.ok:
            out.print("[green]✓[/] intact")
        else:
            out.print(f"[red]{len(report.failures)} problem(s)[/]")
    if report.exit_code:
        raise click.exceptions.Exit(report.exit_code)


@cli.command()
@click.argument("ref", metavar="NAME[@VERSION]")
@store_option
@endpoint_option
@trust_option
@require_expiry_option
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
