"""A hostile edge for the tests: it answers like an edge, from a real store folder, but lies.

    python -m tests.hostile_edge --store DIR --port N --mode MODE [--donor NAME]

Modes (what it does to chunk objects or manifests; everything else is served
honestly from the folder):

* ``forge-object``: every chunk object is a self-consistent forgery, the real
  container with payload bytes changed and its own sha256 trailer recomputed;
* ``swap-manifest``: every manifest is the newest manifest of ``--donor`` with
  its name and version edited to the ones asked for, unsigned (an attacker has
  no publisher key);
* ``oversized``: chunk objects are announced as 100,000,000,000 bytes, then
  zeros are sent;
* ``endless``: chunk objects come without a length, zeros without end;
* ``drip``: chunk objects are announced at their true size and sent one byte
  every 0.2 s;
* ``gzip-bomb``: every key is answered with ``Content-Encoding: gzip`` and 2 MB
  that inflate to 2 GiB of zeros (a parent edge that tries to exhaust its child);
* ``hang``: every request but ``/healthz`` is accepted and never answered (an edge
  whose process is stuck, or a black-holed link);
* ``busy-once``: the first request for each key is answered ``429 Too Many
  Requests``, later ones honestly (an edge shedding load for a moment).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import zlib
from pathlib import Path

from aiohttp import web

MODES = (
    "forge-object", "swap-manifest", "oversized", "endless", "drip", "gzip-bomb", "hang",
    "busy-once",
)  # fmt: skip


def gzip_bomb(inflated: int = 2 << 30) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    zeros = bytes(1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(inflated >> 20)) + packer.flush()


def forge_object(data: bytes) -> bytes:
    body = bytearray(data[:-32])
    middle = len(body) - 100  # inside the payload, past the header
    body[middle] ^= 0xFF
    return bytes(body) + hashlib.sha256(body).digest()


def swapped_manifest(store: Path, donor: str, name: str, version: int) -> bytes:
    newest = sorted((store / "docs" / donor / "versions").glob("*.json"))[-1]
    raw = json.loads(newest.read_bytes())
    if "payloadType" in raw:  # a signed donor: keep its content, lose its signature
        raw = json.loads(base64.b64decode(raw["payload"]))
    raw["document"]["name"] = name
    raw["version"] = version
    return json.dumps(raw).encode()


def app(store: Path, mode: str, donor: str | None) -> web.Application:
    bomb = gzip_bomb() if mode == "gzip-bomb" else b""
    asked: set[str] = set()

    async def serve(request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        if mode == "hang":
            await asyncio.Event().wait()  # never answers: no headers, no body
        if mode == "busy-once" and key not in asked:
            asked.add(key)
            return web.Response(status=429, text="busy\n", headers={"Retry-After": "1"})
        if bomb:
            return web.Response(body=bomb, headers={"Content-Encoding": "gzip"})
        path = store / key
        if mode == "swap-manifest" and "/versions/" in key and donor:
            name, version = key.split("/")[1], int(key.rsplit("/", 1)[1].split(".")[0])
            return web.Response(body=swapped_manifest(store, donor, name, version))
        if not path.is_file():
            return web.Response(status=404, text="not found\n")
        data = path.read_bytes()
        if not key.startswith("objects/"):
            return web.Response(body=data)
        if mode == "forge-object":
            return web.Response(body=forge_object(data))
        if mode in ("oversized", "endless", "drip"):
            resp = web.StreamResponse()
            if mode == "oversized":
                resp.content_length = 100_000_000_000
            elif mode == "drip":
                resp.content_length = len(data)
            else:
                resp.enable_chunked_encoding()
            await resp.prepare(request)
            try:
                if mode == "drip":
                    for i in range(len(data)):
                        await resp.write(data[i : i + 1])
                        await asyncio.sleep(0.2)
                else:
                    zeros = bytes(1 << 20)
                    while True:
                        await resp.write(zeros)
            except (ConnectionError, RuntimeError):
                pass  # the client gave up, as it should
            return resp
        return web.Response(body=data)

    application = web.Application()
    application.router.add_get("/healthz", lambda r: web.Response(text="ok\n"))
    application.router.add_get("/{key:.+}", serve)
    return application


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--donor")
    args = parser.parse_args()
    web.run_app(
        app(args.store, args.mode, args.donor),
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
