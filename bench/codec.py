"""Codec benchmark: kvcdn's KV codec ladder against baselines, in one run.

    python bench/codec.py [--docs FILE ...] [--context-tokens 2048] [--repeat 3]
                          [--json OUT.json] [--plot OUT.png] [--threads N]

For each document (none of them a calibration text): prefill its first
``--context-tokens`` tokens (the context), then score every reconstruction of
the context's KV on the next 257 tokens against the exact KV
(:mod:`kvcdn.quality`: mean next-token KL, perplexity change, top-1 agreement).

Rows, all measured in the same run:

* the codec profile's ladder levels (nearlossless ... lowest) and the fixed
  levels fp16 and int8: real containers (``encode_chunk`` per 256-token chunk,
  ``decode_chunk`` into a float32 tensor), real sizes, timed encode and decode
  (fp16-equivalent MB/s, best of ``--repeat`` after a warm-up); for ladder
  levels also the numba rANS kernel alone on the whole document;
* baselines, sizes *estimated* (ideal empirical entropy per stream, plus the
  frequency tables at 16 bits per non-zero bin, plus scales): CacheGen-style
  anchor/delta quantisation with 32/16/16 bins per layer band, and per-token
  asymmetric int4;
* ablations of the default level, sizes *estimated* (ideal empirical entropy per
  stream, no table cost, sinks at 16 bits): the same quantiser with one design
  choice changed. ``default-est`` is the default level under that same
  estimator, the fair reference for them.

Estimated rows carry ``"estimate": true`` in the JSON and a ``*`` in the tables.
Speed figures need an otherwise idle CPU: the run checks before every model
call whether another process is using the CPU, runs the model on one thread
while one is, and flags the documents whose timings it overlapped.
Default documents: bash(1) (from character 60,000 on), curl(1) and grep(1),
rendered with ``MANWIDTH=80 man -P cat NAME | col -bx``, and one seed text
from ../shared/seeds beside the checkout, where it exists (``--docs`` instead).

This file is the entry point; the parts are in ``bench/codecbench``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, so bench/ (this folder) is on sys.path and the package imports as is.
from codecbench import report
from codecbench.documents import gather_docs
from codecbench.log import log, warn
from codecbench.measure import (
    CONTINUATION_TOKENS,
    Bench,
    calibration_sd,
    measure_document,
    model_threads,
    probe_threads,
)
from codecbench.triton_decode import triton_result

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Rows marked * are entropy estimates, not real bitstreams (see the module doc).",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="documents to benchmark on (default: bash, curl and grep man pages and a seed text "
        "from ../shared/seeds beside the checkout, each where it exists)",
    )
    parser.add_argument("--context-tokens", type=int, default=2048, help="context length")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (best is kept)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="chunk size (default 256)")
    parser.add_argument("--model", default=None, help="model name (default: the embedded one)")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch and numba threads (default: all cores)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "codec.json", help="JSON output")
    parser.add_argument("--plot", type=Path, default=RESULTS / "codec-rd.png", help="PNG output")
    return parser.parse_args()


def main() -> int:
    args = parse_args()

    import torch
    from rich.console import Console

    from kvcdn.calibrate import bundled_texts
    from kvcdn.codec_profile import LADDER
    from kvcdn.kernels import parallel
    from kvcdn.kv import DEFAULT_CHUNK_TOKENS
    from kvcdn.models import load_model
    from kvcdn.profile_store import ensure_profile
    from kvcdn.quality import make_sample
    from kvcdn.store import open_store

    console = Console()
    if not console.is_terminal:  # piped to a file: do not squeeze the tables into 80 columns
        console = Console(width=int(os.environ.get("COLUMNS", 180)))
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    parallel.set_threads(args.threads)
    chunk = args.chunk_tokens or DEFAULT_CHUNK_TOKENS
    machine = report.machine_info()

    tmp = tempfile.TemporaryDirectory(prefix="kvcdn-codec-bench-")
    docs = gather_docs(args.docs, Path(tmp.name))
    if not docs:
        warn("no documents")
        return 1

    t = time.perf_counter()
    model = load_model(args.model)
    log(f"loaded {model.name} on {model.device} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    profile, ref = ensure_profile(open_store("memory://codec-bench"), model)
    log(f"codec profile {profile.sha256[:12]} ready in {time.perf_counter() - t:.1f} s")
    ladder = [name for name in LADDER if name in profile.levels]

    calib = bundled_texts()
    bench = Bench(model, profile, chunk, args.repeat)
    t = time.perf_counter()
    with model_threads(bench.probe()):
        bench.sd_cal = calibration_sd(model, profile)
    log(
        f"calibration statistics (for no-fisher) in {time.perf_counter() - t:.1f} s "
        f"(model threads {sorted(bench.thread_counts)})"
    )

    documents: report.Documents = {}
    doc_info: dict[str, Any] = {}
    busy_docs: list[str] = []
    for name, path, origin in docs:
        text = path.read_text(encoding="utf-8", errors="replace")
        for cname, ctext in calib.items():
            if ctext[:500] in text:
                warn(f"{name} contains the calibration text {cname}: results are not held-out")
        n_tokens = len(model.document_ids(text))
        need = args.context_tokens + CONTINUATION_TOKENS
        if n_tokens < need:
            warn(f"{name} has {n_tokens} tokens, fewer than {need}: skipped")
            continue
        t_doc = time.perf_counter()
        bench.busy, bench.thread_counts = False, set()
        with model_threads(bench.probe()):
            sample = make_sample(model, text, args.context_tokens, CONTINUATION_TOKENS)
        sample.kv = sample.kv.contiguous()
        log(f"{name}: {n_tokens} tokens, sample in {time.perf_counter() - t_doc:.1f} s")
        rows = measure_document(bench, sample, ladder)
        documents[name] = rows
        busy = bench.busy or probe_threads(args.threads)[1]
        if busy:
            busy_docs.append(name)
            warn(
                f"{name}: another process was using the CPU (the model ran on 1 thread "
                "then): this document's speed figures are not representative"
            )
        doc_info[name] = {
            "origin": origin,
            "tokens": n_tokens,
            "characters": len(text),
            "cpu_busy_during_timing": busy,
            "model_threads": sorted(bench.thread_counts),
            "seconds": time.perf_counter() - t_doc,
        }
        log(f"{name}: {len(rows)} rows in {time.perf_counter() - t_doc:.1f} s")
    if not documents:
        warn("no document was long enough")
        return 1

    triton = triton_result()
    summary = report.summarise(documents)
    report.check_targets(summary, ladder)
    report.print_tables(
        console, model.name, args.context_tokens, args.repeat, documents, summary, triton, busy_docs
    )

    elapsed = time.perf_counter() - started
    machine["loadavg_end"] = list(os.getloadavg())
    machine["cpu_busy_documents"] = busy_docs
    run = {
        "context_tokens": args.context_tokens,
        "chunk_tokens": chunk,
        "repeat": args.repeat,
        "documents": doc_info,
        "seconds": elapsed,
    }
    result = report.result(model, profile, ref.key, run, machine, documents, summary, triton)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    title = (
        f"KV codec rate-distortion, {model.name}, mean of {len(documents)} held-out documents "
        f"({args.context_tokens} tokens each)"
    )
    report.plot(summary, ladder, args.plot, title)
    console.print(f"wrote {args.json} and {args.plot} in {elapsed:.0f} s")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
