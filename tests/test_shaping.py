"""Shaped edges: a fixed rate limit and replayed throughput traces, on real loopback transfers."""

from __future__ import annotations

import json
import time

import pytest

from kvcdn.edge.shaping import Trace, TraceError, seconds_to_send
from tests.edge_helpers import EdgeProcess, MotoOrigin, chunk_object, get, post_json


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


def test_the_trace_can_be_restarted_at_an_offset(one_object, tmp_path):
    """``POST /shaping`` replays the trace from an offset, on an idle link (admin token)."""
    origin, key, data = one_object
    # 1 MB/s for 10 s, then 8 MB/s: where the replay starts decides the transfer time
    trace = write_trace(tmp_path / "t.log", [(0, 8), (10, 64), (100, 64)])
    token = tmp_path / "admin"
    token.write_text("s3cret\n")
    node = EdgeProcess(
        origin.url, tmp_path / "c", origin.endpoint,
        "--throttle-trace", trace, "--admin-token-file", str(token),
    ).start()  # fmt: skip
    plain = EdgeProcess(origin.url, tmp_path / "p", origin.endpoint).start()
    admin = {"Authorization": "Bearer s3cret"}
    try:
        assert post_json(f"{node.url}/shaping", {"offset_s": 10})[0] == 401
        assert post_json(f"{node.url}/shaping", {"offset": 1}, admin)[0] == 400
        assert post_json(f"{node.url}/shaping", {"offset_s": -1}, admin)[0] == 400
        assert post_json(f"{plain.url}/shaping", {"offset_s": 1})[0] == 404  # not shaped
        _timed_get(f"{node.url}/{key}")
        node.wait_cached(1)

        status, body = post_json(f"{node.url}/shaping", {"offset_s": 10}, admin)
        assert status == 200 and 10 <= body["trace_time_s"] < 10.5
        fast, _ = _timed_get(f"{node.url}/{key}")
        status, body = post_json(f"{node.url}/shaping", {"offset_s": 0}, admin)
        assert status == 200 and body["trace_time_s"] < 0.5
        slow, got = _timed_get(f"{node.url}/{key}")
        assert got == data
        assert len(data) / 1e6 * 0.9 <= slow  # 1 MB/s
        assert fast <= len(data) / 8e6 * 3 < slow  # 8 MB/s
        status, _, clock = get(f"{node.url}/shaping", admin)
        assert status == 200 and json.loads(clock)["trace_time_s"] >= slow
    finally:
        node.kill()
        plain.kill()
