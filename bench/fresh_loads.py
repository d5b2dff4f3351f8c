"""Fresh processes that load a document and exit, on a machine kept busy by publishes.

    python bench/fresh_loads.py [--runs 100] [--publishers 2] [--quality default]
                                [--json OUT]

What an app's short-lived process meets: start Python, open an ``sdk.Client``
(which warms its kernels and opens the store in the background), load the
bundled sed manual from a local store, and exit at once. Meanwhile
``--publishers`` processes publish man pages in a loop, so both cores stay busy
(the conditions under which about one fresh load in 25 used to abort at exit
with "terminate called without an active exception": a daemon thread inside a
native call when the interpreter ended). Counts the processes that did not exit
0 (and those whose stderr holds "terminate called"), and reports the loads'
wall times (the process's own start to exit, and the load alone). Prints a
table, writes JSON; exits 1 if any process aborted.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "cli" / "data" / "sed-manual.txt"

# The fresh process: a client, one load, and out.
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from kvcdn import sdk
client = sdk.Client(store=sys.argv[1])
t = time.perf_counter()
ctx = client.load_context(sys.argv[2], quality=sys.argv[3])
print(json.dumps({"import_s": t - t0, "load_s": time.perf_counter() - t,
                  "model_s": ctx.plan.seconds.get("model", 0.0), "tokens": len(ctx.token_ids)}))
"""

# The background load: publish man pages under new names, over and over.
_PUBLISHER = r"""
import subprocess, sys
store, tag, *docs = sys.argv[1:]
i = 0
while True:
    for doc in docs:
        subprocess.run([sys.executable, "-m", "kvcdn.cli.main", "publish", doc, "--name",
                        f"busy-{tag}-{i}", "--store", store, "--levels", "default"],
                       capture_output=True)
        i += 1
"""


def _man_pages(folder: Path) -> list[Path]:
    """A few man pages as plain text (sed's manual when man is not installed)."""
    pages = []
    for page in ("grep", "find", "tar"):
        done = subprocess.run(f"MANWIDTH=80 man -P cat {page} | col -bx", shell=True,
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode == 0 and len(done.stdout) > 2000:
            path = folder / f"{page}.txt"
            path.write_text(done.stdout)
            pages.append(path)
    return pages or [DOC]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--publishers", type=int, default=2, help="busy background publishes")
    parser.add_argument("--quality", default="default")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "fresh.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvcdn-bench-fresh-") as tmp:
        store = str(Path(tmp) / "store")
        subprocess.run([sys.executable, "-m", "kvcdn.cli.main", "publish", str(DOC), "--name",
                        "sed", "--store", store, "--levels", "default,fp16"],
                       check=True, capture_output=True)  # fmt: skip
        docs = [str(p) for p in _man_pages(Path(tmp))]
        busy = [
            subprocess.Popen([sys.executable, "-c", _PUBLISHER, str(Path(tmp) / "busy"), str(i),
                              *docs], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
            for i in range(args.publishers)
        ]
        runs = []
        try:
            time.sleep(5 if busy else 0)  # the publishers are past their imports
            for i in range(args.runs):
                t = time.perf_counter()
                done = subprocess.run([sys.executable, "-c", _CHILD, store, "sed", args.quality],
                                      capture_output=True, text=True, timeout=600)  # fmt: skip
                wall = time.perf_counter() - t
                report = {}
                if done.returncode == 0 and done.stdout.strip():
                    report = json.loads(done.stdout.strip().splitlines()[-1])
                runs.append({"rc": done.returncode, "wall_s": wall,
                             "terminate": "terminate called" in done.stderr,
                             "stderr_tail": done.stderr[-400:] if done.returncode else "",
                             **report})  # fmt: skip
                print(f"\r{i + 1}/{args.runs} processes, {sum(r['rc'] != 0 for r in runs)} "
                      "failed", end="", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            for p in busy:
                os.killpg(p.pid, 9)
                p.wait()
        print(file=sys.stderr)

    ok = [r for r in runs if r["rc"] == 0]
    failed = [r for r in runs if r["rc"] != 0]

    def q(values: list[float], p: float) -> float:
        if len(values) < 2:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[p - 1]

    print(f"{len(runs)} fresh processes, each loading sed ({args.quality}) and exiting, beside "
          f"{args.publishers} publishing processes")  # fmt: skip
    print(f"  exited 0: {len(ok)}; failed: {len(failed)} "
          f"(\"terminate called\": {sum(r['terminate'] for r in runs)})")  # fmt: skip
    if ok:
        for key, label in (("wall_s", "process start to exit"),
                           ("load_s", "load_context, model load included")):  # fmt: skip
            vals = [r[key] for r in ok]
            print(f"  {label:<38} median {statistics.median(vals):.2f} s, p90 {q(vals, 90):.2f} s,"
                  f" max {max(vals):.2f} s")  # fmt: skip
    for r in failed[:3]:
        print(f"  rc {r['rc']}: {r['stderr_tail'].strip()[-300:]}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "runs": runs, "publishers": args.publishers, "quality": args.quality,
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }, indent=2))  # fmt: skip
    print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
