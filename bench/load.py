"""What one ``load_context`` costs: seconds per stage and peak memory, fresh and warm.

    python bench/load.py [--doc FILE] [--quality auto] [--levels L] [--repeats 5] [--json OUT]
    python bench/load.py --blend FILE FILE... [--repeats 5]   # load_contexts (CacheBlend)

Publishes the document (the bundled sed manual by default) to a local folder (at
``kvcdn publish``'s default levels, or ``--levels``: ``nested`` for the progressive
ladder), then in a fresh Python process: loads the model, loads the document's KV once
(the first load in a process: the device is measured, codecs warm up) and
``--repeats`` more times (warm), and answers one question. Reports the plan's
seconds per stage (median of the warm loads) and the process's peak resident
memory after the model load and after the loads, with a full prefill of the
same document in the same process as the baseline. Prints a table, writes JSON.

With ``--blend``, the documents are published and ``sdk.load_contexts`` loads
and blends them (15% recomputed) instead: seconds per load, the blend's own
seconds and peak memory. That child uses only the module-level SDK functions,
so the same command measures an older checkout.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUESTION = "How do I edit a file in place?"

# Runs in the fresh process; prints one JSON line.
_CHILD = r"""
import json, resource, sys, time
from kvcdn import sdk

store, name, quality, repeats, question = sys.argv[1:6]
repeats = int(repeats)

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

t = time.perf_counter()
if hasattr(sdk, "Client"):
    client = sdk.Client(store=store)
    model = client.model()
    load = lambda: client.load_context(name, quality=quality)
else:  # a checkout from before sdk.Client, for before/after runs
    from kvcdn.models import load_model
    model = load_model(None, "cpu")
    load = lambda: sdk.load_context(name, store=store, model=model, quality=quality)
model_s = time.perf_counter() - t
after_model = peak_mb()
runs = []
for _ in range(1 + repeats):
    t = time.perf_counter()
    ctx = load()
    runs.append({"wall_s": time.perf_counter() - t, "seconds": dict(ctx.plan.seconds),
                 "bytes": ctx.plan.bytes})
    if len(runs) <= repeats:
        del ctx
after_loads = peak_mb()
answer = ctx.generate(question, max_new_tokens=8)
t = time.perf_counter()
baseline = sdk.answer_with_prefill(model, ctx.token_ids, question, max_new_tokens=1)
prefill_s = time.perf_counter() - t
print(json.dumps({
    "model_s": model_s, "peak_after_model_mb": after_model, "peak_after_loads_mb": after_loads,
    "tokens": len(ctx.token_ids), "runs": runs, "answer_ttft_s": answer.ttft_s,
    "prefill_s": prefill_s,
}))
"""

_BLEND_CHILD = r"""
import json, resource, sys, time
from kvcdn import sdk
from kvcdn.models import load_model

store, repeats, question, *names = sys.argv[1:]
repeats = int(repeats)

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

t = time.perf_counter()
model = load_model("smollm2-135m", "cpu")
model_s = time.perf_counter() - t
after_model = peak_mb()
runs = []
for _ in range(1 + repeats):
    t = time.perf_counter()
    ctx = sdk.load_contexts(names, model=model, store=store)
    runs.append({"wall_s": time.perf_counter() - t, "blend_seconds": ctx.blend.seconds,
                 "bytes": sum(p.bytes for p in ctx.plans)})
    if len(runs) <= repeats:
        del ctx
after_loads = peak_mb()
answer = ctx.generate(question, max_new_tokens=8)
print(json.dumps({
    "model_s": model_s, "peak_after_model_mb": after_model, "peak_after_loads_mb": after_loads,
    "tokens": ctx.blend.tokens, "runs": runs, "answer_ttft_s": answer.ttft_s,
}))
"""


def _child(*argv: str) -> dict:
    """Run a measuring child; its last stdout line is its JSON report."""
    done = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _publish(doc: Path, name: str, store: str, levels: str | None = None) -> None:
    subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "publish", str(doc), "--name", name,
         "--store", store, "--json", *(["--levels", levels] if levels else [])],
        check=True, capture_output=True,
    )  # fmt: skip


def _blend(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvcdn-bench-load-") as tmp:
        store = str(Path(tmp) / "store")
        names = [f"bench-doc-{i}" for i in range(len(args.blend))]
        for doc, name in zip(args.blend, names, strict=True):
            _publish(doc, name, store)
        result = _child(_BLEND_CHILD, store, str(args.repeats), QUESTION, *names)
    first, warm = result["runs"][0], result["runs"][1:]
    print(f"load_contexts of {', '.join(d.name for d in args.blend)}: {result['tokens']:,} "
          f"tokens, {first['bytes']:,} bytes fetched per load")  # fmt: skip
    print(f"wall: first {first['wall_s']:.3f} s, warm median "
          f"{statistics.median(r['wall_s'] for r in warm):.3f} s")  # fmt: skip
    print(f"peak RSS: {result['peak_after_model_mb']:.0f} MB after the model, "
          f"{result['peak_after_loads_mb']:.0f} MB after {1 + args.repeats} loads "
          f"(+{result['peak_after_loads_mb'] - result['peak_after_model_mb']:.0f} MB)")
    out = args.json.with_name("load-blend.json") if args.json == DEFAULT_JSON else args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"docs": [d.name for d in args.blend], "machine": platform.machine(),
              "python": platform.python_version(), **result}  # fmt: skip
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


DEFAULT_JSON = REPO / "bench" / "results" / "load.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, default=REPO / "cli" / "data" / "sed-manual.txt")
    parser.add_argument("--quality", default="auto", help="auto (best level), a level, or text")
    parser.add_argument("--levels", help="the levels to publish (kvcdn publish --levels)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blend", type=Path, nargs="+", metavar="FILE",
                        help="load_contexts of these documents instead")  # fmt: skip
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    if args.blend:
        return _blend(args)

    with tempfile.TemporaryDirectory(prefix="kvcdn-bench-load-") as tmp:
        store = str(Path(tmp) / "store")
        name = "bench-doc"
        _publish(args.doc, name, store, args.levels)
        result = _child(_CHILD, store, name, args.quality, str(args.repeats), QUESTION)
    first, warm = result["runs"][0], result["runs"][1:]
    stages = sorted({k for r in result["runs"] for k in r["seconds"]})
    rows = [("stage", "first load s", "warm median s")]
    for stage in stages:
        rows.append((
            stage,
            f"{first['seconds'].get(stage, 0.0):.3f}",
            f"{statistics.median(r['seconds'].get(stage, 0.0) for r in warm):.3f}",
        ))  # fmt: skip
    warm_wall = statistics.median(r["wall_s"] for r in warm)
    rows.append(("wall (load_context)", f"{first['wall_s']:.3f}", f"{warm_wall:.3f}"))
    rows.append(("full prefill (baseline)", "", f"{result['prefill_s']:.3f}"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{args.doc.name}: {result['tokens']:,} tokens, levels {args.levels or 'default'}, "
          f"quality {args.quality}, "
          f"{first['bytes']:,} bytes fetched per load")  # fmt: skip
    for row in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(row, width, strict=True))))  # fmt: skip
    print(f"peak RSS: {result['peak_after_model_mb']:.0f} MB after the model, "
          f"{result['peak_after_loads_mb']:.0f} MB after {1 + args.repeats} loads; "
          f"warm load {result['prefill_s'] / warm_wall:.1f}x faster than a prefill")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"doc": args.doc.name, "levels": args.levels, "quality": args.quality,
              "machine": platform.machine(),
              "python": platform.python_version(), **result}  # fmt: skip
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
