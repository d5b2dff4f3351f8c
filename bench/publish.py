"""Publishing throughput: a corpus of man pages serially and on Ray actors, and what
an edit of a document's last tenth costs against a full publish.

    python bench/publish.py [--pages 12] [--chars 4000] [--rounds 3] [--json OUT]
    python bench/publish.py --long [--lengths 4096,16384,32768] [--one-pass-max 16384]

Corpus: the first ``--chars`` characters of ``--pages`` man pages, published into
a fresh local store by each configuration, with the default ladder (the model's
codec profile is made first, outside the clock):

- ``serial, T thread(s)``: one process, the model loaded once, documents one
  after another, PyTorch and the codec on T threads (what ``kvcdn publish`` does);
- ``ray, A actor(s) x T thread(s)``: ``kvcdn.cluster.publish_on_ray`` on a local
  Ray cluster of 2 CPUs started by this script; ``setup`` is Ray starting the
  actors and each loading its model, the rate is counted after it.

Every configuration runs ``--rounds`` times, interleaved; reported are the
medians: documents per minute, seconds per document (wall, and inside the
publish: tokenize, prefill, encode, upload), the Ray path's overhead per document
against the serial path on the same threads, and the setup a fresh run pays.

Long documents (``--long [--lengths 4096,16384,32768]``): the bash manual cut to each
length, published at ``fp16`` with a 4-layer random-weight Llama of a 40K context
(``tests/random_llama.py``), each in a fresh process: tokens per second and peak RSS
of the windowed prefill (``LoadedModel.prefill``) against one pass over the whole
document with full logits (the prefill before windows, run as the publish's
``prefill``), the latter up to ``--one-pass-max`` tokens.

Incremental: a ~2,000-token man page, its last 10% of characters replaced by
other text; median of ``--repeats`` of: a full publish of the edited document
into an empty store, the same over the previous version with ``--full-prefill``,
and the incremental publish over the previous version. Also the KV error of the
new chunks (decoded at the most exact level) against a full prefill's, next to
the error the same level has after a full publish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "bench" / "results" / "publish.json"
PAGES = ["sed", "grep", "tar", "ls", "cp", "sort", "xargs", "chmod", "date", "gzip", "diff",
         "make", "find", "env", "ln", "tail"]  # fmt: skip
LADDER = "nearlossless,high,default,low,lowest"
STAGES = ("tokenize", "prefill", "encode", "upload")


def man_page(page: str) -> str:
    return subprocess.run(
        f"man -P cat {page} | col -bx", shell=True, capture_output=True, text=True, check=True,
        env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin"},
    ).stdout  # fmt: skip


def _stage_medians(results: list) -> dict[str, float]:
    return {s: statistics.median(r.seconds.get(s, 0.0) for r in results) for s in STAGES}


def serial(model, documents, levels: str, threads: int) -> dict:
    import torch

    from kvcdn.kernels import parallel
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    torch.set_num_threads(threads)  # PyTorch's and the codec's threads, as an actor sets them
    parallel.set_threads(threads)
    with tempfile.TemporaryDirectory(prefix="kvcdn-bench-publish-") as tmp:
        store = open_store(str(Path(tmp) / "store"))
        results, walls = [], []
        started = time.perf_counter()
        for doc in documents:
            t = time.perf_counter()
            results.append(publish(text=doc.text, name=doc.name, model=model, store=store,
                                   levels=levels))  # fmt: skip
            walls.append(time.perf_counter() - t)
        total = time.perf_counter() - started
    return {
        "config": f"serial, {threads} thread(s)", "actors": 0, "threads": threads,
        "setup_s": 0.0, "seconds": total, "docs_per_min": 60 * len(documents) / total,
        "doc_s": total / len(documents), "doc_median_s": statistics.median(walls),
        "stages": _stage_medians(results), "tokens": sum(r.token_count for r in results),
        "uploaded_bytes": sum(r.uploaded_bytes for r in results),
    }  # fmt: skip


def on_ray(documents, levels: str, actors: int, threads: int) -> dict:
    from kvcdn.cluster import PublishSettings, publish_on_ray

    with tempfile.TemporaryDirectory(prefix="kvcdn-bench-publish-") as tmp:
        settings = PublishSettings(store=str(Path(tmp) / "store"), levels=levels,
                                   threads=threads)  # fmt: skip
        report = publish_on_ray(documents, settings, actors=actors)
    if report.failed:
        raise SystemExit(f"ray run failed: {[o.error for o in report.failed]}")
    work = report.seconds - report.setup_s
    results = [o.result for o in report.outcomes]
    return {
        "config": f"ray, {actors} actor(s) x {threads} thread(s)", "actors": actors,
        "threads": threads, "setup_s": report.setup_s, "seconds": report.seconds,
        "docs_per_min": 60 * len(documents) / work, "doc_s": work / len(documents),
        "doc_median_s": statistics.median(o.seconds for o in report.outcomes),
        "stages": _stage_medians(results), "tokens": sum(r.token_count for r in results),
        "uploaded_bytes": sum(r.uploaded_bytes for r in results),
    }  # fmt: skip


def incremental(model, levels: str, repeats: int) -> dict:
    import torch

    from kvcdn.catalog import read_manifest
    from kvcdn.codec import decode_chunk
    from kvcdn.kernels import parallel
    from kvcdn.profile_store import load_profile
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    torch.set_num_threads(os.cpu_count() or 1)
    parallel.set_threads(os.cpu_count() or 1)
    grep, other = man_page("grep"), man_page("tar")
    ids = model.document_ids(grep)
    doc = model.tokenizer.decode(ids[len(model.prefix_ids()) : 2000], skip_special_tokens=True)
    cut = int(len(doc) * 0.9)
    edited = doc[:cut] + other[2000 : 2000 + len(doc) - cut]
    runs: dict[str, list[float]] = {"full publish": [], "full prefill over v1": [],
                                    "incremental over v1": []}  # fmt: skip
    kept: dict = {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="kvcdn-bench-incr-") as tmp:
            empty = open_store(str(Path(tmp) / "empty"))
            t = time.perf_counter()
            publish(text=edited, name="doc", model=model, store=empty, levels=levels)
            runs["full publish"].append(time.perf_counter() - t)
            for label, flag in (("full prefill over v1", False), ("incremental over v1", True)):
                store = open_store(str(Path(tmp) / label.replace(" ", "-")))
                publish(text=doc, name="doc", model=model, store=store, levels=levels)
                t = time.perf_counter()
                result = publish(text=edited, name="doc", model=model, store=store,
                                 levels=levels, incremental=flag)  # fmt: skip
                runs[label].append(time.perf_counter() - t)
                if flag:
                    kept["result"] = result
                    kept["incremental"] = read_manifest(store, "doc")
            kept["full"] = read_manifest(empty, "doc")
            # the new chunks' KV, decoded, against a full prefill's: incremental and full
            exact = model.prefill(list(kept["full"].token_ids))
            r = kept["result"]
            first_new = (r.token_count - r.prefilled_tokens) // kept["full"].chunk_tokens
            level = r.prefix_from.split()[-1] if r.prefix_from else "?"
            errors = {}
            for label, store_ in (("incremental", store), ("full", empty)):
                m = kept[label]
                profile = load_profile(store_, m.codec_profile) if m.codec_profile else None
                num = den = 0.0
                for chunk in m.chunks[first_new:]:
                    ref = chunk.objects[level]
                    _, kv = decode_chunk(store_.get(ref.key), profile=profile)
                    want = exact[:, :, :, chunk.start : chunk.end]
                    num += float((kv.float() - want).norm() ** 2)
                    den += float(want.norm() ** 2)
                errors[label] = (num / den) ** 0.5
    medians = {k: statistics.median(v) for k, v in runs.items()}
    r = kept["result"]
    return {
        "tokens": r.token_count, "prefilled_tokens": r.prefilled_tokens,
        "prefix_from": r.prefix_from, "seconds": medians,
        "ratio_incremental_to_full": medians["incremental over v1"] / medians["full publish"],
        "stages": dict(r.seconds), "level_compared": level,
        "new_chunks_rel_err": errors,
    }  # fmt: skip


def _long_child(mode: str, tokens: int, folder: str) -> None:
    """One long publish in this fresh process; prints its figures as JSON."""
    import resource

    import torch
    from transformers import DynamicCache

    from kvcdn.models import kv_from_cache, load_model
    from kvcdn.publish import publish

    model = load_model(folder, "cpu")
    text = man_page("bash")
    ids = model.document_ids(text)
    cut = len(model.tokenizer.decode(ids[1 : tokens + 1]))  # about ``tokens`` tokens of text
    text = text[:cut]
    loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def one_pass(ids: list[int]) -> torch.Tensor:  # the prefill before windows
        cache = DynamicCache(config=model.model.config)
        with torch.inference_mode():
            model.model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        return kv_from_cache(cache)

    with tempfile.TemporaryDirectory() as store:
        t = time.perf_counter()
        result = publish(text=text, name="bash", model=model, store=store, levels="fp16",
                         prefill=one_pass if mode == "one-pass" else None)  # fmt: skip
        seconds = time.perf_counter() - t
    print(json.dumps({
        "mode": mode, "tokens": result.token_count, "seconds": seconds,
        "tokens_per_s": result.token_count / seconds, "loaded_rss": loaded_rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))  # fmt: skip


def long_documents(lengths: list[int], one_pass_max: int, out: Path) -> int:
    sys.path.insert(0, str(REPO))
    from tests.random_llama import build_random_llama

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random_llama(Path(tmp))
        for n in lengths:
            for mode in ("windows", "one-pass"):
                if mode == "one-pass" and n > one_pass_max:
                    continue
                done = subprocess.run(
                    [sys.executable, __file__, "--long-child", mode, str(n), str(folder)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(f"{r['tokens']:>7,} tokens  {mode:<9} {r['tokens_per_s']:7.0f} tok/s  "
                      f"peak {r['peak_rss'] / 1e9:5.2f} GB  (model loaded: "
                      f"{r['loaded_rss'] / 1e9:4.2f} GB)")  # fmt: skip
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "long": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--long-child":
        _long_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="only the long-document rows")
    parser.add_argument("--lengths", default="4096,16384,32768")
    parser.add_argument("--one-pass-max", type=int, default=16384)
    parser.add_argument("--pages", type=int, default=12)
    parser.add_argument("--chars", type=int, default=4000)
    parser.add_argument("--levels", default=LADDER)
    parser.add_argument("--repeats", type=int, default=3, help="of the incremental publish")
    parser.add_argument("--rounds", type=int, default=3, help="of every corpus configuration")
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    if args.long:
        out = args.json
        if out == DEFAULT_JSON:
            out = DEFAULT_JSON.with_name("publish_long.json")
        return long_documents([int(n) for n in args.lengths.split(",")], args.one_pass_max, out)

    from kvcdn.cluster import CorpusDocument
    from kvcdn.models import load_model
    from kvcdn.profile_store import ensure_profile
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    pages = PAGES[: args.pages]
    documents = [CorpusDocument(p, man_page(p)[: args.chars], f"man {p}") for p in pages]
    t = time.perf_counter()
    model = load_model(None, "cpu")
    model_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:  # the profile, and warm codecs, off the clock
        scratch = open_store(str(Path(tmp) / "s"))
        ensure_profile(scratch, model)
        publish(text=man_page("cat"), name="warm", model=model, store=scratch, levels=args.levels)

    # Every configuration runs --rounds times, interleaved, so that a drift of the
    # machine's speed over the run does not show as a difference between them.
    runs: dict[str, list[dict]] = {}
    with contextlib.ExitStack() as stack:
        if not args.skip_ray:
            import ray

            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # this script's own Ray
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcdn-bench-ray-"))
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING, _temp_dir=tmp)  # fmt: skip
            stack.callback(ray.shutdown)
        for _ in range(args.rounds):
            for threads in (1, 2):
                row = serial(model, documents, args.levels, threads)
                runs.setdefault(row["config"], []).append(row)
            if not args.skip_ray:
                for actors, threads in ((1, 1), (1, 2), (2, 1)):
                    row = on_ray(documents, args.levels, actors, threads)
                    runs.setdefault(row["config"], []).append(row)
    rows = [_median_row(rs) for rs in runs.values()]
    incr = incremental(model, args.levels, args.repeats)

    tokens = rows[0]["tokens"]
    print(f"corpus: {len(documents)} man pages, {tokens:,} tokens, levels {args.levels}; "
          f"model load {model_s:.1f} s (each Ray actor pays it in its setup)")  # fmt: skip
    head = ("config", "docs/min", "s/doc", "median doc s", "setup s",
            *(f"{s} s" for s in STAGES))  # fmt: skip
    table = [head]
    for r in rows:
        table.append((r["config"], f"{r['docs_per_min']:.1f}", f"{r['doc_s']:.2f}",
                      f"{r['doc_median_s']:.2f}", f"{r['setup_s']:.1f}",
                      *(f"{r['stages'][s]:.3f}" for s in STAGES)))  # fmt: skip
    _print(table)
    by = {r["config"]: r for r in rows}
    ratios = {}
    if not args.skip_ray:
        ratios = {
            "ray 1x1 / serial 1 thread (s per doc)":
                by["ray, 1 actor(s) x 1 thread(s)"]["doc_s"] / by["serial, 1 thread(s)"]["doc_s"],
            "ray 1x2 / serial 2 threads (s per doc)":
                by["ray, 1 actor(s) x 2 thread(s)"]["doc_s"] / by["serial, 2 thread(s)"]["doc_s"],
            "ray 2x1 / ray 1x2 (docs per min)":
                by["ray, 2 actor(s) x 1 thread(s)"]["docs_per_min"]
                / by["ray, 1 actor(s) x 2 thread(s)"]["docs_per_min"],
        }  # fmt: skip
        for k, v in ratios.items():
            print(f"{k}: {v:.3f}")
    print(f"\nincremental: {incr['tokens']:,}-token document, last 10% edited; "
          f"{incr['prefilled_tokens']} tokens prefilled after {incr['prefix_from']}")  # fmt: skip
    _print([("publish", "median s")] + [(k, f"{v:.2f}") for k, v in incr["seconds"].items()])
    print(f"incremental / full publish: {incr['ratio_incremental_to_full']:.2f} (target <= 0.30)")
    err = incr["new_chunks_rel_err"]
    print(f"new chunks' KV at {incr['level_compared']}, relative error against a full prefill: "
          f"incremental {err['incremental']:.2e}, full publish {err['full']:.2e}")  # fmt: skip
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "pages": pages, "chars": args.chars, "levels": args.levels, "model_load_s": model_s,
        "rows": rows, "ratios": ratios, "incremental": incr,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


def _median_row(rows: list[dict]) -> dict:
    """One configuration's rounds: the median of each figure, and every round's s/doc."""
    out = dict(rows[0])
    for key in ("setup_s", "seconds", "docs_per_min", "doc_s", "doc_median_s"):
        out[key] = statistics.median(r[key] for r in rows)
    out["stages"] = {s: statistics.median(r["stages"][s] for r in rows) for s in STAGES}
    out["rounds_doc_s"] = [r["doc_s"] for r in rows]
    return out


def _print(rows: list[tuple]) -> None:
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                        for i, (c, w) in enumerate(zip(r, width, strict=True))))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
