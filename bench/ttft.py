"""The time to first token a user meets: a fresh CLI, a fresh process's first request, steady state.

    python bench/ttft.py [--doc FILE] [--tokens 512,2048,full] [--repeats 5]
                         [--stores local,s3] [--json OUT]

Cuts the first N tokens of a document (the bundled sed manual; ``full``: all
of it; N counts the chat framing, as the published token count does), publishes
the pieces once per store with one ``kvcdn publish FILE... --json`` (each named
after its file; the default levels) to a local folder and to S3 (moto's server
on 127.0.0.1), then for each document and store measures:

- fresh process: ``kvcdn ask NAME "What is sed?" --max-new-tokens 1 --json``
  run as a command; its wall clock from spawn to exit (Python start, imports,
  model load, load, first token) and the TTFT it reports (``kvcdn.ttft_s``);
- first request: in a fresh Python process, ``sdk.Client`` loads the model
  (model-load seconds, reported apart), then the first ``load_context`` +
  ``generate``: TTFT = ``plan.ready_s + answer.ttft_s``;
- steady state: the median TTFT of ``--repeats`` further requests there;
- the baseline, in that same process: a full prefill of the document and the
  question, fp32 (the model as loaded) and bf16 (a copy), median of
  ``--repeats`` after one warm-up.

Speedups compare each kvcdn TTFT with the fp32 and the bf16 prefill. Prints
the conditions and a table, writes every raw figure as JSON. The CLI opens the
store before its clock starts; the SDK's first request opens it on the clock
(for S3 the first connection), so the two TTFTs differ by that much.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
QUESTION = "What is sed?"
BUCKET = "kvcdn-bench"

# The measuring process: argv store, endpoint ("" for none), name, question, repeats.
# Prints one JSON line.
_CHILD = r"""
import time
started = time.perf_counter()
import copy, json, sys
import torch
from kvcdn import sdk
from kvcdn.models import LoadedModel

store, endpoint, name, question, repeats = sys.argv[1:6]
repeats = int(repeats)
import_s = time.perf_counter() - started

t = time.perf_counter()
client = sdk.Client(store=store, endpoint_url=endpoint or None)
model = client.model()
model_s = time.perf_counter() - t

def request():
    t = time.perf_counter()
    ctx = client.load_context(name)
    answer = ctx.generate(question, max_new_tokens=1)
    wall = time.perf_counter() - t
    plan = ctx.plan
    return ctx, {
        "ttft_s": plan.ready_s + answer.ttft_s, "ready_s": plan.ready_s,
        "answer_ttft_s": answer.ttft_s, "wall_s": wall, "bytes": plan.bytes,
        "levels": sorted(set(plan.chunk_levels)), "seconds": dict(plan.seconds),
        "first_token": int(answer.first_token_logits.argmax()),
    }

ctx, first = request()
steady = [request()[1] for _ in range(repeats)]

def prefill(loaded):
    runs = [sdk.answer_with_prefill(loaded, ctx.token_ids, question, max_new_tokens=1)
            for _ in range(1 + repeats)]  # the first is the warm-up
    return {"warmup_s": runs[0].ttft_s, "runs_s": [a.ttft_s for a in runs[1:]],
            "first_token": int(runs[-1].first_token_logits.argmax())}

