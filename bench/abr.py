"""Adaptive loading under real bandwidth traces: the kvcdn planner against its baselines.

    python bench/abr.py [--traces FILE...] [--scale 200] [--deadline 1.0] [--offsets 5]
                        [--docs FILE...] [--json OUT.json] [--png OUT.png]

Publishes the documents (the bundled sed manual and the grep man page by
default) with the calibrated ladder to a local folder, and serves them from
a real edge process whose link replays each trace (``--throttle-trace``,
Mbit/s times ``--scale``). The edge's cache is warmed first, so the link is
the bottleneck. For each trace, each start offset (evenly spread over the
trace) and each document, the same load runs, after the edge restarts the
trace at that offset (``POST /shaping``), with:

- ``kvcdn``: ``quality="auto"`` with the deadline, the SDK's defaults (the
  planner and RobustMPC's predictor), starting cold: the link's history is
  forgotten before each run, so the manifest's transfer is its first sample;
- ``cachegen``: CacheGen's controller (each chunk takes the best level whose
  size fits an even share of the time left at the last chunk's throughput,
  else text), in the same pipeline;
- ``oracle``: the planner with a predictor that knows the trace (the future
  bandwidth), with no error margin;
- ``nested``: the same document published with the nested ladder (``--levels
  nested``: one object a chunk, each level a prefix of its tiers), with the
  SDK's defaults for it: the first pass by
  :func:`kvcdn.sdk.planner.fetch_first` (the planner among fetched levels,
  recomputing only where fetching alone misses), then refinement: once every
  chunk has its level, chunks are raised to better levels while the deadline
  allows, fetching only the tiers they lack;
- ``nested-planner``: the nested publication, the first pass by the planner
  (:func:`kvcdn.sdk.planner.plan`, recomputing where that saves time, as for
  ``kvcdn``), then refinement;
- ``nested-base-first``: the nested publication, every chunk's base first
  (:func:`kvcdn.sdk.planner.base_first`), then refinement;
- each fixed level (every chunk at that level);
- ``prefill``: recomputing the whole document (no network; once per trace).

Time to first token is the load (from the call, model loaded) plus the first
token of a question. Quality is the token-weighted mean of each chunk's
level score (top-1 agreement with exact KV minus KL; 1.0 for text). Prints a
table, then each method against ``kvcdn`` on the same loads: the mean over all loads
scores a missed deadline whose chunks were recomputed as quality 1.0, so quality is
also compared where both met the deadline, beside the loads only one of them met.
Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = REPO.parent / "shared" / "traces"
QUESTION = "How do I use this command?"
LEVELS = ("nearlossless", "high", "default", "low", "lowest")
NESTED_METHODS = ("nested", "nested-planner", "nested-base-first")
NESTED_SUFFIX = "-nested"  # the nested publication of a document: its name and this
METHODS = ("kvcdn", "cachegen", "oracle", *NESTED_METHODS, *LEVELS, "prefill")


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


class TraceOracle:
    """A predictor that knows the link's future: the trace itself, from its clock now."""

    def __init__(self, trace: Any, offset_s: float, started: float) -> None:
        self.trace = trace
        self.offset_s = offset_s
        self.started = started  # perf_counter when the edge restarted the trace

    def predict_seconds(self, nbytes: int) -> float:
        from kvcdn.edge.shaping import seconds_to_send

        if nbytes <= 0:
            return 0.0
        now = self.offset_s + time.perf_counter() - self.started
        return seconds_to_send(self.trace.segment, now, nbytes) - now

    def observe(self, nbytes: int, seconds: float) -> None:
        pass


def _edge(
    store: Path, trace: Path, scale: float, cache: Path, port: int, log: Path
) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "kvcdn.cli.main", "edge", "serve",
            "--origin", str(store), "--cache-dir", str(cache),
            "--listen", f"127.0.0.1:{port}",
            "--throttle-trace", str(trace), "--throttle-scale", str(scale),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),  # a file: a pipe nobody reads would fill and stall the edge
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the edge exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the edge did not start")


