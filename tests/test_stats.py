"""``sdk.Client.stats``: what a client's lookups and loads did, counted from real loads of
a real publication (the embedded model, a folder store), exported through
prometheus_client's own exposition format."""

from __future__ import annotations

import shutil

import pytest

from kvcdn import sdk
from kvcdn.catalog import read_manifest
from kvcdn.errors import NotFound
from kvcdn.publish import publish
from kvcdn.sdk.stats import METRICS, ReaderStats
from kvcdn.store import open_store

LEVEL = "int8"


@pytest.fixture(scope="module")
def published(tmp_path_factory, model, short_text):
    root = tmp_path_factory.mktemp("stats-store")
    result = publish(text=short_text, name="intro", model=model, store=str(root), levels=LEVEL)
    return root, read_manifest(open_store(str(root)), result.name, result.version)


def test_a_client_counts_its_lookups_bytes_chunks_and_tokens(published, model) -> None:
    root, manifest = published
    size = sum(c.objects[LEVEL].bytes for c in manifest.chunks)
    chunks = len(manifest.chunks)
    with sdk.Client(store=str(root), warm=False) as client:
        client.load_context("intro", model=model, quality=LEVEL)
        client.load_context("intro", model=model, quality=LEVEL)
        with pytest.raises(NotFound):
            client.load_context("no-such-document", model=model)
        stats = client.stats
        assert stats.value("kvcdn_lookups", result="hit") == 2
        assert stats.value("kvcdn_lookups", result="miss") == 1
        # a folder store read without edges is the "store" source; every byte counted
        assert stats.value("kvcdn_read_bytes", source="store", level=LEVEL) == 2 * size
        assert stats.value("kvcdn_read_bytes") == 2 * size
        assert stats.value("kvcdn_chunks", level=LEVEL) == 2 * chunks
        assert stats.value("kvcdn_loaded_tokens") == 2 * manifest.token_count
        assert stats.value("kvcdn_recomputed_chunks") == 0
        snap = stats.snapshot()
        (loads,) = snap["kvcdn_load_seconds"]
        assert loads["count"] == 2 and loads["buckets"][-1] == 2 and loads["sum"] > 0
        assert snap["kvcdn_lookup_seconds"][0]["count"] == 3
        # a client made by with_options adds to the same figures
        other = client.with_options(store=str(root))
        other.load_context("intro", model=model, quality=LEVEL)
        assert stats.value("kvcdn_chunks", level=LEVEL) == 3 * chunks


def test_a_chunk_recomputed_because_its_object_is_damaged_says_so(published, model,
                                                                 tmp_path) -> None:  # fmt: skip
    root, manifest = published
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    damaged = copy / manifest.chunks[1].objects[LEVEL].key
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with sdk.Client(store=str(copy), warm=False) as client:
        ctx = client.load_context("intro", model=model)  # auto: recomputes what it cannot load
        assert ctx.plan.chunks[1].level == "text"
        assert ctx.plan.chunks[1].recompute_reason == "corrupt"
        assert client.stats.value("kvcdn_recomputed_chunks", reason="corrupt") == 1
        assert client.stats.value("kvcdn_chunks") == len(manifest.chunks) - 1
        assert client.stats.value("kvcdn_read_bytes") >= sum(
            c.objects[LEVEL].bytes for i, c in enumerate(manifest.chunks) if i != 1
        )


def test_stats_export_in_prometheus_exposition_format(published, model) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    root, manifest = published
    with sdk.Client(store=str(root), warm=False) as client:
        client.load_context("intro", model=model, quality=LEVEL)
        registry = prometheus_client.CollectorRegistry()
        registry.register(client.stats)
        text = prometheus_client.generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == set(METRICS)
    read = [s for s in families["kvcdn_read_bytes"].samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in read] == [
        ({"source": "store", "level": LEVEL},
         float(sum(c.objects[LEVEL].bytes for c in manifest.chunks)))
    ]  # fmt: skip
    count = [s for s in families["kvcdn_load_seconds"].samples if s.name.endswith("_count")]
    assert count[0].value == 1


def test_labels_stay_bounded_and_unknown_series_are_refused() -> None:
    stats = ReaderStats(["http://127.0.0.1:9000/"])
    assert stats.source("http://127.0.0.1:9000") == "http://127.0.0.1:9000"  # as configured
    assert stats.source("origin") == "origin"
    assert stats.source("s3://bucket/secret-prefix") == "store"  # never a store's URL
    with pytest.raises(ValueError):
        stats.inc("kvcdn_read_bytes", 5, source="store")  # a label missing
    with pytest.raises(ValueError):
        stats.inc("kvcdn_documents", 1)  # no such metric
    with pytest.raises(ValueError):
        stats.observe("kvcdn_lookups", 1.0, result="hit", reason="")  # a counter
    stats.inc("kvcdn_claimed_tokens", 0)  # nothing to count: no series
    assert stats.snapshot() == {}
    assert stats.drain() == {"counters": [], "observations": []}  # not kept: not asked for
