"""Edge cache benchmark: kvcdn's edge node against nginx proxy_cache, same origin, same load.

    python bench/edge.py [--objects 256] [--clients 32] [--duration 10] [--client-procs 2]
                         [--workers 1,2] [--rounds 3] [--cpu-affinity auto|off]
                         [--json OUT.json] [--no-nginx]

Starts moto's S3 server (a subprocess on 127.0.0.1) as the origin with
``--objects`` valid 1 MiB chunk containers, then, one at a time and each with a
fresh cache in front of it, for each N of ``--workers``: ``kvcdn edge serve
--workers N`` and nginx ``proxy_cache`` with ``worker_processes N`` (the same
CPU budget: the comparison), each worker on a core of its own (the edge's
``--cpu-affinity auto``, nginx's ``worker_cpu_affinity auto``; ``--cpu-affinity
off``: both placed by the kernel). For each, a
miss phase (``--clients`` concurrent clients GET every object once, all cold)
and a hit phase (an untimed pass over all objects, then the clients GET random
objects for ``--duration`` seconds). ``--rounds R`` runs that sequence R times
against the same origin, the servers interleaved (kvcdn first in even rounds, nginx
in odd ones; the disk synced before each server starts, so that none pays for the
last one's writeback), and reports each row's median
over the rounds (and each round's kvcdn/nginx ratio): on a shared 2-CPU host one
server's miss rate moves by half from one run to the next, with the state of the
host's memory, so a single run's ratio says little. Every run's cache is kept
until the end: removing one makes the next run's file creations slower (ext4
skips recently freed inodes), which would penalise the server that runs next; so
the run needs ``--objects`` x ``--size`` x servers x rounds of free disk.

The load generator runs in ``--client-procs`` processes of its own, one
keep-alive connection per client: a minimal asyncio HTTP/1.1 client reading
each response into a preallocated buffer (aiohttp's client took ~3x the CPU
per MiB and held nginx to half its rate on 2 cores). Every response must be a
200 of the exact length with the exact sha256 (one in ``--check-every`` timed
hits is hashed; misses and the untimed pass all are), and hits are confirmed
(nginx's ``X-Cache-Status``, the edge's ``/metrics``): a fast wrong answer
cannot win. Prints req/s, MB/s
(10^6 bytes), p50/p99 latency (request to last body byte), CPU use, the
kvcdn/nginx ratios and the targets (hit throughput >= 1x nginx's, miss throughput
>= 0.8x) at each worker count; writes JSON. Server CPU is the server's
processes' (a kvcdn supervisor and its workers, nginx's master and workers) user
and system time over the phase, per request, also given apart: user is the server's
own code, system the kernel's work for it (sockets, files, and the loopback
delivery to the client that its sends trigger). Installs nothing: without nginx (on PATH or
/usr/sbin/nginx) it says how to install it and exits 2; --no-nginx runs the
kvcdn edge alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BUCKET = "kvcdn-bench"
NGINX_CONF = """{user}worker_processes {workers};
{affinity}pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off; sendfile on; tcp_nopush on;
  keepalive_requests 1000000; keepalive_timeout 300s;
{temp_paths}  proxy_cache_path {d}/cache levels=1:2 keys_zone=kv:16m max_size=64g inactive=1y
                   use_temp_path=off;
  upstream origin {{ server 127.0.0.1:{origin}; keepalive 32; }}
  server {{
    listen 127.0.0.1:{port};
    location = /healthz {{ return 200 "ok\\n"; }}
    location / {{
      proxy_pass http://origin/{bucket}/;
      proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering on;
      proxy_set_header Host 127.0.0.1:{origin};
      proxy_set_header Range ""; proxy_set_header If-Range "";
      proxy_set_header If-None-Match ""; proxy_set_header If-Modified-Since "";
      proxy_cache kv; proxy_cache_key $uri; proxy_cache_valid 200 1y;
      proxy_cache_lock on; proxy_cache_lock_timeout 120s;
      proxy_ignore_headers Cache-Control Expires Set-Cookie Vary X-Accel-Expires;
      add_header X-Cache-Status $upstream_cache_status always;
    }}
  }}
}}
"""
INSTALL = """nginx is not installed; this benchmark compares the edge with it. Install it:
  sudo apt-get install nginx-light   # Debian, Ubuntu
  sudo dnf install nginx             # Fedora, RHEL
  brew install nginx                 # macOS
