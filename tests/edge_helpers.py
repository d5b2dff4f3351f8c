"""Edge nodes as real processes, and real chunk objects, for the edge tests."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from aiohttp import web

from kvcdn.codec import FIXED_LEVELS, encode_chunk
from kvcdn.keys import object_key
from tests.conftest import free_port


def chunk_object(seed: int, layers: int = 4) -> tuple[str, bytes]:
    """A real fp16 chunk container of about 1 MiB (``layers`` / 4 of it), and its key."""
    rng = np.random.default_rng(seed)
    kv = torch.from_numpy(rng.standard_normal((layers, 2, 2, 256, 64)).astype(np.float32))
    chunk_hash = f"{seed:064x}"
    level = FIXED_LEVELS["fp16"]
    data = encode_chunk(level, kv, chunk_hash)
    return object_key(chunk_hash, level.id, hashlib.sha256(data).hexdigest()), data


def large_chunk_object(size: int) -> tuple[str, bytes]:
    """A valid fp16 chunk container of ``size`` bytes (random payload), and its key."""
    from kvcdn.container import ChunkHeader, pack

    level = FIXED_LEVELS["fp16"]
    chunk_hash = hashlib.sha256(f"large-{size}".encode()).hexdigest()
    # fp16 KV of (layers, 2, heads, tokens, dim), to the size asked (a multiple of 1 MiB)
    header = ChunkHeader("fp16", "fp16", {}, (size >> 20, 2, 8, 256, 128), chunk_hash)
    data = pack(header, os.urandom(size - len(pack(header, b""))))
    return object_key(chunk_hash, level.id, hashlib.sha256(data).hexdigest()), data


class MotoOrigin:
    """A fresh bucket on moto's server; origin-side GETs read from moto's request recorder."""

    def __init__(self, endpoint: str, prefix: str) -> None:
        import boto3

        self.endpoint = endpoint
        self.prefix = prefix
        self.bucket = f"edge-{uuid.uuid4().hex[:12]}"
        self.url = f"s3://{self.bucket}/{prefix}"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.client.create_bucket(Bucket=self.bucket)
        self.objects: dict[str, bytes] = {}

    def start_recording(self) -> None:
        start_recording(self.endpoint)

    def stop_recording(self) -> None:  # the server is shared by the whole session
        stop_recording(self.endpoint)

    def origin_gets(self, key: str) -> int:
        """GETs of store key ``key`` that reached the origin since recording started."""
        path = f"/{self.bucket}/{self.prefix}/{key}"
        return sum(1 for url in recorded_gets(self.endpoint) if url.split("?")[0].endswith(path))


def start_recording(endpoint: str) -> None:
    """Moto's request recorder, emptied and started."""
    for action in ("stop-recording", "reset-recording", "start-recording"):
        post(f"{endpoint}/moto-api/recorder/{action}")


def stop_recording(endpoint: str) -> None:
    for action in ("stop-recording", "reset-recording"):
        post(f"{endpoint}/moto-api/recorder/{action}")


def recorded_gets(endpoint: str) -> list[str]:
    """The URLs (with their queries) of the GETs moto's recorder holds."""
    url = f"{endpoint}/moto-api/recorder/download-recording"
    with urllib.request.urlopen(url, timeout=10) as rec:
        lines = [json.loads(line) for line in rec.read().decode().splitlines() if line.strip()]
    return [r["url"] for r in lines if r["method"] == "GET"]


class EdgeProcess:
    """``kvcdn edge serve`` in its own process."""

    def __init__(
        self,
        origin_url: str,
        cache_dir: Path,
        endpoint: str | None,
        *extra: str,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "kvcdn.cli.main",
            "edge",
            "serve",
            "--origin",
            origin_url,
            "--cache-dir",
            str(cache_dir),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--origin-timeout",
            "5",
            *(["--endpoint-url", endpoint] if endpoint else []),
            # one process unless a test asks for workers: the default is one per core
            *([] if "--workers" in extra else ["--workers", "1"]),
            *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> EdgeProcess:
        # stderr goes to a file: a pipe that nobody reads fills up and stalls the edge
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=self.log, env=os.environ.copy()
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"edge exited: {self.log.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("edge did not start")

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)

    def wait_cached(self, writes: int, timeout_s: float = 10.0) -> None:
        """Wait until the edge has written ``writes`` objects to its disk cache since
        it started: clients are answered before the disk write of a miss ends."""
        deadline = time.monotonic() + timeout_s
        while self.metrics()["kvcdn_edge_cache_writes_total"] < writes:
            assert time.monotonic() < deadline, "the object never reached the disk cache"
            time.sleep(0.02)

    def output(self) -> str:
        """What the edge has logged so far."""
        self.log.seek(0)
        return self.log.read().decode()

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=5).read().decode()
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }


