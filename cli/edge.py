"""`kvcdn edge serve` and `kvcdn warm`: edge cache nodes."""

from __future__ import annotations

import re
import sys
import time
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
    _read_token,
    _trust,
    cli,
    endpoint_option,
    err,
    json_option,
    out,
    require_expiry_option,
    store_option,
    trust_option,
)


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
@click.option(
    "--idle-timeout",
    default=15.0,
    show_default=True,
    type=click.FloatRange(min=0.1, max=3600),
    metavar="SECONDS",
    help="Close a connection that sends no whole request this long after it opened or "
    "after its last response (a header and idle timeout: slow or silent clients hold "
    "no descriptor).",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    metavar="N",
    help="Answer 503 to connections beyond N open ones. [default: what the descriptor "
    "limit, raised to its maximum, leaves room for]",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1, max=256),
    metavar="N",
    help="Worker processes: N event loops on N cores, one port (SO_REUSEPORT) and one "
    "cache folder. A miss reaches the origin once across workers, --max-bytes bounds the "
    "folder, /metrics sums them, any worker answers for every warm job; a worker that "
    "dies is started again. 1: a single process, no supervisor. [default: the cores this "
    "process may use; 1 with --rate-limit or --throttle-trace]",
)
@click.option(
    "--cpu-affinity",
    type=click.Choice(["auto", "off"]),
    default="auto",
    show_default=True,
    help="With --workers above 1: auto runs worker i on the i-th core this process may "
    "use (nginx's worker_cpu_affinity auto), so the scheduler never moves a worker "
    "away from its caches (2 workers on 2 cores: 12-24% more hits, docs/edge.md); "
    "off lets the kernel place them, for a host whose cores other pinned programs share.",
)
@click.option("--worker-name", hidden=True, help="(Internal: set by the supervisor.)")
@trust_option
@click.option(
    "--s3-keys",
    "s3_keys_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File of 'ACCESS_KEY_ID SECRET_ACCESS_KEY' lines: S3 clients must sign their "
    "requests with one of these keys (AWS Signature V4).",
)
@click.option(
    "--pointer-ttl",
    default=5,  # edge.fill.POINTER_TTL_S (not imported: the CLI starts without aiohttp)
    show_default=True,
    type=click.IntRange(min=0, max=86400),
    metavar="SECONDS",
    help="Reuse a latest pointer (and, without --trust, a manifest) this long before asking "
    "the origin again; also its Cache-Control max-age. Longer: fewer origin requests, "
    "slower to see a new version. 0 asks on every request (concurrent ones share a fetch).",
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
    idle_timeout: float,
    max_connections: int | None,
    workers: int | None,
    cpu_affinity: str,
    worker_name: str | None,
    trust_file: Path | None,
    s3_keys_file: Path | None,
    pointer_ttl: int,
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

    --workers N (default: one per core) runs N processes behind one port,
    sharing the cache folder: use it to serve more than one core can (tens of
    Gbit/s); --workers 1 is one process. Each worker keeps a core of its own
    (--cpu-affinity off lets the kernel move them).

    \b
      kvcdn edge serve --origin s3://kv/prod --cache-dir /var/cache/kvcdn --max-bytes 200G
      kvcdn edge serve --origin s3://kv/prod --cache-dir /var/cache/kvcdn --workers 8 ...
      kvcdn edge serve --origin s3://kv/prod --parent http://regional-edge:8080 ...
      kvcdn edge serve --origin s3://kv/prod --trust publishers.pub --s3-keys clients.keys ...
    """

    from kvcdn.edge.cache import DiskCache
    from kvcdn.edge.origin import open_origin
    from kvcdn.edge.s3api import BucketView
    from kvcdn.edge.s3auth import S3Keys
    from kvcdn.edge.server import Edge, run
    from kvcdn.edge.shared import Shared
    from kvcdn.edge.workers import (
        available_cores,
        remove_leftovers,
        supervise,
        worker_command,
        worker_cores,
    )
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
    read_token = _read_token(token_file)
    trust = TrustPolicy.from_file(trust_file) if trust_file else None
    s3_keys = S3Keys.from_file(s3_keys_file) if s3_keys_file else None
    # refuses an origin that does not exist
    origins = [open_origin(origin, origin_timeout, endpoint_url=endpoint_url)]
    if parent:  # a parent edge of the same network takes the same read token
        origins.insert(0, open_origin(parent, origin_timeout, read_token))
    shaped = bool(rate_limit or throttle_trace)
    if shaped and workers is not None and workers > 1:
        # each worker would send at the whole rate, or replay the trace on its own clock
        raise click.UsageError(
            "--rate-limit and --throttle-trace shape one link, which one process sends on: "
            "leave --workers out (a shaped edge runs one process) or set it to 1"
        )
    n_workers = workers or (1 if shaped else available_cores())
    supervisor = worker_name is None and n_workers > 1
    try:
        if worker_name is not None:  # the supervisor rebuilt the folder and its ledger
            cache = DiskCache(cache_dir, _parse_size(max_bytes, "--max-bytes"),
                              shared=Shared(cache_dir))  # fmt: skip
        else:
            cache = DiskCache(cache_dir, _parse_size(max_bytes, "--max-bytes"))
        if supervisor:
            shared = Shared(cache_dir)
            shared.set_totals(cache.bytes, len(cache))
            shared.start_run()
    except OSError as exc:
        raise click.BadParameter(f"cannot use {cache_dir}: {exc.strerror}") from None
    admin_token = _read_token(admin_token_file)
    loopback = _is_loopback(host)
    node = Edge(
        cache,
        origins,
        read_token,
        admin_token=admin_token,
        view=BucketView.for_origin(origin, bucket),
        warm_concurrency=warm_concurrency,
        shaper=_shaper(rate_limit, throttle_trace, throttle_scale, throttle_offset),
        trust=trust,
        s3_keys=s3_keys,
        pointer_ttl_s=pointer_ttl,
        max_stale_s=max_stale,
        admin_open=loopback,
        worker=worker_name,
    )
    _raise_file_limit()
    if worker_name is not None:  # the supervisor said what it serves
        run(node, host, int(port), idle_timeout_s=idle_timeout, max_connections=max_connections,
            reuse_port=True)  # fmt: skip
        return
    checks = [n for n, on in (("signed manifests", trust), ("S3 signatures", s3_keys)) if on]
    note = f" (verifying {' and '.join(checks)})" if checks else ""
    if supervisor:
        _check_port_free(host, int(port))
        note += f", {n_workers} workers"
    err.print(f"kvcdn edge on http://{host}:{port} → {escape(origin)}{note}")
    if s3_keys is not None and read_token is None:
        err.print(
            "note: with --s3-keys and no --token-file only signed S3 requests can read; "
            "kvcdn SDK readers send the bearer token of --token-file"
        )
    if not loopback and admin_token is None and read_token is None:
        err.print(
            f"note: listening on {escape(host)} beyond loopback without --admin-token-file: "
            "POST /warm and /shaping are refused (403)"
        )
    if supervisor:
        argv = sys.argv[1:]
        if "serve" not in argv:
            raise click.UsageError("--workers above 1 needs `kvcdn edge serve` as the command")
        counters = cache_dir / "workers"
        status = supervise(lambda name: worker_command(argv, name), n_workers, counters,
                           lambda pid: remove_leftovers(cache_dir, pid),
                           worker_cores(cpu_affinity))  # fmt: skip
        raise SystemExit(status)
    run(node, host, int(port), idle_timeout_s=idle_timeout, max_connections=max_connections)


def _check_port_free(host: str, port: int) -> None:
    """Refuse a --listen address in use before any worker starts (each worker's
    SO_REUSEPORT bind would fail alone, and be restarted in vain)."""
    import socket

    from kvcdn.errors import InputError

    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable from this machine only."""
    import ipaddress

    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _raise_file_limit() -> None:
    """An edge serves many connections, each a descriptor: take the hard limit
    (as nginx's worker_rlimit_nofile does), up to a million."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < min(want, 1 << 20):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 1 << 20), hard))
        except (ValueError, OSError):
            pass  # the limit stays; max_connections follows it


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
@click.argument("refs", nargs=-1, metavar="NAME[@VERSION]...")
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
@click.option(
    "--prefix",
    metavar="PREFIX",
    help="Also warm the latest version of every document whose name starts with PREFIX "
    "('' for all).",
)
@store_option
@endpoint_option
@trust_option
@require_expiry_option
@json_option
def warm(
    refs: tuple[str, ...],
    edges: tuple[str, ...],
    levels: str | None,
    replicas: int,
    admin_token_file: Path | None,
    no_wait: bool,
    prefix: str | None,
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
    again. With --prefix, every document whose name starts with it is warmed
    (a store of many documents: an edge gets one job per 4,096 keys, at most 4 running
    at once).

    \b
      kvcdn warm sed-manual bash@3 --edge http://edge-a:8080 --edge http://edge-b:8080
      kvcdn warm sed-manual --edge http://edge-a:8080 --levels default,lowest
      kvcdn warm --prefix man- --edge http://edge-a:8080 --edge http://edge-b:8080
    """
    from concurrent.futures import ThreadPoolExecutor

    from kvcdn.catalog import list_documents, parse_ref, read_manifest
    from kvcdn.sdk.edges import warm_edges

    if not refs and prefix is None:
        raise click.UsageError("name the documents to warm (NAME[@VERSION]...) or --prefix")
    parsed = [parse_ref(ref) for ref in refs]
    target = _open(store, endpoint_url)
    trust = _trust(trust_file)
    if prefix is not None:
        found = [(d.name, None) for d in list_documents(target, prefix=prefix)]
        if not found:
            raise click.UsageError(f"no document in {target.url} is named {prefix}*")
        parsed += found

    def manifest_of(ref: tuple[str, int | None]) -> Any:
        return read_manifest(target, ref[0], ref[1], trust=trust)

    # Many documents: their manifests are read 16 at a time (a trust file's record of
    # the versions seen is kept by one reader, so with one they are read in turn).
    with ThreadPoolExecutor(16 if trust is None else 1) as pool:
        manifests = list(pool.map(manifest_of, parsed))
    chosen = [lv.strip() for lv in levels.split(",") if lv.strip()] if levels else None
    started = time.monotonic()
    with _progress(not as_json and not no_wait) as progress:
        bars: dict[str, Any] = {}

        def advance(assignment: Any, done: int, total: int) -> None:
            job = id(assignment)  # an edge gets one job per 4,096 keys
            if job not in bars:
                bars[job] = progress.add_task(escape(assignment.edge), total=total)
            progress.update(bars[job], completed=done)

        outcomes = warm_edges(
            manifests,
            list(edges),
            levels=chosen,
            replicas=replicas,
            admin_token=_read_token(admin_token_file),
            wait=not no_wait,
            on_progress=advance,
        )
    seconds = time.monotonic() - started
    report = reports.warmed(outcomes, seconds)
    rows = report["edges"]
    failed = not all(o.ok for o in outcomes)
    if as_json:
        _emit_json(report)
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
            bad = sum(not o.ok for o in outcomes)
            out.print(f"[red]warming incomplete[/]: {bad} of {len(rows)} edge(s) failed")
        else:
            out.print(
                f"[green]✓[/] warmed {len(manifests)} document(s) on {len(rows)} edge(s) "
                f"in {seconds:.1f} s"
            )
    if failed:
        raise click.exceptions.Exit(1)


# ---- ask / demo -----------------------------------------------------------------
