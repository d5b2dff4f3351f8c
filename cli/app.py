"""What every kvcdn command shares: the click group, common options, consoles, helpers."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from kvcdn.errors import InputError, KvcdnError
from kvcdn.store import Store

if TYPE_CHECKING:
    from kvcdn.signing import TrustPolicy

out = Console()
err = Console(stderr=True)

class KvcdnGroup(click.Group):
    """A click group that turns kvcdn errors into one-line messages."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvcdnError as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            err.print("interrupted")
            ctx.exit(130)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


store_option = click.option(
    "--store",
    envvar="KVCDN_STORE",
    help="Where KV lives: a folder, s3://bucket/prefix or memory://. "
    "[env KVCDN_STORE; default ~/.cache/kvcdn/store]",
)


endpoint_option = click.option(
    "--endpoint-url",
    envvar="AWS_ENDPOINT_URL",
    help="S3-compatible endpoint (MinIO, Ceph RGW, R2, moto...). [env AWS_ENDPOINT_URL]",
)
trust_option = click.option(
    "--trust",
    "trust_file",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="KVCDN_TRUST",
    help="Trust file: accept only documents signed by these publisher keys (one "
    "'ed25519:... name' line each; see `kvcdn keys`), and never an older latest version "
    "than one seen before. [env KVCDN_TRUST]",
)
_REQUIRE_EXPIRY = "kvcdn.require_expiry"


def _keep_require_expiry(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    # kept for _trust() rather than passed to each command: the policy is the trust
    # file's business, and every reader builds its policy there
    ctx.meta[_REQUIRE_EXPIRY] = value
    return value


require_expiry_option = click.option(
    "--require-expiry",
    is_flag=True,
    envvar="KVCDN_REQUIRE_EXPIRY",
    expose_value=False,
    callback=_keep_require_expiry,
    help="With --trust: take a document's latest version only from a pointer a trusted key "
    "signed with an expiry that has not passed, so that a store cannot replay an old pointer "
    "to this reader; a pointer without an expiry, or none, is refused (docs/trust.md). "
    "[env KVCDN_REQUIRE_EXPIRY]",
)
model_option = click.option(
    "--model",
    help="Alias (smollm2-135m, llama-70b, llama-8b, mistral-7b, qwen2.5-7b), Hugging Face id "
    "or local path. [default: smollm2-135m for publish; the published model otherwise]",
)
device_option = click.option(
    "--device", help="Where the model runs: cpu, cuda, cuda:1... [default: cuda if present]"
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


def _open(store: str | None, endpoint_url: str | None, *, create: bool = False) -> Store:
    """The store to read (``create=False``: a folder that does not exist is an error)
    or to publish to (``create=True``)."""
    from kvcdn.store import check_endpoint_url, open_store

    return open_store(store, endpoint_url=check_endpoint_url(endpoint_url), create=create)


def _trust(path: Path | None) -> TrustPolicy | None:
    """The trust policy of a trust file. The versions it has seen are kept between runs
    in ``$XDG_STATE_HOME/kvcdn/seen/{digest of the trust file's path}.json``: one
    history per trust file, whichever store or edge a document is read through."""
    import hashlib

    from kvcdn import paths
    from kvcdn.signing import TrustPolicy

    ctx = click.get_current_context(silent=True)
    require_expiry = bool(ctx is not None and ctx.meta.get(_REQUIRE_EXPIRY))
    if path is None:
        if require_expiry:
            raise click.UsageError(
                "--require-expiry (or KVCDN_REQUIRE_EXPIRY) needs --trust: only pointers "
                "signed by trusted keys carry an expiry worth checking"
            )
        return None
    state = paths.state_dir()
    digest = hashlib.sha256(str(path.expanduser().absolute()).encode()).hexdigest()[:16]
    return TrustPolicy.from_file(
        path, state_path=state / "seen" / f"{digest}.json", require_expiry=require_expiry
    )


def parse_duration(text: str, option: str = "--grace") -> float:
    """``30s``, ``15m``, ``6h``, ``2d`` or a number of seconds -> seconds; an
    :class:`InputError` naming ``option`` otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value = text.strip().lower()
    scale = units.get(value[-1:], None)
    number = value[:-1] if scale else value
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise InputError(
            f"{option} {text!r} is not a duration: use a number with s, m, h or d "
            "(30s, 15m, 6h, 2d)"
        )
    return seconds


def _signer_text(signed_by: dict[str, Any] | None) -> str:
    """A signer as ``--json`` reports it (``reports.signer``), in words."""
    if signed_by is None:
        return "unsigned"
    key = signed_by["key_id"] + (f" ({signed_by['name']})" if signed_by["name"] else "")
    if signed_by["trusted"]:
        return f"signed by {key}, trusted"
    return f"signed by {key}, not checked against a trust file"


@click.group(cls=KvcdnGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug).")
@click.version_option(package_name="kvcdn")
def cli(verbose: int) -> None:
    """kvcdn: publish a document's KV cache once, answer from it anywhere.

    \b
    Typical use:
      kvcdn publish manual.md                 # prefill, encode, upload
      kvcdn ls                                # what the store holds
      kvcdn inspect manual                    # levels, sizes, chunks
      kvcdn ask manual "How do I ...?" --compare
      kvcdn demo                              # all of it on a bundled document
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s"
    )


# ---- publish --------------------------------------------------------------------

def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=not enabled,
        transient=True,
    )


def _progress_callback(progress: Progress, label: str) -> Callable[[str, int, int], None]:
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = progress.add_task(f"{label}: {stage}", total=total)
        progress.update(tasks[stage], completed=done, total=total)

    return update


# ---- ls / inspect ---------------------------------------------------------------


def _read_token(path: Path | None) -> str | None:
    from kvcdn.signing import read_bounded

    if path is None:
        return None
    try:
        token = read_bounded(path, 64 << 10, "token file").decode("utf-8").strip()
    except (KvcdnError, UnicodeDecodeError) as exc:
        raise click.BadParameter(
            str(exc) if isinstance(exc, KvcdnError) else f"{path} is not text"
        ) from None
    if not token:
        raise click.BadParameter(f"{path} is empty")
    return token


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


