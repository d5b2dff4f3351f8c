"""Publish to S3 and read through two edge caches, failing over when one goes down.

    python examples/edges_over_s3.py                                 # a local moto S3
    python examples/edges_over_s3.py --endpoint-url http://minio:9000 --bucket kv

Without --endpoint-url it starts moto's S3 server on 127.0.0.1 (pip install
moto[server]) with a fresh bucket. It publishes the bundled sed manual to
s3://BUCKET/kv, starts two `kvcdn edge serve` processes in front of it, loads
the document through them (each chunk says which edge served it), stops the
edge that served it, and loads again: the other edge takes over.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from importlib.resources import files

from kvcdn import sdk
from kvcdn.publish import publish
from kvcdn.store import open_store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_edge(origin: str, endpoint: str, cache_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcdn.cli.main", "edge", "serve", "--origin", origin,
         "--endpoint-url", endpoint, "--cache-dir", cache_dir, "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"the edge on port {port} exited")
            time.sleep(0.1)
    sys.exit(f"the edge on port {port} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint-url", help="an S3 endpoint (default: start moto)")
    parser.add_argument("--bucket", default="kvcdn-example")
    args = parser.parse_args()

    endpoint, moto = args.endpoint_url, None
    if endpoint is None:
        import boto3
        from moto.server import ThreadedMotoServer

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "example")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "example")
        port = free_port()
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        moto.start()
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=args.bucket
        )
    store = f"s3://{args.bucket}/kv"
    edges: list[subprocess.Popen] = []
    caches = tempfile.TemporaryDirectory()
    try:
        origin = open_store(store, endpoint_url=endpoint)
        with sdk.Client(store=origin) as client:
            try:
                client.resolve("sed-manual")
            except sdk.NotFound:
                manual = (files("kvcdn.cli") / "data" / "sed-manual.txt").read_text()
                publish(text=manual, name="sed-manual", model=client.model(), store=origin)

            urls = []
            for i in range(2):
                proc, url = start_edge(store, endpoint, f"{caches.name}/edge-{i}")
                edges.append(proc)
                urls.append(url)
            # through the edges, the store last; models and measurements shared
            edged = client.with_options(store=origin, edges=urls)
            ctx = edged.load_context("sed-manual")
            served = Counter(ctx.plan.chunk_sources)
            print(f"first load: chunks served by {dict(served)}")

            home = served.most_common(1)[0][0]
            stopped = edges[urls.index(home)]
            stopped.terminate()
            stopped.wait(timeout=20)  # every process of that edge has exited
            ctx = edged.load_context("sed-manual")
            print(f"after stopping {home}: chunks served by "
                  f"{dict(Counter(ctx.plan.chunk_sources))}")  # fmt: skip
            answer = ctx.generate("What is sed?", max_new_tokens=32)
            print(f"A: {answer.text.strip()}")
    finally:
        for proc in edges:  # stopped before their cache folders are removed
            proc.terminate()
            proc.wait(timeout=20)
        caches.cleanup()
        if moto is not None:
            moto.stop()

if __name__ == "__main__":
    main()
