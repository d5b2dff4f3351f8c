"""`kvcdn models`: the Hugging Face folders kvcdn materialised from GGUF models."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.table import Table

from . import reports
from .app import _emit_json, _mb, cli, json_option, out


@cli.group(invoke_without_command=True)
@json_option
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """Cached model folders: list them (the default) or remove them.

    The first load of a model that ships as a GGUF file (the embedded
    smollm2-135m) writes it once as a standard Hugging Face folder in
    ~/.cache/kvcdn/models/, which every later load reads in a fraction of a
    second, and which vLLM can serve. Removing one costs the next load the
    conversion again (about 20 s for the embedded model).

    \b
      kvcdn models                       # what is cached, and where
      kvcdn models path smollm2-135m     # the folder to give vLLM (made if missing)
      kvcdn models rm smollm2-135m-1a2b3c4d5e6f7a8b
      kvcdn models rm --all
    """
    if ctx.invoked_subcommand is not None:
        return
    from kvcdn.model_cache import list_cached, models_dir

    cached = list_cached()
    if as_json:
        _emit_json(reports.cached_models(cached))
        return
    if not cached:
        out.print(f"no cached model folders in {escape(str(models_dir()))}")
        return
    table = Table(box=None, pad_edge=False)
    # the folder's name is what `kvcdn models rm` takes: never shortened
    table.add_column("folder", no_wrap=True, min_width=max(len(c.key) for c in cached))
    table.add_column("model", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("made", no_wrap=True)
    table.add_column("state", overflow="fold")
    for c in cached:
        table.add_row(
            escape(c.key), escape(c.name), _mb(c.bytes), c.created_at[:10],
            "ok" if c.complete else "[red]incomplete[/] (rebuilt on next load)",
        )  # fmt: skip
    out.print(table)
    out.print(f"[dim]{escape(str(models_dir()))}[/]")


@models.command("rm")
@click.argument("keys", nargs=-1, metavar="FOLDER...")
@click.option("--all", "everything", is_flag=True, help="Remove every cached model folder.")
@json_option
def models_rm(keys: tuple[str, ...], everything: bool, as_json: bool) -> None:
    """Remove cached model folders (by the names `kvcdn models` lists)."""
    from kvcdn.model_cache import list_cached, remove_cached

    if everything == bool(keys):
        raise click.UsageError("give folder names, or --all")
    chosen = [c.key for c in list_cached()] if everything else list(keys)
    removed = [remove_cached(key) for key in chosen]
    if as_json:
        _emit_json(reports.cached_models(removed))
        return
    for c in removed:
        out.print(f"[green]✓[/] removed {escape(c.key)} ({_mb(c.bytes)})")
    if not removed:
        out.print("nothing to remove")


@models.command("path")
@click.argument("model", required=False)
def models_path(model: str | None) -> None:
    """Print the Hugging Face folder of MODEL (default: the embedded one), making it
    first for a GGUF model: what to give an engine that loads folders, as in
    `vllm serve $(kvcdn models path smollm2-135m)` (docs/vllm.md)."""
    from kvcdn.models import model_folder

    click.echo(model_folder(model))
