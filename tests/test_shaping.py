"""Shaped edges: a fixed rate limit and replayed throughput traces, on real loopback transfers."""

from __future__ import annotations

import time

import pytest

from kvcdn.edge.shaping import Trace, TraceError, seconds_to_send
from tests.edge_helpers import EdgeProcess, MotoOrigin, chunk_object, get


def write_trace(path, rows) -> str:
    path.write_text("".join(f"{t}\t{mbps}\n" for t, mbps in rows))
    return str(path)


def test_trace_parsing_scaling_and_wrapping(tmp_path):
    trace = Trace.load(write_trace(tmp_path / "t.log", [(0, 8), (5, 16), (10, 0)]), scale=10)
    assert trace.bytes_per_s == (10e6, 20e6, 0.0)  # Mbit/s -> bytes/s, times 10
    assert trace.period == 15.0
    assert trace.segment(6.0) == (20e6, pytest.approx(4.0))
    assert trace.segment(16.0) == (10e6, pytest.approx(4.0))  # wrapped around
    for bad in ("0 1\n", "0 1\n0 2\n", "0 x\n1 2\n", "0 -1\n1 2\n"):
        (tmp_path / "bad.log").write_text(bad)
        with pytest.raises(TraceError):
            Trace.load(tmp_path / "bad.log")


def test_sending_time_integrates_the_rate_across_segments(tmp_path):
    trace = Trace.load(write_trace(tmp_path / "t.log", [(0, 8), (1, 0), (2, 80)]))
    # 1 MB/s for 1 s, nothing for 1 s, then 10 MB/s
    assert seconds_to_send(trace.segment, 0.0, 500_000) == pytest.approx(0.5)
    assert seconds_to_send(trace.segment, 0.0, 2_000_000) == pytest.approx(2.1)
    assert seconds_to_send(trace.segment, 1.5, 1_000_000) == pytest.approx(2.1)


@pytest.fixture
def one_object(moto_endpoint):
    o = MotoOrigin(moto_endpoint, "kv")
    key, data = chunk_object(31)
    o.client.put_object(Bucket=o.bucket, Key=f"kv/{key}", Body=data)
    return o, key, data


def _timed_get(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    status, _, body = get(url)
    assert status == 200
    return time.perf_counter() - started, body


def test_a_rate_limited_edge_sends_at_its_rate(one_object, tmp_path):
    origin, key, data = one_object
    node = EdgeProcess(origin.url, tmp_path / "c", origin.endpoint, "--rate-limit", "4M").start()
    try:
        _timed_get(f"{node.url}/{key}")  # the miss
        node.wait_cached(1)
        seconds, body = _timed_get(f"{node.url}/{key}")  # a hit, from the file
        assert body == data
        expected = len(data) / (4 << 20)  # 0.25 s
        assert expected * 0.9 <= seconds <= expected * 3
    finally:
        node.kill()


def test_a_trace_driven_edge_follows_the_trace(one_object, tmp_path):
    origin, key, data = one_object
    trace = write_trace(tmp_path / "t.log", [(0, 16), (100, 16)])  # 2 MB/s, then x4 below
    node = EdgeProcess(
        origin.url, tmp_path / "c", origin.endpoint,
        "--throttle-trace", trace, "--throttle-scale", "4",
    ).start()  # fmt: skip
    try:
        _timed_get(f"{node.url}/{key}")
        node.wait_cached(1)
        seconds, body = _timed_get(f"{node.url}/{key}")
        assert body == data
        expected = len(data) / 8e6  # 16 Mbit/s x 4 = 8 MB/s: 0.13 s
        assert expected * 0.9 <= seconds <= expected * 3
    finally:
        node.kill()