fp32 = prefill(model)
bf16_model = copy.deepcopy(model.model).to(torch.bfloat16)
bf16 = prefill(LoadedModel(model.source, bf16_model, model.tokenizer, model.device))
print(json.dumps({
    "model": model.name, "device": model.device, "dtype": model.layout.dtype,
    "torch_threads": torch.get_num_threads(), "import_s": import_s, "model_s": model_s,
    "tokens": len(ctx.token_ids), "first": first, "steady": steady,
    "prefill_fp32": fp32, "prefill_bf16": bf16,
}))
"""


def _run(argv: list[str], env: dict[str, str]) -> tuple[str, float]:
    """Run a command from the repository root: its stdout and its wall clock from spawn
    to exit. A failing command prints its stderr tail and ends the benchmark."""
    t = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        sys.exit(f"the measuring process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, wall


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cut(doc: Path, sizes: list[str], folder: Path) -> list[Path]:
    """One file per size, ``bench-N.txt``: the first N tokens of ``doc``, framing
    included (``full``: all of it), cut with the embedded model's tokenizer."""
    import contextlib
    import io

    from transformers import AutoTokenizer

    from kvcdn.models import resolve_model

    source = resolve_model(None)
    with contextlib.redirect_stderr(io.StringIO()):  # GGUF parsing draws a progress bar
        tok = AutoTokenizer.from_pretrained(
            source.directory, gguf_file=source.gguf_file, local_files_only=True
        )
    # the tokens of the chat framing before a document count towards its N
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "@@DOC@@"}], tokenize=False, add_generation_prompt=True
    )
    frame = len(tok(rendered.split("@@DOC@@")[0], add_special_tokens=False).input_ids)
    text = doc.read_text()
    body = tok(text, add_special_tokens=False).input_ids
    files = []
    for size in sizes:
        piece = text if size == "full" else tok.decode(body[: max(1, int(size) - frame)])
        path = folder / f"bench-{size}.txt"
        path.write_text(piece)
        files.append(path)
    return files


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvcdn.cli.main", *args]


def _measure(
    file: Path, store: str, endpoint: str | None, repeats: int, env: dict[str, str]
) -> dict[str, Any]:
    """One document from one store: a fresh CLI ask, then the measuring process."""
    name, where = file.stem, ["--store", store]
    if endpoint:
        where += ["--endpoint-url", endpoint]
    ask = _cli("ask", name, QUESTION, *where, "--max-new-tokens", "1", "--json")
    stdout, wall = _run(ask, env)
    asked = json.loads(stdout)
    stdout, _ = _run(
        [sys.executable, "-c", _CHILD, store, endpoint or "", name, QUESTION, str(repeats)], env
    )
    child = json.loads(stdout.strip().splitlines()[-1])
    steady = statistics.median(r["ttft_s"] for r in child["steady"])
    fp32 = statistics.median(child["prefill_fp32"]["runs_s"])
    bf16 = statistics.median(child["prefill_bf16"]["runs_s"])
    ttft = {
        "fresh": asked["kvcdn"]["ttft_s"],
        "first": child["first"]["ttft_s"],
        "steady": steady,
    }
    return {
        "tokens": child["tokens"],
        "fresh_cli": {"wall_s": wall, "ttft_s": ttft["fresh"],
                      "ready_s": asked["kvcdn"]["ready_s"], "load": asked["documents"][0]["load"]},
        "child": child,
        "steady_ttft_s": steady,
        "prefill_fp32_s": fp32,
        "prefill_bf16_s": bf16,
        "speedup_vs_fp32": {k: fp32 / v for k, v in ttft.items()},
        "speedup_vs_bf16": {k: bf16 / v for k, v in ttft.items()},
        "first_over_steady": ttft["first"] / steady,
        "same_first_token": {  # kvcdn's first answer token is the prefill's
            p: child["first"]["first_token"] == child[f"prefill_{p}"]["first_token"]
            for p in ("fp32", "bf16")
        },
    }  # fmt: skip


