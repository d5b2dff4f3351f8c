"""The ``kvcdn`` command: thin click commands over the library, rich output for people.

Every command takes ``--json`` to print data for scripts instead. Library
errors become one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcdn.errors import KvcdnError
from kvcdn.store import Store

if TYPE_CHECKING:
    from kvcdn import sdk
    from kvcdn.signing import Signer, SigningKey, TrustPolicy

out = Console()
err = Console(stderr=True)

DEMO_QUESTION = "What is sed?"


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

    if path is None:
        return None
    state = paths.state_dir()
    digest = hashlib.sha256(str(path.expanduser().absolute()).encode()).hexdigest()[:16]
    return TrustPolicy.from_file(path, state_path=state / "seen" / f"{digest}.json")


def _signer_text(signer: Signer | None, trust: TrustPolicy | None) -> str:
    if signer is None:
        return "unsigned"
    if signer.trusted:
        return f"signed by {signer.key.describe()}, trusted"
    return f"signed by {signer.key.describe()}, not checked against a trust file"


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
    trust_file: Path | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Prefill each document, encode its KV at every level, and upload it.

    Objects go up first, the versioned manifest last, so a crash never leaves
    a half-published version; re-running finishes the job, and re-publishing
    an unchanged document changes nothing. A changed document becomes the
    next version and uploads only the chunks that changed.

    The ladder levels need the model's codec profile: the first publish for a
    model calibrates it (about two minutes for smollm2-135m on 2 CPUs) unless
    the store or this machine already has one; see `kvcdn calibrate`.

    With --sign-key, readers that trust the key (--trust) can check that the
    KV they load is exactly what was published; see `kvcdn keys`.

    \b
      kvcdn publish manual.md
      kvcdn publish *.md --store s3://bucket/kv --sign-key ~/.config/kvcdn/publisher.key
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
    with err.status("loading model…"):
        loaded = load_model(model, device)
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
    if as_json:
        _emit_json([r.__dict__ for r in results])


def _signing_keys(paths: tuple[Path, ...]) -> list[SigningKey]:
    import os

    from kvcdn.signing import SigningKey

    passphrase = os.environ.get("KVCDN_SIGN_KEY_PASSPHRASE")
    return [SigningKey.load(p, passphrase.encode() if passphrase else None) for p in paths]


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
        _emit_json([{"name": d.name, "versions": d.versions, "latest": d.latest} for d in docs])
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
        _emit_json({**m.to_json(), "signed_by": m.signer.to_json() if m.signer else None})
        return
    out.print(
        f"[bold]{escape(m.name)}@{m.version}[/]  model {escape(m.model_name)} "
        f"({m.model_fingerprint[:12]})  {m.token_count} tokens in {len(m.chunks)} chunks of "
        f"{m.chunk_tokens}  published {m.created_at}"
    )
    out.print(escape(_signer_text(m.signer, trust)))
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
        _emit_json({"profile": ref.__dict__, "levels": levels, "calibration": profile.calibration})
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
        _emit_json({"private_key": str(path), "public_key": key.public.text, "id": key.public.id})
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
        _emit_json([{"id": k.id, "public_key": k.text, "name": k.comment} for k in public])
        return
    for k in public:
        out.print(f"{k.text} {escape(k.comment)}  [dim]id {k.id}[/]", highlight=False)


# ---- edge -----------------------------------------------------------------------


@cli.group()
def edge() -> None:
    """Edge cache nodes: HTTP byte caches near the GPUs, in front of the store."""


_SIZE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_size(value: str, option: str) -> int:
    text = value.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1] if text and text[-1] in "KMGT" else ""
    number = text[: len(text) - len(unit)]
    try:
        size = int(float(number) * _SIZE[unit])
    except (ValueError, OverflowError):  # not a number, or infinite
        raise click.BadParameter(
            f"{value!r} is not a size (examples: 512M, 20G)", param_hint=option
        ) from None
    if size <= 0:
        raise click.BadParameter("the size must be positive", param_hint=option)
    return size


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


@edge.command("serve")
@click.option(
    "--origin",
    required=True,
    help="Where misses are read from: s3://bucket/prefix, a folder, or http(s)://.",
)
@click.option(
    "--cache-dir",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Folder for cached objects (kept across restarts).",
)
@click.option("--max-bytes", default="10G", show_default=True, help="Cache size limit (LRU).")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, help="HOST:PORT.")
@click.option("--parent", help="A parent edge's URL, asked before the origin (tiered caching).")
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the bearer token clients must send to read.",
)
@click.option(
    "--admin-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the bearer token for POST /warm. [default: the read token, if any]",
)
@click.option(
    "--bucket",
    help="Bucket name S3 clients use for this edge. [default: the origin's bucket, or kvcdn]",
)
@click.option("--origin-timeout", default=30.0, show_default=True, help="Seconds per origin fetch.")
@click.option(
    "--rate-limit",
    metavar="SIZE",
    help="Send at most SIZE bytes per second in all (like nginx's limit_rate), e.g. 20M.",
)
@click.option(
    "--throttle-trace",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Send as fast as this throughput trace allows ('<seconds> <Mbit/s>' lines), "
    "replayed in a loop: for testing adaptive loading over a real link.",
)
@click.option(
    "--throttle-scale",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Multiply the trace's throughput (100 or 1000 model datacenter links).",
)
@click.option(
    "--throttle-offset",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Start the trace this many seconds in.",
)
@click.option(
    "--warm-concurrency",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Origin fetches that warm jobs may run at once.",
)
@trust_option
@click.option(
    "--s3-keys",
    "s3_keys_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File of 'ACCESS_KEY_ID SECRET_ACCESS_KEY' lines: S3 clients must sign their "
    "requests with one of these keys (AWS Signature V4).",
)
@click.option(
    "--max-stale",
    default=86400.0,
    show_default=True,
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="While the origin is down, serve pointers up to this old (with a Warning header).",
)
@endpoint_option
def edge_serve(
    origin: str,
    cache_dir: Path,
    max_bytes: str,
    listen: str,
    parent: str | None,
    token_file: Path | None,
    admin_token_file: Path | None,
    bucket: str | None,
    origin_timeout: float,
    rate_limit: str | None,
    throttle_trace: Path | None,
    throttle_scale: float,
    throttle_offset: float,
    warm_concurrency: int,
    trust_file: Path | None,
    s3_keys_file: Path | None,
    max_stale: float,
    endpoint_url: str | None,
) -> None:
    """Serve store objects over HTTP with a read-through disk cache.

    GET/HEAD /{key} with byte ranges, ETags and conditional requests; chunk
    objects, profiles and manifest versions are immutable, pointers are
    revalidated, and served stale while the origin is down. Concurrent misses
    share one origin fetch; everything is verified against its key before it
    is cached and when served from disk. With --trust, manifests must be
    signed by a trusted key and are then cached for good; without, they are
    revalidated like pointers, since the edge cannot tell a forged one.

    S3 clients (boto3, s3fs, aws s3) read the same objects through
    GET/HEAD /{bucket}/{key} and ListObjectsV2 with --endpoint-url set to the
    edge; with --s3-keys they must sign with one of its keys. POST /warm
    {"keys": [...]} prefetches in the background (see `kvcdn warm`).
    /metrics (Prometheus) and /healthz are always open.

    \b
      kvcdn edge serve --origin s3://kv/prod --cache-dir /var/cache/kvcdn --max-bytes 200G
      kvcdn edge serve --origin s3://kv/prod --parent http://regional-edge:8080 ...
      kvcdn edge serve --origin s3://kv/prod --trust publishers.pub --s3-keys clients.keys ...
    """
    import os

    from kvcdn.edge.cache import DiskCache
    from kvcdn.edge.origin import open_origin
    from kvcdn.edge.s3api import BucketView
    from kvcdn.edge.s3auth import S3Keys
    from kvcdn.edge.server import Edge, run
    from kvcdn.signing import TrustPolicy

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not HOST:PORT", param_hint="--listen")
    if bucket is not None and (bucket in _EDGE_ROUTES or not _BUCKET.match(bucket)):
        raise click.BadParameter(
            f"{bucket!r} cannot be a bucket name here (3-63 lowercase letters, digits, . or -; "
            f"not {', '.join(sorted(_EDGE_ROUTES))})",
            param_hint="--bucket",
        )
    if endpoint_url:
        from kvcdn.store import check_endpoint_url

        os.environ["AWS_ENDPOINT_URL"] = check_endpoint_url(endpoint_url) or ""
    read_token = _read_token(token_file)
    trust = TrustPolicy.from_file(trust_file) if trust_file else None
    s3_keys = S3Keys.from_file(s3_keys_file) if s3_keys_file else None
    origins = [open_origin(origin, origin_timeout)]  # refuses an origin that does not exist
    if parent:  # a parent edge of the same network takes the same read token
        origins.insert(0, open_origin(parent, origin_timeout, read_token))
    try:
        cache = DiskCache(cache_dir, _parse_size(max_bytes, "--max-bytes"))
    except OSError as exc:
        raise click.BadParameter(f"cannot use {cache_dir}: {exc.strerror}") from None
    node = Edge(
        cache,
        origins,
        read_token,
        admin_token=_read_token(admin_token_file),
        view=BucketView.for_origin(origin, bucket),
        warm_concurrency=warm_concurrency,
        shaper=_shaper(rate_limit, throttle_trace, throttle_scale, throttle_offset),
        trust=trust,
        s3_keys=s3_keys,
        max_stale_s=max_stale,
    )
    checks = [n for n, on in (("signed manifests", trust), ("S3 signatures", s3_keys)) if on]
    err.print(
        f"kvcdn edge on http://{host}:{port} → {escape(origin)}"
        + (f" (verifying {' and '.join(checks)})" if checks else "")
    )
    if s3_keys is not None and read_token is None:
        err.print(
            "note: with --s3-keys and no --token-file only signed S3 requests can read; "
            "kvcdn SDK readers send the bearer token of --token-file"
        )
    run(node, host, int(port))


def _shaper(rate: str | None, trace: Path | None, scale: float, offset: float) -> Any:
    from kvcdn.edge.shaping import LinkShaper, Trace, TraceError

    if rate and trace:
        raise click.UsageError("use --rate-limit or --throttle-trace, not both")
    if rate:
        return LinkShaper.fixed(_parse_size(rate, "--rate-limit"))
    if trace:
        try:
            return LinkShaper.replay(Trace.load(trace, scale=scale), offset_s=offset)
        except TraceError as exc:
            raise click.BadParameter(str(exc), param_hint="--throttle-trace") from None
    return None


_EDGE_ROUTES = {"warm", "metrics", "healthz"}
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@cli.command()
@click.argument("refs", nargs=-1, required=True, metavar="NAME[@VERSION]...")
@click.option(
    "--edge",
    "edges",
    multiple=True,
    required=True,
    metavar="URL",
    help="An edge node (repeat for several); each document goes to the edge(s) that "
    "rendezvous hashing of its chain hash picks, as the SDK does.",
)
@click.option(
    "--levels",
    help="Levels to warm, comma-separated. [default: every level the document stores]",
)
@click.option(
    "--replicas",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Edges per document (its first N in placement order).",
)
@click.option(
    "--admin-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the edges' admin token.",
)
@click.option("--no-wait", is_flag=True, help="Start the warm jobs and return.")
@store_option
@endpoint_option
@trust_option
@json_option
def warm(
    refs: tuple[str, ...],
    edges: tuple[str, ...],
    levels: str | None,
    replicas: int,
    admin_token_file: Path | None,
    no_wait: bool,
    store: str | None,
    endpoint_url: str | None,
    trust_file: Path | None,
    as_json: bool,
) -> None:
    """Pre-load edge nodes with documents, so first reads are cache hits.

    Reads each document's manifest from the store, places the document on
    its edge(s), and asks each edge to fetch the document's manifest, codec
    profile and chunk objects in the background, then follows the jobs until
    they finish. Warming is idempotent: objects an edge holds are not fetched
    again.

    \b
      kvcdn warm sed-manual bash@3 --edge http://edge-a:8080 --edge http://edge-b:8080
      kvcdn warm sed-manual --edge http://edge-a:8080 --levels default,lowest
    """
    from kvcdn.catalog import parse_ref, read_manifest
    from kvcdn.errors import AccessDenied
    from kvcdn.sdk.edges import EdgeAdmin, plan_warm

    parsed = [parse_ref(ref) for ref in refs]
    target = _open(store, endpoint_url)
    trust = _trust(trust_file)
    manifests = [read_manifest(target, name, version, trust=trust) for name, version in parsed]
    chosen = [lv.strip() for lv in levels.split(",") if lv.strip()] if levels else None
    plan = plan_warm(manifests, list(edges), chosen, replicas)
    admin = EdgeAdmin(_read_token(admin_token_file))
    jobs: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    refused: set[str] = set()
    for assignment in plan:
        try:
            jobs[assignment.edge] = admin.warm(assignment.edge, assignment.keys)
        except KvcdnError as exc:
            failures[assignment.edge] = str(exc)
            if isinstance(exc, AccessDenied):
                refused.add(assignment.edge)
    started = time.monotonic()
    if not no_wait and jobs:
        with _progress(not as_json) as progress:
            bars = {
                edge: progress.add_task(escape(edge), total=job["total"])
                for edge, job in jobs.items()
            }
            while True:
                for edge, job in list(jobs.items()):
                    if job["state"] == "running" and edge not in failures:
                        try:
                            jobs[edge] = job = admin.job(edge, job["id"])
                        except KvcdnError as exc:  # the edge went away mid-job
                            failures[edge] = str(exc)
                    progress.update(bars[edge], completed=job["done"])
                if all(j["state"] != "running" or e in failures for e, j in jobs.items()):
                    break
                time.sleep(0.2)
    seconds = time.monotonic() - started
    rows = []
    for assignment in plan:
        job = jobs.get(assignment.edge, {})
        rows.append(
            {
                "edge": assignment.edge,
                "documents": assignment.documents,
                "objects": len(assignment.keys),
                "bytes": assignment.bytes,
                "state": (
                    ("refused" if assignment.edge in refused else "unreachable")
                    if assignment.edge in failures
                    else job.get("state")
                ),
                "cached": job.get("cached", 0),
                "fetched": job.get("fetched", 0),
                "failed": job.get("failed", 0),
                "bytes_fetched": job.get("bytes_fetched", 0),
                "errors": (
                    [{"error": failures[assignment.edge]}]
                    if assignment.edge in failures
                    else job.get("errors", [])
                ),
                "job": job.get("id"),
            }
        )
    failed = any(r["state"] in ("unreachable", "refused", "failed") for r in rows)
    if as_json:
        _emit_json({"edges": rows, "seconds": seconds, "ok": not failed})
    else:
        table = Table(box=None, pad_edge=False)
        table.add_column("edge", no_wrap=True)
        table.add_column("documents", overflow="fold", min_width=9)
        table.add_column("objects", justify="right", no_wrap=True)
        table.add_column("state", no_wrap=True)
        table.add_column("fetched", justify="right", no_wrap=True)
        table.add_column("had", justify="right", no_wrap=True)
        for r in rows:
            table.add_row(
                escape(r["edge"]),
                escape(", ".join(r["documents"]) or "(manifests)"),
                f"{r['objects']} ({_mb(r['bytes'])})",
                str(r["state"]),
                f"{r['fetched']} ({_mb(r['bytes_fetched'])})",
                str(r["cached"]),
            )
        out.print(table)
        for r in rows:
            for e in r["errors"][:5]:
                where = f"{e['key']}: " if "key" in e else ""
                err.print(f"[red]✗[/] {escape(r['edge'])}: {escape(where + e['error'])}")
        if no_wait:
            out.print("warm jobs started; follow them at EDGE/warm/JOB")
        elif failed:
            bad = sum(r["state"] in ("unreachable", "refused", "failed") for r in rows)
            out.print(f"[red]warming incomplete[/]: {bad} of {len(rows)} edge(s) failed")
        else:
            out.print(
                f"[green]✓[/] warmed {len(manifests)} document(s) on {len(rows)} edge(s) "
                f"in {seconds:.1f} s"
            )
    if failed:
        raise click.exceptions.Exit(1)


# ---- ask / demo -----------------------------------------------------------------


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
        if as_json:
            _emit_json(result)
        else:
            _print_blended(result)
        return
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
    from kvcdn.errors import InputError
    from kvcdn.publish import is_document_path

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
    trust = client.trust
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
    answer = ctx.generate(question, max_new_tokens=max_new_tokens)
    report = ctx.blend
    result: dict[str, Any] = {
        "documents": [f"{m.name}@{m.version}" for m in ctx.manifests],
        "signed_by": [_signer_text(m.signer, trust) for m in ctx.manifests],
        "question": question,
        "kvcdn": {
            "answer": answer.text,
            "ttft_s": ctx.ready_s + answer.ttft_s,
            "blend": {
                "tokens": report.tokens,
                "reused": report.reused,
                "recomputed": report.recomputed,
                "computed": report.computed,
                "recompute_ratio": report.recompute_ratio,
                "chosen_for_question": report.query > 0,
                "seconds": report.seconds,
            },
            "loads": [
                {
                    "levels": dict(Counter(p.chunk_levels)),
                    "bytes": p.bytes,
                    "ready_s": p.ready_s,
                    "mean_quality": p.mean_quality,
                    "rejected": p.rejected,
                }
                for p in ctx.plans
            ],
        },
    }
    if compare:
        with err.status("answering after a full prefill…"):
            base = ctx.answer_with_prefill(question, max_new_tokens=max_new_tokens)
        _add_prefill(result, base, answer)
    return result


def _add_prefill(result: dict[str, Any], base: Any, answer: Any) -> None:
    """Put the full prefill's answer beside kvcdn's in ``result`` (``--compare``)."""
    result["prefill"] = {"answer": base.text, "ttft_s": base.ttft_s}
    result["speedup"] = base.ttft_s / result["kvcdn"]["ttft_s"]
    result["same_answer"] = base.token_ids == answer.token_ids


def _print_prefill(result: dict[str, Any]) -> None:
    if "prefill" not in result:
        return
    pf = result["prefill"]
    out.print(f"\n[bold magenta]full prefill[/] first token after {pf['ttft_s']:.2f} s")
    out.print(escape(pf["answer"]))
    same = "same answer" if result["same_answer"] else "answers differ"
    out.print(f"\n[bold green]{result['speedup']:.1f}× faster to first token[/] ({same})")


def _print_blended(result: dict[str, Any]) -> None:
    kv = result["kvcdn"]
    b = kv["blend"]
    names = " + ".join(result["documents"])
    out.print(f"[bold]{escape(names)}[/] · {escape(result['question'])}")
    how = (
        f"blended, {b['recomputed']} of {b['reused']} tokens recomputed"
        + (" for the question" if b["chosen_for_question"] else "")
        if b["recompute_ratio"] > 0
        else "concatenated, nothing recomputed"
    )
    out.print(f"\n[bold cyan]kvcdn ({how})[/] first token after {kv['ttft_s']:.2f} s")
    for name, signed, load in zip(
        result["documents"], result["signed_by"], kv["loads"], strict=True
    ):
        levels = ", ".join(f"{n}×{lv}" for lv, n in load["levels"].items())
        out.print(f"[dim]{escape(name)}: {levels}; {_mb(load['bytes'])}; {escape(signed)}[/]")
        _print_rejected(load["rejected"])
    out.print(escape(kv["answer"]))
    _print_prefill(result)


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
    trust = client.trust
    # the model loads inside, off the clock: a one-off cost of the process
    with err.status("loading…"):
        ctx = client.load_context(doc, model=model, quality=quality, deadline_s=deadline_s)
    answer = ctx.generate(question, max_new_tokens=max_new_tokens)
    plan = ctx.plan
    result: dict[str, Any] = {
        "document": ctx.name,
        "question": question,
        "signed_by": _signer_text(ctx.manifest.signer, trust),
        "kvcdn": {
            "answer": answer.text,
            "quality": plan.level,
            "levels": dict(Counter(plan.chunk_levels)),
            "mean_quality": plan.mean_quality,
            "bytes": plan.bytes,
            "sources": dict(Counter(plan.chunk_sources)),
            "load_seconds": plan.seconds,
            "deadline_s": plan.deadline_s,
            "predicted_ttft_s": plan.predicted_ttft_s,
            "ttft_s": plan.ready_s + answer.ttft_s,
            "replans": plan.replans,
            "cancelled_fetches": plan.cancelled,
            "rejected": plan.rejected,
            "chunks": [c.__dict__ for c in plan.chunks],
        },
    }
    if compare:
        with err.status("answering after a full prefill…"):
            base = ctx.answer_with_prefill(question, max_new_tokens=max_new_tokens)
        _add_prefill(result, base, answer)
    return result


def _print_answers(result: dict[str, Any]) -> None:
    kv = result["kvcdn"]
    out.print(f"[bold]{escape(result['document'])}[/] · {escape(result['question'])}")
    levels = ", ".join(f"{n}×{lv}" for lv, n in kv["levels"].items())
    out.print(f"\n[bold cyan]kvcdn ({kv['quality']})[/] first token after {kv['ttft_s']:.2f} s")
    line = f"[dim]{levels}; {_mb(kv['bytes'])}"
    if kv["predicted_ttft_s"] is not None:
        line += f"; planned {kv['predicted_ttft_s']:.2f} s"
    if kv["deadline_s"] is not None:
        met = kv["ttft_s"] <= kv["deadline_s"]
        line += f"; deadline {kv['deadline_s']:g} s {'met' if met else '[red]missed[/]'}"
    out.print(f"{line}; {escape(result['signed_by'])}[/]")
    if any(source.startswith("http") or source == "origin" for source in kv["sources"]):
        served = ", ".join(f"{escape(s)} ({n} chunks)" for s, n in kv["sources"].items())
        out.print(f"[dim]served by {served}[/]")
    _print_rejected(kv["rejected"])
    out.print(escape(kv["answer"]))
    _print_prefill(result)


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
        with err.status("loading model…"):
            loaded = client.model()  # kept by the client for the answer
        with _progress(not as_json) as progress:
            published = do_publish(
                path,
                model=loaded,
                store=target,
                progress=_progress_callback(progress, "sed-manual"),
            )
    if not as_json:
        state = "already published" if published.unchanged else "published"
        out.print(
            f"[green]✓[/] {published.name}@{published.version} {state} to "
            f"{escape(target.url)} ({published.token_count} tokens)\n"
        )
    result = _ask(
        f"{published.name}@{published.version}", DEMO_QUESTION, "auto", None, True, 48, None,
        client,
    )  # fmt: skip
    if as_json:
        _emit_json({"publish": published.__dict__, "ask": result})
    else:
        _print_answers(result)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def main() -> None:
    import os

    # kvcdn loads weights from local files only: keep transformers and
    # huggingface_hub off the network (the library passes local_files_only;
    # this also silences their update checks). The CLI is the host
    # application here, so the environment is its to set.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cli(prog_name="kvcdn")


if __name__ == "__main__":
    sys.exit(main())
