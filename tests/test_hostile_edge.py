"""A hostile edge (a real process that lies) in front of a real store and a real honest edge.

Each attack is placed where the SDK looks first (rendezvous order), so the
SDK must notice it, skip that edge, report it, and still load exactly what
was published: forged objects, a swapped manifest, an oversized or endless
body, a body that drips.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from kvcdn import sdk
from kvcdn.cli.main import cli
from kvcdn.errors import DeadlineExceeded, TrustError
from kvcdn.publish import publish
from kvcdn.sdk.edges import EdgeStore, rendezvous
from kvcdn.signing import SigningKey, TrustPolicy
from kvcdn.store import open_store
from tests.conftest import free_port
from tests.edge_helpers import EdgeProcess, Hostile

LEVEL = "int8"


@pytest.fixture(scope="module")
def signed(model, sed_text, tmp_path_factory):
    """Two signed documents in a real store folder, and the key that signed them."""
    root = tmp_path_factory.mktemp("hostile") / "store"
    key = SigningKey.generate("publisher")
    store = open_store(str(root))
    victim = publish(
        text=sed_text[:3000], name="victim", model=model, store=store, levels=LEVEL,
        sign_keys=[key],
    )  # fmt: skip
    publish(
        text=sed_text[3000:6000], name="donor", model=model, store=store, levels=LEVEL,
        sign_keys=[key],
    )  # fmt: skip
    reference = sdk.load_context("victim", model=model, store=store, quality=LEVEL)
    return root, key, victim, reference


def _ports(placement: str) -> tuple[int, int]:
    """Two free ports, the first of which the SDK will ask first for ``placement``."""
    while True:
        bad, good = free_port(), free_port()
        urls = [f"http://127.0.0.1:{p}" for p in (bad, good)]
        if bad != good and rendezvous(urls, placement)[0] == urls[0]:
            return bad, good


def _same_kv(ctx, reference) -> bool:
    return all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(ctx.cache.layers, reference.cache.layers, strict=True)
    )


@pytest.fixture
def chain_hash(signed, model):
    root, *_ = signed
    return sdk.load_context(
        "victim", model=model, store=str(root), quality=LEVEL
    ).manifest.chain_hash


def _edges(signed, placement, mode, tmp_path, donor=None):
    root = signed[0]
    bad, good = _ports(placement)
    hostile = Hostile(root, bad, mode, donor)
    honest = EdgeProcess(str(root), tmp_path / "cache", None, port=good).start()
    return hostile, honest


def test_forged_objects_are_skipped_reported_and_replaced(signed, model, chain_hash, tmp_path):
    root, key, _, reference = signed
    hostile, honest = _edges(signed, chain_hash, "forge-object", tmp_path)
    try:
        for trust in (TrustPolicy([key.public]), None):  # objects are checked either way
            ctx = sdk.load_context(
                "victim", model=model, edges=[hostile.url, honest.url], store=str(root),
                quality=LEVEL, trust=trust,
            )  # fmt: skip
            assert _same_kv(ctx, reference)
            assert set(ctx.plan.chunk_sources) <= {honest.url, "origin"}
            assert ctx.plan.rejected and all(hostile.url in r for r in ctx.plan.rejected)
            assert "does not match the size and sha256" in ctx.plan.rejected[0]
    finally:
        hostile.stop()
        honest.kill()


def test_a_swapped_manifest_from_an_edge_is_never_loaded(signed, model, tmp_path):
    root, key, _, reference = signed
    hostile, honest = _edges(signed, "victim", "swap-manifest", tmp_path, donor="donor")
    try:
        edges = [hostile.url, honest.url]
        # A trusting reader refuses the unsigned forgery and takes the honest edge's copy.
        ctx = sdk.load_context(
            "victim@1", model=model, edges=edges, quality=LEVEL, trust=TrustPolicy([key.public])
        )
        assert _same_kv(ctx, reference)
        assert any("not signed" in r and hostile.url in r for r in ctx.plan.rejected)
        # A reader without trust keys reads manifests from the origin when it has one,
        # so the edge never gets to choose the objects.
        ctx = sdk.load_context("victim@1", model=model, edges=edges, store=str(root), quality=LEVEL)
        assert _same_kv(ctx, reference) and ctx.manifest.name == "victim"
        # Only the hostile edge, and trust: refused, nothing loaded.
        with pytest.raises(TrustError):
            sdk.load_context(
                "victim@1", model=model, edges=[hostile.url], quality=LEVEL,
                trust=TrustPolicy([key.public]),
            )  # fmt: skip
        trust_file = tmp_path / "trusted.pub"
        trust_file.write_text(f"{key.public.text} publisher\n")
        args = ["ask", "victim@1", "Why?", "--edge", hostile.url, "--trust", str(trust_file)]
        env = {"XDG_STATE_HOME": str(tmp_path / "state"), "KVCDN_STORE": ""}  # edge only
        result = CliRunner().invoke(cli, args, env=env)
        assert result.exit_code == 6  # one line, the documented code
        assert result.output.startswith("error: every edge served bad bytes")
        assert len(result.output.strip().splitlines()) == 1
    finally:
        hostile.stop()
        honest.kill()


@pytest.mark.parametrize("mode", ["oversized", "endless"])
def test_bodies_larger_than_declared_are_cut_off(signed, model, chain_hash, tmp_path, mode):
    root, key, victim, reference = signed
    hostile, honest = _edges(signed, chain_hash, mode, tmp_path)
    try:
        started = time.monotonic()
        ctx = sdk.load_context(
            "victim", model=model, edges=[hostile.url, honest.url], quality=LEVEL,
            trust=TrustPolicy([key.public]),
        )  # fmt: skip
        assert _same_kv(ctx, reference)
        assert time.monotonic() - started < 30
        expected = "announced 100000000000 bytes" if mode == "oversized" else "more than the"
        assert ctx.plan.rejected and expected in ctx.plan.rejected[0]
    finally:
        hostile.stop()
        honest.kill()


def test_a_dripping_body_is_abandoned_for_the_next_source(signed, model, chain_hash, tmp_path):
    root, key, _, reference = signed
    hostile, honest = _edges(signed, chain_hash, "drip", tmp_path)
    try:
        reader = EdgeStore(
            [hostile.url, honest.url], read_timeout_s=1.0, min_body_bps=1 << 20
        )  # budget: 1 s plus the object's size at 1 MiB/s
        started = time.monotonic()
        ctx = sdk.load_context(
            "victim", model=model, store=reader, quality=LEVEL, trust=TrustPolicy([key.public])
        )
        assert _same_kv(ctx, reference)
        assert time.monotonic() - started < 30
        assert any("slower than" in r for r in ctx.plan.rejected)
    finally:
        hostile.stop()
        honest.kill()


# ---- an edge that accepts connections and never answers ----------------------------


@pytest.fixture
def hanging(signed):
    edge = Hostile(signed[0], mode="hang")
    yield edge
    edge.stop()


def test_a_deadline_holds_against_an_edge_that_never_answers(signed, model, hanging, tmp_path):
    """With only such an edge, a load gives up at its deadline (the clock starts at the
    call), saying why; it waited out a 30 s read timeout before."""
    started = time.perf_counter()
    with pytest.raises(DeadlineExceeded, match="did not answer in time"):
        sdk.load_context("victim", model=model, edges=[hanging.url], deadline_s=2)
    assert time.perf_counter() - started < 2 + 1.0
    env = {k: v for k, v in os.environ.items() if k != "KVCDN_STORE"}  # edges only
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kvcdn.cli.main", "ask", "victim", "What is sed?",
         "--edge", hanging.url, "--deadline", "2"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    elapsed = time.perf_counter() - started  # Python, torch and the model load, then 2 s
    assert done.returncode == 4, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not answer in time" in lines[0], lines
    assert elapsed < 25


def test_the_store_serves_when_the_edge_in_front_of_it_hangs(signed, model, hanging):
    root, _, _, reference = signed
    started = time.perf_counter()
    ctx = sdk.load_context("victim", model=model, edges=[hanging.url], store=str(root),
                           deadline_s=4)  # fmt: skip
    # less measuring the device, if this is the session's first adaptive load: a one-off
    # that is off the load's clock, as loading the model is
    elapsed = time.perf_counter() - started - ctx.plan.seconds.get("measure_device", 0.0)
    assert elapsed < 4 + 3.0, ctx.plan.seconds
    assert set(ctx.plan.chunk_sources) <= {"origin", "text"}
    assert ctx.generate("What is sed?", max_new_tokens=1).token_ids == reference.generate(
        "What is sed?", max_new_tokens=1
    ).token_ids


def test_a_failing_edge_is_skipped_for_a_while_then_probed(signed, hanging, tmp_path):
    """The circuit breaker: after one read waits out the hanging edge, the next reads go
    to the next source at once; once the edge's time down is over, one read probes it."""
    import kvcdn.sdk.edges as edges_module
    from kvcdn.store import open_store

    root = signed[0]
    key = next(p for p in sorted((root / "objects").rglob("*.kvc"))).relative_to(root).as_posix()
    reader = EdgeStore([hanging.url], open_store(str(root)), read_timeout_s=1.0)
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        got = reader.fetch(key)
        timings.append(time.perf_counter() - started)
        assert got.source == "origin"
    print("fetches through a hanging edge, then past it:", ", ".join(f"{t:.2f} s" for t in timings))
    assert timings[0] >= 1.0  # it waited for the edge once ...
    assert max(timings[1:]) < 0.5  # ... then went to the store at once
    with reader._lock:  # its time down is over: the next read probes it (and waits again)
        reader._down[hanging.url] = 0.0
    started = time.perf_counter()
    assert reader.fetch(key).source == "origin"
    assert time.perf_counter() - started >= 1.0
    assert reader._failures[hanging.url] == 2  # a second failure in a row: down longer
    assert reader._down[hanging.url] - time.monotonic() > edges_module.DOWN_S * 1.5