def _percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", nargs="+", type=Path, default=None)
    parser.add_argument("--scale", type=float, default=200.0)
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--offsets", type=int, default=5, help="start offsets per trace")
    parser.add_argument("--docs", nargs="+", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=3072, help="tokens per document (at most)")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "abr.json")
    parser.add_argument("--png", type=Path, default=None, help="[default: beside --json]")
    parser.add_argument(
        "--methods", nargs="+", default=None, help=f"[default: all: {' '.join(METHODS)}]"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every plan")
    args = parser.parse_args()
    methods = args.methods or list(METHODS)
    if unknown := set(methods) - set(METHODS):
        raise SystemExit(f"unknown methods {sorted(unknown)}: choose from {' '.join(METHODS)}")
    if args.verbose:
        import logging

        logging.basicConfig(format="%(relativeCreated)8.0f ms %(message)s")
        logging.getLogger("kvcdn.sdk").setLevel(logging.DEBUG)
    traces = args.traces or sorted(SHARED_TRACES.glob("*.log"))
    if not traces:
        raise SystemExit(f"no traces: pass --traces FILE... (none in {SHARED_TRACES})")
    png = args.png or args.json.with_suffix(".png")

    import torch
    from rich.console import Console
    from rich.table import Table

    from kvcdn.catalog import read_manifest
    from kvcdn.edge.shaping import Trace
    from kvcdn.models import load_model
    from kvcdn.publish import publish
    from kvcdn.sdk import load_context
    from kvcdn.sdk.edges import warm_keys
    from kvcdn.sdk.loader import quality_scores
    from kvcdn.store import open_store

    console = Console(stderr=True)
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model()
    work = Path(tempfile.mkdtemp(prefix="kvcdn-abr-"))
    store = work / "store"
    docs: list[tuple[str, str]] = []  # (name, text)
    for path in args.docs or [REPO / "cli" / "data" / "sed-manual.txt", None]:
        if path is None:  # the grep man page, as the system renders it
            out = subprocess.run(
                "MANWIDTH=80 man -P cat grep | col -bx",
                shell=True, capture_output=True, text=True, env={**os.environ, "MANWIDTH": "80"},
            )  # fmt: skip
            if out.returncode or len(out.stdout) < 1000:
                continue
            name, text = "grep-manual", out.stdout
        else:
            name, text = path.stem.replace("_", "-"), path.read_text()
        ids = model.document_ids(text)[: args.tokens]
        docs.append((name, model.tokenizer.decode(ids)))
    nested = any(m in NESTED_METHODS for m in methods)
    for name, text in docs:
        with console.status(f"publishing {name}…"):
            publish(text=text, name=name, model=model, store=str(store))
            if nested:  # the same document, the nested ladder
                publish(text=text, name=f"{name}{NESTED_SUFFIX}", model=model, store=str(store),
                        levels="nested")  # fmt: skip
    names = [name for name, _ in docs] + [f"{name}{NESTED_SUFFIX}" for name, _ in docs if nested]
    manifests = {name: read_manifest(open_store(str(store)), name) for name in names}
    scores = {name: quality_scores(m) for name, m in manifests.items()}

    runs: list[dict[str, Any]] = []
    port = 18000 + os.getpid() % 1000
    started_all = time.perf_counter()
    for trace_path in traces:
        trace = Trace.load(trace_path, scale=args.scale)
        edge = _edge(
            store,
            trace_path,
            args.scale,
            work / f"cache-{trace_path.stem}",
            port,
            work / f"edge-{trace_path.stem}.log",
        )
        url = f"http://127.0.0.1:{port}"
        try:
            keys = [k for m in manifests.values() for k in warm_keys(m)[0]]
            job = _post(f"{url}/warm", {"keys": keys})
            while job["state"] == "running":
                time.sleep(0.1)
                job = _get(f"{url}/warm/{job['id']}")
            if job["state"] != "done":
                raise SystemExit(f"warming the edge failed: {job}")
            # one load to warm this process's kernels and connections, not measured
            load_context(docs[0][0], model=model, edges=[url], quality="lowest")
            offsets = [trace.period * i / args.offsets for i in range(args.offsets)]
            for name, _ in docs:
                for offset in offsets:
                    for method in methods:
                        if method == "prefill":
                            continue  # once per trace, below
                        runs.append(
                            _run(method, name, url, offset, trace_path.stem, trace, args, model)
                        )
                        r = runs[-1]
                        console.log(
                            f"{trace_path.stem} +{offset:.0f}s {name} {method}: "
                            f"TTFT {r['ttft_s']:.3f} s, quality {r['quality']:.4f}, "
                            f"{r['bytes'] / 1e6:.1f} MB {r['levels']}"
                        )
                if "prefill" not in methods:
                    continue
                t = time.perf_counter()
                ctx = load_context(name, model=model, edges=[url], quality="text")
                answer = ctx.generate(QUESTION, max_new_tokens=1)
                runs.append(
                    {
                        "trace": trace_path.stem, "offset_s": 0.0, "doc": name,
                        "method": "prefill", "ttft_s": ctx.plan.ready_s + answer.ttft_s,
                        "quality": 1.0, "bytes": 0, "levels": {"text": len(ctx.plan.chunks)},
                        "wall_s": time.perf_counter() - t,
                    }
                )  # fmt: skip
        finally:
            edge.kill()  # shaped responses in flight would hold a graceful stop
            edge.wait(timeout=30)

    summary = _summarise(runs, methods, args.deadline)
    table = Table(
        title=f"adaptive loading: {len(traces)} traces x {args.offsets} offsets x {len(docs)} "
        f"documents, scale x{args.scale:g}, deadline {args.deadline:g} s"
    )
    for col in (
        "method", "runs", "deadline met", "mean quality", "vs oracle", "TTFT p50 s", "p95 s",
        "p99 s", "MB per load", "refined", "dropped",
    ):  # fmt: skip
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, s in summary.items():
        table.add_row(
            method,
            str(s["runs"]),
            f"{100 * s['deadline_met']:.1f}%",
            f"{s['mean_quality']:.4f}",
            f"{100 * s['quality_vs_oracle']:.1f}%",
            f"{s['ttft_p50_s']:.3f}",
            f"{s['ttft_p95_s']:.3f}",
            f"{s['ttft_p99_s']:.3f}",
            f"{s['mean_mb']:.1f}",
            f"{s['refined_per_load']:.1f}",
            str(s["refinements_dropped"]),
        )
    console = Console()
    console.print(table)
    if (paired := _paired_table(summary)) is not None:
        console.print(paired)
    result = {
        "benchmark": "abr",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "deadline_s": args.deadline,
        "scale": args.scale,
        "traces": [str(t) for t in traces],
        "documents": {name: m.token_count for name, m in manifests.items()},
        "quality_scores": scores,
        "summary": summary,
        "runs": runs,
        "seconds": time.perf_counter() - started_all,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    _plot(summary, runs, args.deadline, png)
    console.print(f"wrote {args.json} and {png}")
    return 0


def _run(
    method: str,
    name: str,
    url: str,
    offset: float,
    trace_name: str,
    trace: Any,
    args: argparse.Namespace,
    model: Any,
) -> dict[str, Any]:
    from abr_baselines import LastSamplePredictor, cachegen_plan

    from kvcdn.sdk import forget_links, load_context
    from kvcdn.sdk.planner import base_first, plan

    _post(f"{url}/shaping", {"offset_s": offset})
    restarted = time.perf_counter()
    kwargs: dict[str, Any]
    if method == "kvcdn":  # the SDK's defaults, starting cold on this link
        forget_links()
        kwargs = {"deadline_s": args.deadline}
    elif method == "cachegen":
        kwargs = {
            "deadline_s": args.deadline,
            "predictor": LastSamplePredictor(),
            "policy": cachegen_plan,
            # CacheGen decides per chunk and never revisits a fetch
            "cancel_late_fetches": False,
        }
    elif method == "oracle":
        kwargs = {
            "deadline_s": args.deadline,
            "predictor": TraceOracle(trace, offset, restarted),
            "policy": plan,
        }
    elif method in NESTED_METHODS:  # the SDK's defaults on the nested publication
        forget_links()
        name = f"{name}{NESTED_SUFFIX}"
        kwargs = {"deadline_s": args.deadline}
        if method == "nested-base-first":
            kwargs["policy"] = base_first
        elif method == "nested-planner":
            kwargs["policy"] = plan
    else:
        kwargs = {"quality": method}
    t = time.perf_counter()
    ctx = load_context(name, model=model, edges=[url], **kwargs)
    answer = ctx.generate(QUESTION, max_new_tokens=1)
    p = ctx.plan
    levels: dict[str, int] = {}
    for lv in p.chunk_levels:
        levels[lv] = levels.get(lv, 0) + 1
    return {
        "trace": trace_name,
        "offset_s": offset,
        "doc": name,
        "method": method,
        "ttft_s": p.ready_s + answer.ttft_s,
        "ready_s": p.ready_s,
        "predicted_ttft_s": p.predicted_ttft_s,
        "quality": p.mean_quality,
        "bytes": p.bytes,
        "levels": levels,
        "cancelled": p.cancelled,
        "replans": p.replans,
        "refined": p.refined,
        "refinements_dropped": p.refinements_dropped,
        "feasible": p.feasible,
        "wall_s": time.perf_counter() - t,
        # each chunk's level and its (last) fetch or recompute's start and end, seconds
        # from the call: where the load's time went
        "chunks": [[c.level, round(c.start_s, 4), round(c.ready_s, 4)] for c in p.chunks],
    }


def _summarise(runs: list[dict[str, Any]], methods: list[str], deadline: float) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        ttfts = [r["ttft_s"] for r in mine]
        summary[method] = {
            "runs": len(mine),
            "deadline_met": sum(t <= deadline for t in ttfts) / len(mine),
            "mean_quality": statistics.fmean(r["quality"] for r in mine),
            "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p95_s": _percentile(ttfts, 95),
            "ttft_p99_s": _percentile(ttfts, 99),
            "mean_mb": statistics.fmean(r["bytes"] for r in mine) / 1e6,
            "refined_per_load": statistics.fmean(r.get("refined", 0) for r in mine),
            "refinements_dropped": sum(r.get("refinements_dropped", 0) for r in mine),
        }
    oracle = summary.get("oracle", {}).get("mean_quality") or 1.0
    for s in summary.values():
        s["quality_vs_oracle"] = s["mean_quality"] / oracle
    for method, s in summary.items():
        if method != "kvcdn" and "kvcdn" in summary:
            s["paired_with_kvcdn"] = _paired(runs, method, deadline)
    return summary


def _paired_table(summary: dict[str, Any]) -> Any:
    """The methods against kvcdn on the same loads (:func:`_paired`), or None."""
    from rich.table import Table

    table = Table(title="against kvcdn on the same loads: quality where both met the deadline")
    for col in ("method", "loads", "both met", "kvcdn quality", "quality", "met only by it",
                "met only by kvcdn"):  # fmt: skip
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, s in summary.items():
        if (p := s.get("paired_with_kvcdn")) and p["both_met"]:
            table.add_row(method, str(p["loads"]), str(p["both_met"]),
                          f"{p['kvcdn_quality_both_met']:.4f}", f"{p['quality_both_met']:.4f}",
                          str(p["met_only_by_method"]), str(p["met_only_by_kvcdn"]))  # fmt: skip
    return table if table.row_count else None


def _paired(runs: list[dict[str, Any]], method: str, deadline: float) -> dict[str, Any]:
    """``method`` against ``kvcdn`` on the same loads (trace, offset, document): a mean
    over all loads scores a missed deadline that recomputed as quality 1.0, so quality
    is compared where both met the deadline, and the loads only one met are counted."""
    def load(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["trace"], r["offset_s"], r["doc"].removesuffix(NESTED_SUFFIX)

    theirs = {load(r): r for r in runs if r["method"] == method}
    pairs = [(r, theirs[load(r)]) for r in runs if r["method"] == "kvcdn" and load(r) in theirs]
    both = [(a, b) for a, b in pairs if a["ttft_s"] <= deadline and b["ttft_s"] <= deadline]
    return {
        "loads": len(pairs),
        "both_met": len(both),
        "kvcdn_quality_both_met": statistics.fmean(a["quality"] for a, _ in both) if both else None,
        "quality_both_met": statistics.fmean(b["quality"] for _, b in both) if both else None,
        "met_only_by_method": sum(a["ttft_s"] > deadline >= b["ttft_s"] for a, b in pairs),
        "met_only_by_kvcdn": sum(b["ttft_s"] > deadline >= a["ttft_s"] for a, b in pairs),
    }


def _plot(summary: dict[str, Any], runs: list[dict[str, Any]], deadline: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, s in summary.items():
        left.scatter(100 * s["deadline_met"], s["mean_quality"], s=40)
        left.annotate(method, (100 * s["deadline_met"], s["mean_quality"]), fontsize=8)
        ttfts = sorted(r["ttft_s"] for r in runs if r["method"] == method)
        right.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=method)
    left.set_xlabel("deadlines met (%)")
    left.set_ylabel("mean quality score")
    left.set_title("quality against deadline attainment")
    right.axvline(deadline, color="grey", linestyle="--", linewidth=1)
    right.set_xscale("log")
    right.set_xlabel("time to first token (s)")
    right.set_ylabel("fraction of loads")
    right.set_title("TTFT distribution")
    right.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