or measure the kvcdn edge alone with --no-nginx."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _start(cmd: list[str], log: Path, url: str) -> subprocess.Popen[bytes]:
    """Start a server in a session of its own (Ctrl-C reaches only us) and wait for ``url``."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            _get(url)
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError(f"{cmd[:3]} did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left in the session we made for it (nginx workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _cpu(pid: int | None = None) -> tuple[float, float, float, float] | None:
    """(User and system CPU seconds of ``pid`` and its children, host busy seconds, host
    seconds), via psutil."""
    try:
        import psutil
    except ImportError:
        return None
    procs = [psutil.Process(pid)] if pid else []
    procs += procs[0].children(recursive=True) if procs else []
    user = system = 0.0
    host = psutil.cpu_times()
    for p in procs:
        with contextlib.suppress(psutil.Error):  # a child that has just exited
            times = p.cpu_times()
            user, system = user + times.user, system + times.system
    return user, system, sum(host) - host.idle - getattr(host, "iowait", 0.0), sum(host)


def _counters(url: str) -> dict[str, float]:
    lines = _get(f"{url}/metrics").splitlines()
    wanted = ("kvcdn_edge_hits_total", "kvcdn_edge_misses_total")
    return {k: float(v) for k, _, v in (ln.partition(" ") for ln in lines) if k in wanted}


# ---- the load generator (in processes of its own) ----------------------------------------


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection; each response lands in one preallocated buffer."""

    def __init__(self, capacity: int) -> None:
        self.buf, self.n, self.end, self.body_at, self.status = bytearray(capacity), 0, 0, 0, 0
        self.headers: dict[str, str] = {}
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: Any = None
        self.closed = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)[self.n :]

    def buffer_updated(self, nbytes: int) -> None:
        self.n += nbytes
        if not self.end and (i := self.buf.find(b"\r\n\r\n", 0, self.n)) >= 0:
            first, *lines = bytes(self.buf[:i]).decode("latin-1").split("\r\n")
            self.status, self.body_at = int(first.split()[1]), i + 4
            fields = (line.partition(":") for line in lines)
            self.headers = {k.strip().lower(): v.strip() for k, _, v in fields}
            self.end = self.body_at + int(self.headers.get("content-length", len(self.buf)))
        if self.end and self.end <= len(self.buf):
            if self.n >= self.end:
                self._settle(None)
        elif self.end or self.n == len(self.buf):
            self._settle(ValueError("response without Content-Length, or larger than expected"))
            self.transport.close()

    def _settle(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None) if exc is None else self.done.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._settle(ConnectionError(f"connection lost: {exc}"))

    async def get(self, path: str) -> memoryview:
        self.n = self.end = 0
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await asyncio.wait_for(self.done, 300)
        self.closed |= self.headers.get("connection", "").lower() == "close"
        return memoryview(self.buf)[self.body_at : self.end]


