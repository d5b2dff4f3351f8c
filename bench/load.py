"""What one ``load_context`` costs: seconds per stage and peak memory, fresh and warm.

    python bench/load.py [--doc FILE] [--quality auto] [--repeats 5] [--json OUT]

Publishes the document (the bundled sed manual by default) to a local folder,
then in a fresh Python process: loads the model, loads the document's KV once
(the first load in a process: the device is measured, codecs warm up) and
``--repeats`` more times (warm), and answers one question. Reports the plan's
seconds per stage (median of the warm loads) and the process's peak resident
memory after the model load and after the loads, with a full prefill of the
same document in the same process as the baseline. Prints a table, writes JSON.
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
client = sdk.Client(store=store)
model = client.model()
model_s = time.perf_counter() - t
after_model = peak_mb()
runs = []
for _ in range(1 + repeats):
    t = time.perf_counter()
    ctx = client.load_context(name, quality=quality)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, default=REPO / "cli" / "data" / "sed-manual.txt")
    parser.add_argument("--quality", default="auto", help="auto (best level), a level, or text")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "load.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvcdn-bench-load-") as tmp:
        store = str(Path(tmp) / "store")
        name = "bench-doc"
        subprocess.run(
            [sys.executable, "-m", "kvcdn.cli.main", "publish", str(args.doc), "--name", name,
             "--store", store, "--json"],
            check=True, capture_output=True,
        )  # fmt: skip
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, store, name, args.quality, str(args.repeats), QUESTION],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    result = json.loads(child.stdout.strip().splitlines()[-1])
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
    print(f"{args.doc.name}: {result['tokens']:,} tokens, quality {args.quality}, "
          f"{first['bytes']:,} bytes fetched per load")  # fmt: skip
    for row in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(row, width, strict=True))))  # fmt: skip
    print(f"peak RSS: {result['peak_after_model_mb']:.0f} MB after the model, "
          f"{result['peak_after_loads_mb']:.0f} MB after {1 + args.repeats} loads; "
          f"warm load {result['prefill_s'] / warm_wall:.1f}x faster than a prefill")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"doc": args.doc.name, "quality": args.quality, "machine": platform.machine(),
              "python": platform.python_version(), **result}  # fmt: skip
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
