"""The edge's reads from an S3 origin: its presigned GETs against aiohttp's client.

    python bench/edge_origin.py [--objects 64] [--size 1048576] [--fetches 300]
                                [--concurrency 8] [--rounds 5] [--json OUT.json]

Starts moto's S3 server (a subprocess on 127.0.0.1) holding ``--objects`` objects,
then, in this one process, reads ``--fetches`` of them per round through each of:

- ``presigned``: what an edge's miss does, :meth:`edge.origin.StoreOrigin.fetch`
  (a presigned GET by :mod:`edge.presigned`, each read hashed and written into a
  spool of a real cache folder);
- ``aiohttp``: the same presigned URLs read by aiohttp's client into the same kind
  of spool (``edge.origin._HTTPReads``, which the edge used for these reads before
  and still uses for parent edges).

``--concurrency`` fetches at a time, each spool removed after its fetch (the cache
does not grow: the page cache's fresh pages, which cost a nested VM several times
the copy, are not what this measures). The methods alternate, round by round.
Prints and writes per method the medians over the rounds of fetches/s and of this
process's user and system CPU a fetch (getrusage), and their ratios; every body's
sha256 is checked against the object's. The first round of each method runs in a
process that has fetched nothing yet (the fresh figure); the medians are over all.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BUCKET = "kvcdn-bench-origin"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=5).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.1)


async def _round(method: str, origin: Any, reads: Any, cache: Any, keys: list[str],
                 expect: dict[str, str], args: argparse.Namespace) -> dict[str, float]:  # fmt: skip
    """One round of ``args.fetches`` fetches by ``method``: fetches/s, CPU ms a fetch."""
    todo = iter(keys[i % len(keys)] for i in range(args.fetches))
    wrong: list[str] = []

    async def worker() -> None:
        for key in todo:
            spool = cache.spool(key, 1 << 30)
            try:
                if method == "presigned":
                    await origin.fetch(key, spool)
                else:
                    await reads.stream(origin._store.presigned_get(key), key, spool)
                if spool.sha256 != expect[key]:
                    wrong.append(key)
            finally:
                spool.discard()

    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    if wrong:
        raise RuntimeError(f"{method}: {len(wrong)} bodies with the wrong sha256")
    return {
        "fetches_s": args.fetches / seconds,
        "user_ms": 1e3 * (after.ru_utime - before.ru_utime) / args.fetches,
        "system_ms": 1e3 * (after.ru_stime - before.ru_stime) / args.fetches,
    }


async def _measure(endpoint: str, keys: list[str], expect: dict[str, str], folder: Path,
                   args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:  # fmt: skip
    from kvcdn.edge.cache import DiskCache
    from kvcdn.edge.origin import StoreOrigin, _HTTPReads

    origin = StoreOrigin(f"s3://{BUCKET}", 30.0, endpoint_url=endpoint)
    reads = _HTTPReads(origin.url, 30.0, {})
    cache = DiskCache(folder, 64 << 30)
    rounds: dict[str, list[dict[str, float]]] = {"presigned": [], "aiohttp": []}
    try:
        for r in range(args.rounds):
            order = ("presigned", "aiohttp") if r % 2 == 0 else ("aiohttp", "presigned")
            for method in order:
                rounds[method].append(await _round(method, origin, reads, cache, keys, expect,
                                                   args))  # fmt: skip
    finally:
        await reads.close()
        await origin.close()
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objects", type=int, default=64)
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes an object")
    parser.add_argument("--fetches", type=int, default=300, help="fetches a round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path,
                        default=REPO / "bench" / "results" / "edge_origin.json")  # fmt: skip
    args = parser.parse_args()
    for name in ("objects", "size", "fetches", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} takes a count of at least 1")

    import boto3

    work = Path(tempfile.mkdtemp(prefix="kvcdn-bench-origin-"))
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    moto, endpoint = _start_moto(work / "moto.log")
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket=BUCKET)
        expect = {}
        print(f"uploading {args.objects} objects of {args.size} bytes to moto ...")
        for i in range(args.objects):
            data = os.urandom(args.size)
            s3.put_object(Bucket=BUCKET, Key=f"o{i}", Body=data)
            expect[f"o{i}"] = hashlib.sha256(data).hexdigest()
        print(f"{args.rounds} rounds of {args.fetches} fetches each way, "
              f"{args.concurrency} at a time ...")  # fmt: skip
        rounds = asyncio.run(_measure(endpoint, list(expect), expect, work / "cache", args))
    finally:
        moto.kill()
        moto.wait()
        import shutil

        shutil.rmtree(work, ignore_errors=True)

    from rich.console import Console
    from rich.table import Table

    medians = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for m, rs in rounds.items()}  # fmt: skip
    table = Table(title=f"edge origin reads from moto: {args.size / 2**20:g} MiB objects, "
                  f"{args.concurrency} at a time, medians of {args.rounds} rounds")  # fmt: skip
    for col in ("method", "fetches/s", "user ms/fetch", "system ms/fetch", "CPU ms/fetch",
                "first round CPU ms/fetch"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, m in medians.items():
        first = rounds[method][0]
        table.add_row(method, f"{m['fetches_s']:.0f}", f"{m['user_ms']:.2f}",
                      f"{m['system_ms']:.2f}", f"{m['user_ms'] + m['system_ms']:.2f}",
                      f"{first['user_ms'] + first['system_ms']:.2f}")  # fmt: skip
    new, old = medians["presigned"], medians["aiohttp"]
    ratios = {
        "fetches_s": new["fetches_s"] / old["fetches_s"],
        "user_ms": new["user_ms"] / old["user_ms"],
        "system_ms": new["system_ms"] / old["system_ms"],
        "cpu_ms": (new["user_ms"] + new["system_ms"]) / (old["user_ms"] + old["system_ms"]),
    }
    table.add_row("presigned / aiohttp", f"{ratios['fetches_s']:.2f}x", f"{ratios['user_ms']:.2f}x",
                  f"{ratios['system_ms']:.2f}x", f"{ratios['cpu_ms']:.2f}x", "")  # fmt: skip
    Console(width=110).print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: getattr(args, k) for k in ("objects", "size", "fetches", "concurrency", "rounds")}
    setup |= {"origin": "moto S3 server, a subprocess on 127.0.0.1", "cpus": os.cpu_count()}
    result = {"benchmark": "edge_origin", "setup": setup, "medians": medians,
              "ratios_presigned_over_aiohttp": ratios, "rounds": rounds}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
