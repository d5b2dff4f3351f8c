"""Time to first token: full prefill versus loading published KV, per level and store.

    python bench/ttft.py [--doc FILE] [--tokens 512,1024,2048] [--repeats 3] [--json OUT]

For each context length, publishes the first N tokens of a real document (the
sed manual by default) to a local folder and to S3 (moto's server on
127.0.0.1), then measures, in the same run, the time to first token of:
- a full prefill of the document and the question (the baseline);
- loading each level (resolve, fetch, verify, decode, build the cache) and
  running the question's tokens, from each store.
Prints a table (median of --repeats) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUESTION = "What is sed?"


LEVELS = ("fp16", "int8", "default", "lowest")  # the lossless reference, int8, two ladder levels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, default=REPO / "cli" / "data" / "sed-manual.txt")
    parser.add_argument("--tokens", default="512,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "ttft.json")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) store")
    args = parser.parse_args()

    import boto3
    import torch
    from rich.console import Console
    from rich.table import Table

    from kvcdn import sdk
    from kvcdn.models import load_model
    from kvcdn.publish import publish

    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model()
    text = args.doc.read_text()
    body_ids = model.tokenizer(text, add_special_tokens=False).input_ids
    frame = len(model.document_ids(""))

    stores: dict[str, str] = {"local": tempfile.mkdtemp(prefix="kvcdn-bench-")}
    server = None
    if not args.no_s3:
        from moto.server import ThreadedMotoServer

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="kvcdn-bench")
        stores["s3 (moto)"] = "s3://kvcdn-bench/kv"

    rows = []
    for n_tokens in [int(t) for t in args.tokens.split(",")]:
        piece = model.tokenizer.decode(body_ids[: max(1, n_tokens - frame)])
        name = f"bench-{n_tokens}"
        for url in stores.values():
            publish(text=piece, name=name, model=model, store=url, levels=LEVELS)
        ids = sdk.load_context(name, store=stores["local"], model=model).token_ids
        sdk.answer_with_prefill(model, ids, QUESTION, max_new_tokens=1)  # warm-up
        prefill = statistics.median(
            sdk.answer_with_prefill(model, ids, QUESTION, max_new_tokens=1).ttft_s
            for _ in range(args.repeats)
        )
        rows.append(
            {
                "tokens": len(ids),
                "store": "-",
                "level": "full prefill",
                "bytes": 0,
                "ttft_s": prefill,
                "speedup": 1.0,
                "stages_s": {},
            }
        )
        for store_name, url in stores.items():
            for level in LEVELS:
                samples = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    ctx = sdk.load_context(name, store=url, model=model, quality=level)
                    answer = ctx.generate(QUESTION, max_new_tokens=1)
                    samples.append((time.perf_counter() - t, ctx.plan, answer.ttft_s))
                samples.sort(key=lambda s: s[0])
                ttft, plan, first = samples[len(samples) // 2]
                rows.append(
                    {
                        "tokens": len(ids),
                        "store": store_name,
                        "level": level,
                        "bytes": plan.bytes,
                        "ttft_s": ttft,
                        "speedup": prefill / ttft,
                        "stages_s": {**plan.seconds, "first_token": first},
                    }
                )
    if server:
        server.stop()

    table = Table(
        title=f"time to first token, {model.name} on {model.device} (median of {args.repeats})"
    )
    for col in ("tokens", "store", "level", "bytes", "TTFT (s)", "vs prefill"):
        table.add_column(col, justify="left" if col in ("store", "level") else "right")
    for r in rows:
        table.add_row(
            str(r["tokens"]),
            r["store"],
            r["level"],
            f"{r['bytes'] / 1e6:.1f} MB" if r["bytes"] else "-",
            f"{r['ttft_s']:.3f}",
            f"{r['speedup']:.1f}×",
        )
    Console().print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "benchmark": "ttft",
                "model": model.name,
                "device": model.device,
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "python": sys.version.split()[0],
                    "torch": torch.__version__,
                },
                "question": QUESTION,
                "repeats": args.repeats,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