def _table(rows: list[tuple[str, ...]]) -> None:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, width, strict=True)))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _report(results: list[dict[str, Any]], conditions: dict[str, Any], repeats: int) -> None:
    c = conditions
    print(f"{c['cpu']}, {c['cpus']} CPUs; {c['platform']}")
    print(f"python {c['python']}, torch {c['torch']}, transformers {c['transformers']}; "
          f"{c['model']} on {c['device']} ({c['dtype']}), "
          f"{c['torch_threads']} torch threads")  # fmt: skip
    print(f"question {QUESTION!r}, 1 answer token; steady state and prefills: median of "
          f"{repeats}\n")  # fmt: skip
    rows = [("tokens", "store", "CLI wall s", "CLI TTFT s", "first TTFT s", "steady TTFT s",
             "prefill fp32 s", "prefill bf16 s", "steady vs fp32", "vs bf16", "first/steady",
             "model load s")]  # fmt: skip
    for r in results:
        rows.append((
            f"{r['tokens']:,}", r["store"], f"{r['fresh_cli']['wall_s']:.2f}",
            f"{r['fresh_cli']['ttft_s']:.3f}", f"{r['child']['first']['ttft_s']:.3f}",
            f"{r['steady_ttft_s']:.3f}", f"{r['prefill_fp32_s']:.3f}",
            f"{r['prefill_bf16_s']:.3f}", f"{r['speedup_vs_fp32']['steady']:.1f}x",
            f"{r['speedup_vs_bf16']['steady']:.1f}x", f"{r['first_over_steady']:.1f}x",
            f"{r['child']['model_s']:.1f}",
        ))  # fmt: skip
    _table(rows)
    print("\nkvcdn TTFT speedup over a full prefill (fp32 / bf16):")
    rows = [("tokens", "store", "fresh process", "first request", "steady state")]
    for r in results:
        fp32, bf16 = r["speedup_vs_fp32"], r["speedup_vs_bf16"]
        pairs = [f"{fp32[k]:.1f}x / {bf16[k]:.1f}x" for k in ("fresh", "first", "steady")]
        rows.append((f"{r['tokens']:,}", r["store"], *pairs))
    _table(rows)
    for r in results:
        for p, same in r["same_first_token"].items():
            if not same:
                print(f"note: {r['doc']} from {r['store']}: kvcdn's first token is not the "
                      f"{p} prefill's")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, default=REPO / "cli" / "data" / "sed-manual.txt")
    parser.add_argument("--tokens", default="512,2048,full", help="sizes, N or full")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stores", default="local,s3", help="local and/or s3 (moto)")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "ttft.json")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.tokens.split(",") if s.strip()]
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if any(s != "full" and not s.isdigit() for s in sizes) or not sizes:
        parser.error("--tokens takes sizes such as 512,2048,full")
    if not stores or set(stores) - {"local", "s3"}:
        parser.error("--stores takes local and/or s3")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        env.pop(key, None)
    server = None
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvcdn-bench-ttft-") as tmp:
        files = _cut(args.doc, sizes, Path(tmp))
        urls: dict[str, tuple[str, str | None]] = {}
        try:
            if "local" in stores:
                urls["local"] = (str(Path(tmp) / "store"), None)
            if "s3" in stores:
                import boto3
                from moto.server import ThreadedMotoServer

                logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
                port = _free_port()
                server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
                server.start()
                endpoint = f"http://127.0.0.1:{port}"
                boto3.client(
                    "s3", endpoint_url=endpoint, region_name="us-east-1",
                    aws_access_key_id="testing", aws_secret_access_key="testing",
                ).create_bucket(Bucket=BUCKET)  # fmt: skip
                urls["s3"] = (f"s3://{BUCKET}/kv", endpoint)
            for label, (url, endpoint) in urls.items():  # every store before any measuring
                where = ["--store", url] + (["--endpoint-url", endpoint] if endpoint else [])
                print(f"publishing {len(files)} documents to {label}…", file=sys.stderr)
                _run(_cli("publish", *map(str, files), *where, "--json"), env)
            for file in files:
                for label, (url, endpoint) in urls.items():
                    print(f"measuring {file.stem} from {label}…", file=sys.stderr)
                    results.append(
                        {"doc": file.stem, "store": label,
                         **_measure(file, url, endpoint, args.repeats, env)}
                    )  # fmt: skip
        finally:
            if server is not None:
                server.stop()

    child = results[0]["child"]
    conditions = {
        "cpu": _cpu(), "cpus": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": version("torch"),
        "transformers": version("transformers"), "model": child["model"],
        "device": child["device"], "dtype": child["dtype"],
        "torch_threads": child["torch_threads"],
    }  # fmt: skip
    _report(results, conditions, args.repeats)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "ttft", "question": QUESTION, "doc": args.doc.name,
              "repeats": args.repeats, "conditions": conditions, "rows": results}  # fmt: skip
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