def test_an_edge_that_misses_a_reads_deadline_is_skipped_too(signed, hanging):
    """A read given up at its deadline (what an engine's budget does) counts as the edge's
    failure: the next reads do not wait for it again."""
    from kvcdn.sdk.bounded import BoundedReader
    from kvcdn.store import Cancel, open_store

    root = signed[0]
    key = next(p for p in sorted((root / "objects").rglob("*.kvc"))).relative_to(root).as_posix()
    reader = BoundedReader(EdgeStore([hanging.url], open_store(str(root))))
    started = time.perf_counter()
    with pytest.raises(DeadlineExceeded):
        reader.fetch(key, cancel=Cancel(deadline=time.monotonic() + 1.0))
    assert time.perf_counter() - started < 1.5
    time.sleep(0.3)  # the abandoned read's own timeout fires at the deadline too
    started = time.perf_counter()
    got = reader.fetch(key, cancel=Cancel(deadline=time.monotonic() + 1.0))
    assert got.source == "origin" and time.perf_counter() - started < 0.5


def test_a_probe_of_a_hanging_edge_costs_seconds_not_the_reads_budget(signed, hanging):
    """A half-open edge's probe waits at most ``PROBE_READ_TIMEOUT_S`` for an answer,
    then the same read goes to the store: an edge that still hangs costs a load two
    seconds, not its whole budget (a vLLM request's: its prefill's predicted time)."""
    import kvcdn.sdk.edges as edges_module
    from kvcdn.sdk.bounded import BoundedReader
    from kvcdn.store import Cancel, open_store

    root = signed[0]
    key = next(p for p in sorted((root / "objects").rglob("*.kvc"))).relative_to(root).as_posix()
    edge_reader = EdgeStore([hanging.url], open_store(str(root)))  # a 30 s read timeout
    reader = BoundedReader(edge_reader)
    with pytest.raises(DeadlineExceeded):  # the first read waits out its budget: down
        reader.fetch(key, cancel=Cancel(deadline=time.monotonic() + 1.0))
    time.sleep(0.3)
    with edge_reader._lock:  # its time down is over: the next read probes it
        edge_reader._down[hanging.url] = 0.0
    started = time.perf_counter()
    got = reader.fetch(key, cancel=Cancel(deadline=time.monotonic() + 20.0))
    took = time.perf_counter() - started
    print(f"a read that probed the hanging edge: {took:.2f} s")
    assert got.source == "origin"
    assert edges_module.PROBE_READ_TIMEOUT_S <= took < edges_module.PROBE_READ_TIMEOUT_S + 1.5
    assert edge_reader._failures[hanging.url] == 2  # down again, longer


def test_an_edge_that_answers_its_probe_with_another_status_is_probed_again(signed, tmp_path):
    """A probe answered 429 (or any status but a 200, 404, 401/403 or 5xx) used to keep
    the probe flag, and the edge was never tried again."""
    from kvcdn.store import open_store
    from tests.edge_helpers import Hostile

    root = signed[0]
    key = next(p for p in sorted((root / "objects").rglob("*.kvc"))).relative_to(root).as_posix()
    port = free_port()
    reader = EdgeStore([f"http://127.0.0.1:{port}"], open_store(str(root)), read_timeout_s=2.0)
    edge = reader.edges[0]
    assert reader.fetch(key).source == "origin"  # nothing listens: its circuit opens
    busy = Hostile(root, port, "busy-once")
    try:
        for expected in ("origin", edge):  # its time down over: probed (429, down), probed again
            with reader._lock:
                reader._down[edge] = 0.0
            assert reader.fetch(key).source == expected
        assert edge not in reader._probing and edge not in reader._failures
    finally:
        busy.stop()
