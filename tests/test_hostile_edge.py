"""A hostile edge (a real process that lies) in front of a real store and a real honest edge.

Each attack is placed where the SDK looks first (rendezvous order), so the
SDK must notice it, skip that edge, report it, and still load exactly what
was published: forged objects, a swapped manifest, an oversized or endless
body, a body that drips.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import torch
from click.testing import CliRunner

from kvcdn import sdk
from kvcdn.cli.main import cli
from kvcdn.errors import TrustError
from kvcdn.publish import publish
from kvcdn.sdk.edges import EdgeStore, rendezvous
from kvcdn.signing import SigningKey, TrustPolicy
from kvcdn.store import open_store
from tests.conftest import free_port
from tests.edge_helpers import EdgeProcess

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


class Hostile:
    def __init__(self, store, port: int, mode: str, donor: str | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        args = [sys.executable, "-m", "tests.hostile_edge", "--store", str(store)]
        args += ["--port", str(port), "--mode", mode, *(["--donor", donor] if donor else [])]
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