class Hostile:
    """``tests/hostile_edge.py`` in its own process: an edge (or a parent) that lies in
    ``mode``, serving the store folder ``store`` (see that module for the modes)."""

    def __init__(self, store, port: int | None = None, mode: str = "hang",
                 donor: str | None = None) -> None:  # fmt: skip
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        args = [sys.executable, "-m", "tests.hostile_edge", "--store", str(store)]
        args += ["--port", str(self.port), "--mode", mode, *(["--donor", donor] if donor else [])]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=1).read()
                return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self._stderr()
                time.sleep(0.1)

    def _stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode()[-2000:]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class RefusingQuerySignatures:
    """An S3 endpoint that takes only header-signed requests: a real HTTP server in a
    thread, answering ``status`` to a query-signed (presigned) request (403, as such a
    store does; or a redirect to its own ``/elsewhere``, counted if followed), and
    passing every other request on to ``upstream`` (moto) as it came."""

    def __init__(self, upstream: str, status: int = 403) -> None:
        self.upstream = upstream.rstrip("/")
        self.status = status
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.refused = 0
        self.followed = 0  # requests to where a redirect pointed
        self.keepalive_timeout = 75.0  # aiohttp's default
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/elsewhere"):
            self.followed += 1
            return web.Response(status=404)
        if "X-Amz-Signature" in request.query:
            self.refused += 1
            body = b"<Error><Code>AccessDenied</Code><Message>query signatures</Message></Error>"
            where = {"Location": f"{self.url}/elsewhere"} if 300 <= self.status < 400 else {}
            return web.Response(status=self.status, body=body, headers=where,
                                content_type="application/xml")  # fmt: skip
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            async with session.request(
                request.method, self.upstream + request.path_qs, data=await request.read(),
                headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
            ) as resp:  # fmt: skip
                skip = {"transfer-encoding", "content-length", "connection"}
                headers = {k: v for k, v in resp.headers.items() if k.lower() not in skip}
                return web.Response(status=resp.status, body=await resp.read(), headers=headers)

    def __enter__(self) -> RefusingQuerySignatures:
        async def start() -> web.AppRunner:
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", self._answer)
            runner = web.AppRunner(app, keepalive_timeout=self.keepalive_timeout)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            return runner

        self._thread.start()
        self._runner = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class MisbehavingPresignedGets(RefusingQuerySignatures):
    """An S3 endpoint whose query-signed (presigned) GETs misbehave as ``mode`` says,
    every other request passed on to ``upstream`` (moto):

    - ``endless``: a 200 whose chunked body of zeros never ends (while the mode stays);
    - ``too-long``: a 200 announcing a body of a TiB, zeros sent while the mode stays;
    - ``short``: a 200 announcing 100 bytes more than the object, the connection closed
      after the object;
    - ``extra``: the object, then bytes beyond its ``Content-Length`` (16 KiB of zeros);
    - ``hang``: the headers never come (while the mode stays);
    - ``idle-close``: each GET passed on too, on connections kept alive (HTTP/1.1)
      but closed by the server after ``keepalive_timeout`` idle seconds, as S3's
      front ends do; ``connections`` counts the connections that sent a GET.
    """

    def __init__(self, upstream: str, mode: str, keepalive_timeout: float = 75.0) -> None:
        super().__init__(upstream)
        self.mode = mode
        self.keepalive_timeout = keepalive_timeout
        self.signed_gets = 0
        self._connections: set[int] = set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if "X-Amz-Signature" not in request.query:
            return await super()._answer(request)
        self.signed_gets += 1
        self._connections.add(id(request.transport))
        # (until the mode changes: a test's end must not wait for these)
        while self.mode == "hang":
            await asyncio.sleep(0.05)
        if self.mode in ("endless", "too-long"):
            resp = web.StreamResponse()
            if self.mode == "endless":
                resp.enable_chunked_encoding()
            else:
                resp.content_length = 1 << 40
            await resp.prepare(request)
            zeros = bytes(1 << 20)  # a body passes an object's limit (1 GiB) in seconds
            while self.mode in ("endless", "too-long"):
                await resp.write(zeros)
            return resp
        if self.mode in ("short", "extra"):  # the object, as moto has it
            async with aiohttp.ClientSession(auto_decompress=False) as session:
                async with session.get(self.upstream + request.path_qs,
                                       headers={"Host": request.host}) as upstream:  # fmt: skip
                    body = await upstream.read()
            resp = web.StreamResponse()
            resp.content_length = len(body) + (100 if self.mode == "short" else 0)
            await resp.prepare(request)
            await resp.write(body)
            assert request.transport is not None
            if self.mode == "extra":
                request.transport.write(bytes(16 << 10))
            request.transport.close()
            return resp
        # idle-close: the object, from moto, the signed request passed on as it came
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            async with session.get(self.upstream + request.path_qs,
                                   headers={"Host": request.host}) as resp:  # fmt: skip
                return web.Response(status=resp.status, body=await resp.read())


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def post_json(url: str, body: Any, headers: dict[str, str] | None = None):
    """POST JSON; (status, decoded JSON or text)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10).read()
