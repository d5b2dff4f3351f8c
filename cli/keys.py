"""`kvcdn keys`: publisher signing keys."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape

from . import reports
from .app import (
    _emit_json,
    cli,
    json_option,
    out,
)


@cli.group()
def keys() -> None:
    """Publisher keys: sign what you publish, so readers load only what you signed.

    \b
      kvcdn keys new ~/.config/kvcdn/publisher.key     # also writes publisher.key.pub
      kvcdn publish manual.md --sign-key ~/.config/kvcdn/publisher.key
      cat publisher.key.pub >> trusted.pub              # on each reader and edge
      kvcdn ask manual "How do I ...?" --trust trusted.pub

    A trust file holds one public key per line ('ed25519:<base64> name'). To
    rotate a key, publish with both keys (--sign-key old --sign-key new), add
    the new one to every trust file, then drop the old one: docs/trust.md.
    """


@keys.command("new")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--name", "comment", help="A name for the key in trust files. [default: PATH's stem]")
@json_option
def keys_new(path: Path, comment: str | None, as_json: bool) -> None:
    """Make an ed25519 key pair: PATH (private, readable by you only) and PATH.pub."""
    from kvcdn.signing import SigningKey

    key = SigningKey.generate(comment or path.stem)
    key.save(path)
    if as_json:
        _emit_json(reports.key_made(path, key.public))
        return
    out.print(f"[green]✓[/] private key {escape(str(path))} (keep it secret)")
    out.print(f"public key {escape(str(path))}.pub, id {key.public.id}:")
    out.print(f"{key.public.text} {escape(key.public.comment)}", highlight=False, soft_wrap=True)


@keys.command("show")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@json_option
def keys_show(path: Path, as_json: bool) -> None:
    """Print the public key(s) of a private key, a .pub file or a trust file."""
    from kvcdn.errors import InputError
    from kvcdn.signing import SigningKey, read_public_keys

    try:
        public = [SigningKey.load(path).public]
    except InputError:
        public = read_public_keys(path)
    if as_json:
        _emit_json(reports.public_keys(public))
        return
    for k in public:
        out.print(f"{k.text} {escape(k.comment)}  [dim]id {k.id}[/]", highlight=False)


# ---- edge -----------------------------------------------------------------------