async def _drive(job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    loop, expect = asyncio.get_running_loop(), job["expect"]
    capacity = max(size for size, _ in expect.values()) + (1 << 16)
    conns: list[_Conn | None] = [None] * job["clients"]
    out: dict[str, Any] = {"lat": [], "bytes": 0, "errors": [], "status": Counter()}

    async def client(i: int, todo: Any, timed: bool, deadline: float | None) -> None:
        rng, n = random.Random(job["seed"] * 1000 + i), 0
        while deadline is None or time.perf_counter() < deadline:
            key = rng.choice(job["keys"]) if deadline is not None else next(todo, None)
            if key is None:
                return
            t, conn = time.perf_counter(), conns[i]
            try:
                if conn is None or conn.closed:
                    _, conn = await loop.create_connection(lambda: _Conn(capacity), *job["addr"])
                    conns[i] = conn
                body = await conn.get(f"/{key}")
            except (OSError, ValueError, asyncio.TimeoutError) as exc:
                out["errors"].append(f"{key}: {exc!r}")
                conns[i] = None
                continue
            dt, (size, digest) = time.perf_counter() - t, expect[key]
            check = deadline is None or n % job["check_every"] == 0  # all of each single pass
            if conn.status != 200 or len(body) != size:
                out["errors"].append(f"{key}: HTTP {conn.status}, {len(body)} bytes")
            elif check and hashlib.sha256(body).hexdigest() != digest:
                out["errors"].append(f"{key}: wrong sha256")
            n += 1
            if timed:
                out["lat"].append(dt)
                out["bytes"] += len(body)
                out["status"][conn.headers.get("x-cache-status", "-")] += 1

    async def clients(todo: Any, timed: bool, deadline: float | None = None) -> None:
        await asyncio.gather(*(client(i, todo, timed, deadline) for i in range(len(conns))))

    if job["mode"] == "hit":
        await clients(iter(job["share"]), timed=False)  # warm-up: every body's sha256 checked
    barrier.wait()
    cpu, t0 = sum(os.times()[:2]), time.perf_counter()
    if job["mode"] == "miss":
        await clients(iter(job["share"]), timed=True)
    else:
        await clients(None, timed=True, deadline=t0 + job["duration"])
    out["elapsed"], out["cpu"] = time.perf_counter() - t0, sum(os.times()[:2]) - cpu
    for conn in conns:
        if conn is not None and conn.transport is not None:
            conn.transport.close()
    return out


def _worker(out: Any, job: dict[str, Any], barrier: Any) -> None:
    try:
        out.put(asyncio.run(_drive(job, barrier)))
    except BaseException:
        barrier.abort()  # the parent stops waiting at the barrier
        raise


def _phase(
    port: int, mode: str, keys: list[str], expect: dict[str, Any], pid: int, args: Any
) -> dict[str, Any]:
    ctx, n = mp.get_context("spawn"), args.client_procs
    results, barrier = ctx.Queue(), ctx.Barrier(n + 1)
    job = {"addr": ("127.0.0.1", port), "mode": mode, "keys": keys, "expect": expect}
    job |= {"duration": args.duration, "check_every": args.check_every}
    jobs = [{**job, "share": keys[i::n], "seed": i, "clients": args.clients // n} for i in range(n)]
    jobs[0]["clients"] += args.clients % n
    procs = [ctx.Process(target=_worker, args=(results, j, barrier), daemon=True) for j in jobs]
    try:
        for p in procs:
            p.start()
        barrier.wait(timeout=600)  # the warm-up passes are done: the timed part starts
        cpu0, parts = _cpu(pid), []
        while len(parts) < n:
            try:
                parts.append(results.get(timeout=1))
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    raise RuntimeError("a load generator process failed (see above)") from None
        cpu1 = _cpu(pid)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    errors = [e for p in parts for e in p["errors"]]
    if errors:
        raise RuntimeError(f"port {port} {mode}: {len(errors)} bad responses, e.g. {errors[:3]}")
    lat = sorted(x for p in parts for x in p["lat"])
    elapsed = max(p["elapsed"] for p in parts)
    client = 100 * sum(p["cpu"] for p in parts) / elapsed
    srv = user = host = other = None
    if cpu0 is not None and cpu1 is not None:  # other: moto, the kernel's network work, others'
        user, srv = cpu1[0] - cpu0[0], cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]
        host = 100 * (cpu1[2] - cpu0[2]) / (cpu1[3] - cpu0[3])
        other = host * (os.cpu_count() or 1) - 100 * srv / elapsed - client
    return {
        "requests": len(lat),
        "seconds": elapsed,
        "req_s": len(lat) / elapsed,
        "mb_s": sum(p["bytes"] for p in parts) / 1e6 / elapsed,
        "p50_ms": lat[int(0.50 * (len(lat) - 1))] * 1e3,
        "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3,
        "max_ms": lat[-1] * 1e3,
        "server_cpu_ms_per_req": None if srv is None else srv / len(lat) * 1e3,
        # the server's own code (user) and the kernel's work on its behalf (system):
        # sending, receiving, files, and the loopback delivery its sends trigger
        "server_user_ms_per_req": None if user is None else user / len(lat) * 1e3,
        "server_system_ms_per_req": None if user is None else (srv - user) / len(lat) * 1e3,
        "server_cpu_pct": None if srv is None else 100 * srv / elapsed,
        "client_cpu_pct": client,
        "other_cpu_pct": other,
        "host_busy_pct": host,
        "x_cache_status": dict(sum((Counter(p["status"]) for p in parts), Counter())),
    }


# ---- the servers ------------------------------------------------------------------------


def _nginx_conf(d: Path, nginx: str, workers: str, port: int, origin: int, pinned: bool) -> str:
    built = subprocess.run([nginx, "-V"], capture_output=True, text=True).stderr
    modules = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    paths = [f"  {m}_temp_path {d}/tmp/{m};\n" for m in modules if f"-http_{m}_module" not in built]
    user = "user root root;\n" if os.geteuid() == 0 else ""  # else root's workers run as nobody
    conf = {"d": d, "workers": workers, "port": port, "origin": origin, "bucket": BUCKET}
    # each server's workers placed the same way: the edge's --cpu-affinity auto is nginx's
    affinity = "worker_cpu_affinity auto;\n" if pinned else ""
    return NGINX_CONF.format(user=user, affinity=affinity, temp_paths="".join(paths), **conf)


def _bench_server(
    name: str, work: Path, origin: int, keys: list[str], expect: dict[str, Any], args: Any
) -> dict[str, Any]:
    d, port = work / name.replace(" ", "-"), _free_port()
    (d / "tmp").mkdir(parents=True)
    url, edge = f"http://127.0.0.1:{port}", name.startswith("kvcdn-edge")
    workers = name.rpartition(" x")[2]  # "kvcdn-edge x2", "nginx x2"
    if edge:
        cmd = [sys.executable, "-m", "kvcdn.cli.main", "edge", "serve", "--origin"]
        cmd += f"s3://{BUCKET} --endpoint-url http://127.0.0.1:{origin} --max-bytes 64G".split()
        cmd += ["--cache-dir", str(d / "cache"), "--listen", f"127.0.0.1:{port}"]
        cmd += ["--workers", workers, "--cpu-affinity", args.cpu_affinity]
    else:
        (d / "nginx.conf").write_text(_nginx_conf(d, args.nginx, workers, port, origin,
                                                  args.cpu_affinity == "auto"))  # fmt: skip
        cmd = [args.nginx, "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")]
        cmd += ["-g", "daemon off;"]
    # The last server's cache files go to the disk now, not during this one's phases:
    # writeback is kernel work on the same 2 CPUs, charged to neither server.
    synced = time.perf_counter()
    os.sync()
    synced = time.perf_counter() - synced
    proc = _start(cmd, d / "server.log", f"{url}/healthz")
    if edge and workers != "1":  # every worker listening: each writes its counters at start
        deadline = time.monotonic() + 60
        while len(list((d / "cache" / "workers").glob("*.json"))) < int(workers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not all workers started")
            time.sleep(0.1)
    # /metrics sums the workers' counters, each worker's written every second
    settle = 1.2 if edge and workers != "1" else 0.0
    counters: list[dict[str, float]] = []
    phases: dict[str, dict[str, Any]] = {}
    try:
        for mode in ("miss", "hit"):
            time.sleep(settle)
            counters += [_counters(url)] if edge else []
            phases[mode] = _phase(port, mode, keys, expect, proc.pid, args)
        time.sleep(settle)
        counters += [_counters(url)] if edge else []
    finally:
        _stop(proc)
    miss, hit = phases["miss"], phases["hit"]
    if edge:  # the hit phase's counts include its untimed warm-up pass over every object
        on_miss, on_hit = (
            {k: b[k] - a[k] for k in a} for a, b in zip(counters, counters[1:], strict=False)
        )
        check = {"miss_phase": on_miss, "hit_phase": on_hit}
        ok = on_miss.get("kvcdn_edge_misses_total") == len(keys)
        ok &= on_hit.get("kvcdn_edge_misses_total") == 0
        ok &= on_hit.get("kvcdn_edge_hits_total") == hit["requests"] + len(keys)
    else:
        check = {"miss_phase": miss["x_cache_status"], "hit_phase": hit["x_cache_status"]}
        ok = miss["x_cache_status"] == {"MISS": len(keys)} and set(hit["x_cache_status"]) == {"HIT"}
    if not ok:
        print(f"WARNING: {name} did not serve all misses, then all hits: {check}", file=sys.stderr)
    return {"miss": miss, "hit": hit, "sync_s_before": synced,
            "check": {**check, "all_misses_then_all_hits": ok}}


def _returns_free_memory() -> bool:
    """Whether a virtio balloon on this VM reports free pages to its host
    (VIRTIO_BALLOON_F_REPORTING, feature bit 5), which then takes them back."""
    for features in Path("/sys/bus/virtio/drivers/virtio_balloon").glob("virtio*/features"):
        bits = features.read_text().strip()
        if len(bits) > 5 and bits[5] == "1":
            return True
    return False


def _make_objects(n: int, size: int) -> dict[str, bytes]:
    from kvcdn.codec import FIXED_LEVELS
    from kvcdn.container import ChunkHeader, pack
    from kvcdn.keys import object_key

    level = FIXED_LEVELS["fp16"]
    objects = {}
    for i in range(n):
        h = hashlib.sha256(f"kvcdn-edge-bench-{i}".encode()).hexdigest()
        header = ChunkHeader("fp16", "fp16", {}, (1, 2, 8, 256, 128), h)  # 1 MiB of fp16 KV
        payload = os.urandom(size - len(pack(header, b"")))
        data = pack(header, payload)
        objects[object_key(h, level.id, hashlib.sha256(data).hexdigest())] = data
    return objects


def _round_order(servers: list[str], r: int) -> list[str]:
    """The servers in round ``r``'s order: each worker count's pair (kvcdn, nginx) in
    turn, kvcdn first in even rounds and nginx first in odd ones. A server that runs
    first meets what came before it (the last round's writeback, the inodes an earlier
    run freed, which ext4 without a journal skips for a while when it allocates); with
    one order always, that fell on kvcdn in every round."""
    pairs = [servers[i : i + 2] for i in range(0, len(servers), 2)]
    return [name for pair in pairs for name in (pair if r % 2 == 0 else pair[::-1])]


def _median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's rounds as one result: each phase's figures the median over the rounds
    (the first round's cache statuses), every round kept under ``rounds``."""
    out: dict[str, Any] = {"rounds": rounds}
    for phase in ("miss", "hit"):
        runs = [r[phase] for r in rounds]
        out[phase] = {
            k: statistics.median(r[k] for r in runs)
            if all(isinstance(r[k], (int, float)) for r in runs) else runs[0][k]
            for k in runs[0]
        }  # fmt: skip
    ok = all(r["check"]["all_misses_then_all_hits"] for r in rounds)
    out["check"] = {"all_misses_then_all_hits": ok, "rounds": [r["check"] for r in rounds]}
    return out


def _report(results: dict[str, Any], args: Any, notes: list[str]) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(110, shutil.get_terminal_size().columns))
    table = Table(title=f"edge caches: {args.size / 2**20:g} MiB objects, {args.clients} clients")
    cols = ("server,phase,req/s,MB/s,p50 ms,p99 ms,srv CPU ms/req,of it user,of it system,"
            "srv CPU %,client CPU %,other CPU %")
    for col in cols.split(","):
        table.add_column(col, justify="left" if col in ("server", "phase") else "right")
    fields = "req_s mb_s p50_ms p99_ms server_cpu_ms_per_req server_user_ms_per_req"
    fields += " server_system_ms_per_req server_cpu_pct client_cpu_pct other_cpu_pct"
    for phase, (name, res) in ((p, item) for p in ("hit", "miss") for item in results.items()):
        values = zip([res[phase][f] for f in fields.split()], "0011222000", strict=True)
        table.add_row(name, phase, *("-" if v is None else f"{v:.{d}f}" for v, d in values))
    console.print(table)
    out: dict[str, Any] = {"ratios_kvcdn_over_nginx": {}, "targets": {}, "notes": notes}
    pairs = [(f"kvcdn-edge x{w}", f"nginx x{w}", w) for w in args.workers]
    if args.no_nginx:
        notes.append("nginx was skipped (--no-nginx): no comparison, no targets.")
        pairs = []
    ratios = Table(title="kvcdn-edge / nginx, the same number of worker processes")
    for col in ("workers", "phase", "req/s", "MB/s", "p50", "p99", "srv CPU/req", "user",
                "system"):
        ratios.add_column(col, justify="left" if col in ("workers", "phase") else "right")
    for edge_name, nginx_name, w in pairs:
        by_phase = out["ratios_kvcdn_over_nginx"][f"x{w}"] = {}
        for phase in ("hit", "miss"):
            k, n = results[edge_name][phase], results[nginx_name][phase]
            metrics = fields.split()[:7]
            r = by_phase[phase] = {m: k[m] / n[m] if k[m] and n[m] else None for m in metrics}
            ratios.add_row(str(w), phase, *("-" if v is None else f"{v:.2f}x" for v in r.values()))
            r["req_s_by_round"] = [
                a[phase]["req_s"] / b[phase]["req_s"]
                for a, b in zip(results[edge_name]["rounds"], results[nginx_name]["rounds"],
                                strict=True)
            ]  # fmt: skip
        hit, miss = by_phase["hit"], by_phase["miss"]
        t = out["targets"][f"x{w}"] = {
            "hit_throughput_ratio": hit["req_s"],
            "hit_throughput_met": hit["req_s"] >= 1.0,
            "miss_throughput_ratio": miss["req_s"],
            "miss_throughput_met": miss["req_s"] >= 0.8,
        }
    if pairs:
        console.print(ratios)
        for w, t in out["targets"].items():
            for key, rule in (("hit_throughput", ">= 1x"), ("miss_throughput", ">= 0.8x")):
                met = "[green]met[/]" if t[f"{key}_met"] else "[red]NOT met[/]"
                each = out["ratios_kvcdn_over_nginx"][w][key.split("_")[0]]["req_s_by_round"]
                spread = (f" (rounds: {', '.join(f'{x:.2f}x' for x in each)})"
                          if len(each) > 1 else "")  # fmt: skip
                console.print(f"target ({w[1:]} worker(s)): kvcdn {key.replace('_', ' ')} {rule} "
                              f"nginx's: {t[key + '_ratio']:.2f}x{spread}, {met}")  # fmt: skip
        rows = [results[n]["hit"] for _, n, _ in pairs]
        best = max(rows, key=lambda r: r["req_s"])
        notes.append(
            f"client check: nginx hits reach {best['req_s']:.0f} req/s at best, so the client "
            "drives at least that: slower rows are not client-bound. At nginx's rate the "
            f"host's CPUs are {best['host_busy_pct'] or 0:.0f}% busy (client, server and origin "
            "share them): its hit rows show this machine's limit more than nginx's; CPU "
            "ms/req compares the servers themselves."
        )
    for note in notes:
        console.print(f"note: {note}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=256, help="distinct objects")
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes per object")
    parser.add_argument("--clients", type=int, default=32, help="concurrent connections")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of the hit phase")
    parser.add_argument("--client-procs", type=int, default=2, help="load generator processes")
    parser.add_argument("--check-every", type=int, default=16, help="sha256 of 1 in N responses")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "edge.json")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every server this many times, interleaved; medians")
    parser.add_argument("--no-nginx", "--skip-nginx", action="store_true", help="kvcdn only")
    parser.add_argument("--workers", default="1,2",
                        help="worker processes of each server, comma-separated (1,2)")
    parser.add_argument("--cpu-affinity", choices=("auto", "off"), default="auto",
                        help="each server's workers on cores of their own (the edge's "
                        "--cpu-affinity auto, nginx's worker_cpu_affinity auto), or off: "
                        "placed by the kernel")  # fmt: skip
    parser.add_argument("--no-nginx-auto", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
        if any(w < 1 for w in args.workers):
            raise ValueError
    except ValueError:
        parser.error(f"--workers takes worker counts like 1,2, not {args.workers!r}")
    if args.rounds < 1:
        parser.error(f"--rounds takes a count of at least 1, not {args.rounds}")
    args.nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not args.no_nginx and not os.access(args.nginx, os.X_OK):
        print(INSTALL, file=sys.stderr)
        return 2
    servers = [f"{s} x{w}" for w in args.workers for s in ("kvcdn-edge", "nginx")]
    servers = [s for s in servers if not (args.no_nginx and s.startswith("nginx"))]
    for var, value in [("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")]:
        os.environ.setdefault(var, value)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally blocks run

    import boto3

    notes = [
        "MB = 10^6 bytes. Latency: request written to last body byte. CPU %: of one core; other "
        f"CPU: the rest of the {os.cpu_count()} CPUs' busy time (moto, kernel, other processes).",
        f"client: {args.client_procs} processes, {args.clients} keep-alive connections in all, "
        "on the same CPUs as the server and the origin (moto).",
    ]
    free_page_reporting = _returns_free_memory()
    if free_page_reporting:
        notes.append(
            "this VM returns freed memory to its host (virtio-balloon free page reporting): "
            "a page-cache page a miss writes costs a host fault on its first write, and "
            "miss rates move by half between rounds with how much memory the host has "
            "taken back (docs/edge.md)."
        )
    before, _, after = _cpu(), time.sleep(1.0), _cpu()
    idle_busy = 100 * (after[2] - before[2]) / (after[3] - before[3]) if before and after else None
    if idle_busy and idle_busy > 15:
        notes.append(f"other processes kept the CPUs {idle_busy:.0f}% busy before the run.")
        print(f"WARNING: {notes[-1]} Timings will be noisy.", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="kvcdn-bench-edge-"))
    moto = None
    results: dict[str, Any] = {}
    try:
        port = _free_port()
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        moto = _start(cmd, work / "moto.log", f"http://127.0.0.1:{port}/moto-api/")
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
        s3.create_bucket(Bucket=BUCKET)
        print(f"uploading {args.objects} objects to moto ...")
        expect = {}
        for key, data in _make_objects(args.objects, args.size).items():
            s3.put_object(Bucket=BUCKET, Key=key, Body=data, ACL="public-read")  # nginx: unsigned
            expect[key] = (len(data), hashlib.sha256(data).hexdigest())
        keys = sorted(expect, key=lambda _: random.random())
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for r in range(args.rounds):
            for name in _round_order(servers, r):
                what = f"{name}" + (f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else "")
                print(f"{what}: {args.objects} cold misses, then {args.duration:g} s of hits ...")
                runs[name].append(_bench_server(name, work / f"round{r}", port, keys, expect, args))
        results = {name: _median_of(rounds) for name, rounds in runs.items()}
    finally:
        if moto is not None:
            _stop(moto)
        shutil.rmtree(work, ignore_errors=True)
    report = _report(results, args, notes)
    nginx = None if args.no_nginx else subprocess.run([args.nginx, "-v"], capture_output=True)
    setup = {k: getattr(args, k) for k in ("objects", "size", "clients", "client_procs", "workers",
                                           "rounds", "cpu_affinity")}  # fmt: skip
    setup |= {"free_page_reporting": free_page_reporting}
    setup |= {"hit_seconds": args.duration, "sha256_check_every": args.check_every}
    setup |= {"client": "asyncio HTTP/1.1, keep-alive, reads into a preallocated buffer"}
    setup |= {"origin": "moto S3 server, a subprocess on 127.0.0.1", "cpus": os.cpu_count()}
    setup |= {"host_busy_pct_before": idle_busy, "platform": platform.platform()}
    setup |= {"python": sys.version.split()[0], "nginx": nginx and nginx.stderr.decode().strip()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "edge", "setup": setup, "results": results, **report}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the servers are stopped by then
        sys.exit(130)
