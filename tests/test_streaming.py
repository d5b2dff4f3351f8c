"""Adaptive loading end to end: the real model, a real publication, a real shaped edge.

The edge replays a throughput trace on its loopback link (``--throttle-trace``)
and is restarted at trace time 0 just before each load (``POST /shaping``), so
every load sees the bandwidth the test wrote down.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from kvcdn.catalog import read_manifest
from kvcdn.sdk import load_context
from kvcdn.sdk.edges import warm_keys
from kvcdn.sdk.planner import TEXT, HarmonicPredictor
from kvcdn.store import open_store
from tests.edge_helpers import EdgeProcess, post_json

LEVELS = "nearlossless,default,lowest"
QUESTION = "How do I edit a file in place?"


@pytest.fixture(scope="module")
def store(tmp_path_factory, model, sed_text):
    """The whole sed manual (12 chunks), published at three ladder levels to a folder."""
    from kvcdn.publish import publish

    root = tmp_path_factory.mktemp("store")
    publish(text=sed_text, name="sed-manual", model=model, store=str(root), levels=LEVELS)
    return root


@pytest.fixture(scope="module")
def reference(store, model):
    """The document loaded straight from the store at its best level, and full prefill."""
    ctx = load_context("sed-manual", model=model, store=str(store), quality="nearlossless")
    return ctx


def shaped_edge(store, tmp_path, rows: list[tuple[float, float]]) -> EdgeProcess:
    trace = tmp_path / "trace.log"
    trace.write_text("".join(f"{t}\t{mbps}\n" for t, mbps in rows))
    edge = EdgeProcess(str(store), tmp_path / "cache", None, "--throttle-trace", str(trace))
    edge.start()
    # fill the edge's cache first, so the loads measure the shaped link, not the origin
    manifest = read_manifest(open_store(str(store)), "sed-manual", None)
    keys, _ = warm_keys(manifest)
    status, _ = post_json(f"{edge.url}/warm", {"keys": keys})
    assert status in (200, 202)
    edge.wait_cached(len(keys), timeout_s=60)
    return edge


def load_once(edge: EdgeProcess, model, deadline_s=None, initial_bps=None):
    """One load through ``edge`` from trace time 0; the edge is stopped after it."""
    try:
        status, body = post_json(f"{edge.url}/shaping", {"offset_s": 0})
        assert status == 200 and body["trace_time_s"] < 0.5
        predictor = None if initial_bps is None else HarmonicPredictor(initial_bps=initial_bps)
        return load_context(
            "sed-manual", model=model, edges=[edge.url], deadline_s=deadline_s, predictor=predictor
        )
    finally:
        edge.kill(signal.SIGKILL)  # a stalled shaped response would hold a graceful stop


def mbps(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1e6


def test_without_a_deadline_every_chunk_comes_at_the_best_level(store, reference, model, tmp_path):
    edge = shaped_edge(store, tmp_path, [(0, mbps(200e6)), (1000, mbps(200e6))])
    ctx = load_once(edge, model)
    plan = ctx.plan
    assert plan.chunk_levels == ["nearlossless"] * 12
    assert set(plan.chunk_sources) == {edge.url}
    assert plan.feasible and plan.predicted_ttft_s is not None
    for chunk in plan.chunks:
        assert 0 <= chunk.start_s <= chunk.ready_s <= plan.ready_s
        assert chunk.bytes == ctx.manifest.chunks[chunk.index].objects["nearlossless"].bytes
    for a, b in zip(ctx.cache.layers, reference.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_rate_drop_mid_load_lowers_the_level_to_what_the_link_carries_by_the_deadline(
    store, model, tmp_path
):
    """The planner's choice, judged in the link's own terms (the trace), not by the wall
    clock of a machine that may be busy: the bytes it fetched fit what the shaped link
    delivers by the deadline after the drop, which the best level's would not.
    (Deadline attainment in seconds is measured by bench/abr.py.)"""
    # 16 MB/s for 0.4 s (about 4 of 12 chunks at the best level), then 4 MB/s:
    # the rest at the best level would take 3 s more, at the lowest 1.6 s.
    rows = [(0, 128), (0.4, 32), (1000, 32)]
    edge = shaped_edge(store, tmp_path, rows)
    deadline = 2.5
    ctx = load_once(edge, model, deadline_s=deadline, initial_bps=16e6)
    plan = ctx.plan
    quality = ctx.manifest.levels
    carried = 16e6 * 0.4 + 4e6 * (deadline - 0.4)  # bytes the trace delivers by then
    best = sum(c.objects["nearlossless"].bytes for c in ctx.manifest.chunks)
    assert best > carried  # the best level everywhere cannot make it
    assert all(lv in quality or lv == TEXT for lv in plan.chunk_levels)
    assert any(lv != TEXT for lv in plan.chunk_levels), plan.chunk_levels  # the link was used
    assert plan.replans > 1  # planned again as the link slowed (when a plan was next used)
    # Which chunks are recomputed and at which level each is fetched depends on the
    # device's speed too; what the link carries does not: a planner that kept its first
    # estimate (16 MB/s) would have fetched every chunk at the best level.
    assert plan.bytes <= carried, json.dumps([c.__dict__ for c in plan.chunks], indent=1)
    answer = ctx.generate(QUESTION, max_new_tokens=4)
    assert answer.token_ids  # a real answer from a complete cache


def test_when_the_link_stalls_fetches_are_cancelled_and_chunks_recomputed(store, model, tmp_path):
    # 16 MB/s for 0.25 s, then nothing at all: only recomputing can finish the load
    edge = shaped_edge(store, tmp_path, [(0, 128), (0.25, 0), (1000, 0)])
    ctx = load_once(edge, model, deadline_s=20.0, initial_bps=16e6)
    plan = ctx.plan
    assert plan.cancelled >= 1  # the fetches in flight when the link died were abandoned
    assert any(c.abandoned for c in plan.chunks)
    assert plan.chunk_levels.count(TEXT) >= 6
    # what came, came while the link was up: in the link's terms, not the wall clock's
    # (a busy machine may start the load's first fetch late in that quarter second)
    assert plan.bytes <= 16e6 * 0.25, json.dumps([c.__dict__ for c in plan.chunks], indent=1)
    for c in plan.chunks:
        assert c.source == (TEXT if c.level == TEXT else edge.url)
    # recomputed chunks attend to the decoded prefix: the answer matches full prefill's
    from kvcdn.sdk import answer_with_prefill

    answer = ctx.generate(QUESTION, max_new_tokens=8)
    full = answer_with_prefill(model, ctx.token_ids, QUESTION, max_new_tokens=8)
    assert answer.token_ids[:4] == full.token_ids[:4]


def test_an_impossible_deadline_gives_the_best_effort_and_says_so(store, model, tmp_path):
    edge = shaped_edge(store, tmp_path, [(0, 16), (1000, 16)])  # 2 MB/s
    ctx = load_once(edge, model, deadline_s=0.3, initial_bps=2e6)
    plan = ctx.plan
    assert not plan.feasible and plan.ready_s > 0.3
    assert len(plan.chunks) == 12 and all(c.ready_s > 0 for c in plan.chunks)
    # the fastest plan sends little over a slow link: mostly the lowest level and text,
    # never the top of the ladder (which chunks it fetches at a middle level while the
    # device recomputes others depends on the device speed measured on this machine)
    later = plan.chunk_levels[1:]
    assert sum(lv in ("lowest", TEXT) for lv in later) >= len(later) * 2 // 3, later
    assert not {"nearlossless", "high"} & set(later), later


def test_bad_quality_and_deadline_are_clear_errors(store, model):
    from kvcdn.errors import InputError

    with pytest.raises(InputError, match="has no level 'int4'"):
        load_context("sed-manual", model=model, store=str(store), quality="int4")
    with pytest.raises(InputError, match="deadline_s must be a positive"):
        load_context("sed-manual", model=model, store=str(store), deadline_s=0)


class _PartTarget:
    """An engine's target holding ``part`` (layers and heads) of the document's KV, in
    float32."""

    def __init__(self, manifest, part) -> None:
        self.part = part
        self.tokens = manifest.token_count
        self.kv = torch.zeros((part.layer_count, 2, part.head_count, manifest.token_count, 64))

    def chunk(self, start, end):
        from kvcdn.codecs import TensorDest

        return TensorDest(self.kv[:, :, :, start:end])

    def prefix(self, end):
        raise AssertionError("an engine's load recomputes nothing")

    def commit(self, start, end):
        pass

    def finish(self):
        pass


def test_a_target_holding_part_of_the_heads_loads_only_that_part(store, reference, model):
    """The engine's load path into a target that holds one of the three KV heads (as a
    tensor-parallel worker does): every chunk fetches its object's index and that
    head's sections only, reports those bytes, plans with the part's share of each
    object, and holds exactly that head of what a whole load gives."""
    from kvcdn.container import Part, parse_index
    from kvcdn.profile_store import ProfileCache
    from kvcdn.sdk.loader import load_prefix_into
    from kvcdn.sdk.planner import plan

    manifest = read_manifest(open_store(str(store)), "sed-manual", None)
    part = Part((0, 30), (1, 2))

    target = _PartTarget(manifest, part)
    result = load_prefix_into(
        target, manifest, open_store(str(store)), chunks=(0, len(manifest.chunks)),
        quality="nearlossless", device="cpu", predictor=HarmonicPredictor(), policy=plan,
        profiles=ProfileCache(), fingerprint=model.fingerprint,
    )  # fmt: skip
    assert result.loaded_chunks == len(manifest.chunks)
    root = open_store(str(store))
    for chunk, report in zip(manifest.chunks, result.chunks, strict=True):
        ref = chunk.objects["nearlossless"]
        index = parse_index(root.get(ref))
        own = sum(index.lengths[i] for i in part.section_ids(30))
        assert report.bytes == ref.index.bytes + own < ref.bytes / 2
    from kvcdn.models import kv_from_cache

    whole = kv_from_cache(reference.cache)
    assert torch.equal(target.kv, whole[:, :, 1:2, : manifest.token_count].float())


def _load_in_groups(root, model, bounds):
    """A layer-ordered load of the sed manual at ``nearlossless`` into groups of layers
    split at ``bounds``: the targets, the result, and what each ``loaded(g)`` call saw."""
    from kvcdn.codec import IndexCache
    from kvcdn.container import Part
    from kvcdn.profile_store import ProfileCache
    from kvcdn.sdk.loader import load_prefix_into
    from kvcdn.sdk.planner import plan
    from kvcdn.sdk.streaming import LayerGroups

    manifest = read_manifest(open_store(str(root)), "sed-manual", None)
    targets = [_PartTarget(manifest, Part((a, b), (0, 3)))
               for a, b in zip(bounds[:-1], bounds[1:], strict=True)]  # fmt: skip
    seen = []  # (group, a copy of every group's KV at that moment)

    def loaded(g: int) -> None:
        seen.append((g, [t.kv.clone() for t in targets]))

    result = load_prefix_into(
        LayerGroups(tuple(targets), loaded), manifest, open_store(str(root)),
        chunks=(0, len(manifest.chunks)), quality="nearlossless", device="cpu",
        predictor=HarmonicPredictor(), policy=plan, profiles=ProfileCache(),
        fingerprint=model.fingerprint, indexes=IndexCache(),
    )  # fmt: skip
    return manifest, targets, result, seen


def test_a_layer_ordered_load_is_one_pipeline_over_its_groups(store, reference, model):
    """Groups of layers load in order, each reported once it holds every chunk: what
    the forward pass may then read equals the whole load; each section and each index
    is read once, and each chunk is reported once, whatever the number of groups."""
    from kvcdn.models import kv_from_cache

    bounds = [0, 7, 19, 30]
    manifest, targets, result, seen = _load_in_groups(store, model, bounds)
    whole = kv_from_cache(reference.cache)[:, :, :, : manifest.token_count].float()
    assert [g for g, _ in seen] == [0, 1, 2]
    for g, kvs in seen:  # when group g was reported, groups 0..g were complete
        for h in range(g + 1):
            assert torch.equal(kvs[h], whole[bounds[h] : bounds[h + 1]]), (g, h)
    assert torch.equal(torch.cat([t.kv for t in targets]), whole)
    assert result.loaded_chunks == len(manifest.chunks)
    assert [r.index for r in result.chunks] == [c.index for c in manifest.chunks]
    for chunk, report in zip(manifest.chunks, result.chunks, strict=True):
        assert report.level == "nearlossless"
        assert report.bytes == chunk.objects["nearlossless"].bytes  # sections + index, once


BAD_CHUNK = 5
BAD_SECTION = 2 * 30 + 25  # head 2 of layer 25 of a 30-layer, 3-head object


@pytest.fixture(scope="module")
def damaged_store(store, tmp_path_factory):
    """A copy of the store whose chunk 5 ``nearlossless`` object has one bit flipped in
    the section of head 2 of layer 25."""
    import shutil

    from kvcdn.container import parse_index

    root = tmp_path_factory.mktemp("damaged") / "store"
    shutil.copytree(store, root)
    manifest = read_manifest(open_store(str(root)), "sed-manual", None)
    path = root / manifest.chunks[BAD_CHUNK].objects["nearlossless"].key
    data = bytearray(path.read_bytes())
    index = parse_index(bytes(data))
    data[index.offsets[BAD_SECTION] + index.lengths[BAD_SECTION] // 2] ^= 0x10
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return root


def test_a_damaged_section_in_a_later_group_ends_the_prefix_in_every_group(
    damaged_store, reference, model
):
    """A chunk whose last group's section is damaged is left to the engine in every
    group, with the chunks after it; every group is still reported (the forward pass
    never waits for nothing), and no damaged byte reaches the target."""
    from kvcdn.models import kv_from_cache

    bounds = [0, 10, 20, 30]
    manifest, targets, result, seen = _load_in_groups(damaged_store, model, bounds)
    assert [g for g, _ in seen] == [0, 1, 2]
    assert result.loaded_chunks == BAD_CHUNK
    reports = result.chunks
    assert len(reports) == len(manifest.chunks)
    assert all(r.level == "nearlossless" for r in reports[:BAD_CHUNK])
    assert reports[BAD_CHUNK].level == "skipped"
    assert reports[BAD_CHUNK].recompute_reason == "corrupt"
    assert all(r.level == "skipped" and r.recompute_reason == "after_failure"
               for r in reports[BAD_CHUNK + 1 :])  # fmt: skip
    bad = manifest.chunks[BAD_CHUNK]
    whole = kv_from_cache(reference.cache)
    kv = torch.cat([t.kv for t in targets])
    assert torch.equal(kv[:, :, :, : bad.start], whole[:, :, :, : bad.start].float())
    # the damaged section's layer and head never hold a byte of the damaged chunk
    assert not kv[25, :, 2, bad.start : bad.end].any()


def test_an_engine_load_from_a_later_chunk_ends_at_a_damaged_one(damaged_store, model):
    """An engine's load of chunks [2, n) (vLLM holds the first two) that meets a damaged
    chunk returns the chunks before it, without a deadline too: it once skipped by
    place instead of by chunk, left the damaged chunk unended and never returned."""
    import threading

    from kvcdn.codec import IndexCache
    from kvcdn.container import Part
    from kvcdn.profile_store import ProfileCache
    from kvcdn.sdk.loader import load_prefix_into
    from kvcdn.sdk.planner import plan

    manifest = read_manifest(open_store(str(damaged_store)), "sed-manual", None)
    results = []

    def load() -> None:
        results.append(load_prefix_into(
            _PartTarget(manifest, Part((0, 30), (0, 3))), manifest,
            open_store(str(damaged_store)),
            chunks=(2, len(manifest.chunks)), quality="nearlossless", device="cpu",
            predictor=HarmonicPredictor(), policy=plan, profiles=ProfileCache(),
            fingerprint=model.fingerprint, indexes=IndexCache(),
        ))  # fmt: skip

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(120)
    assert results, "the load did not return"
    result = results[0]
    assert result.loaded_chunks == BAD_CHUNK - 2
    assert [r.index for r in result.chunks] == list(range(2, len(manifest.chunks)))
    assert result.chunks[BAD_CHUNK - 2].recompute_reason == "corrupt"


def test_a_layer_ordered_load_past_its_deadline_keeps_the_prefix_that_arrived(
    store, model, tmp_path
):
    """An engine's layer-ordered load through a link too slow for its deadline (2 MB/s
    for ~9 MB at the lowest level, 4 s) loads chunk by chunk once its plan cannot make
    the deadline: it keeps the chunks that arrived in every group, as a whole load
    does. Group by group it had kept none: at the deadline the last group had not
    ended. Each kept chunk equals a load of that chunk alone at its level.

    The first chunk arrives in about 0.5 s here. A 2 s deadline once kept none on a CI
    machine, so the deadline leaves room for a stalled host; the link alone needs 4.5 s
    for the whole document, so the load can never end with every chunk."""
    from kvcdn.codec import IndexCache
    from kvcdn.container import Part
    from kvcdn.profile_store import ProfileCache
    from kvcdn.sdk.edges import EdgeStore
    from kvcdn.sdk.loader import load_prefix_into
    from kvcdn.sdk.planner import plan
    from kvcdn.sdk.streaming import LayerGroups

    edge = shaped_edge(store, tmp_path, [(0, 16), (1000, 16)])  # 2 MB/s
    manifest = read_manifest(open_store(str(store)), "sed-manual", None)
    bounds = [0, 10, 20, 30]
    targets = [_PartTarget(manifest, Part((a, b), (0, 3)))
               for a, b in zip(bounds[:-1], bounds[1:], strict=True)]  # fmt: skip
    reported = []
    try:
        status, body = post_json(f"{edge.url}/shaping", {"offset_s": 0})
        assert status == 200 and body["trace_time_s"] < 0.5
        result = load_prefix_into(
            LayerGroups(tuple(targets), reported.append), manifest, EdgeStore([edge.url]),
            chunks=(0, len(manifest.chunks)), quality="auto", device="cpu",
            predictor=HarmonicPredictor(initial_bps=2e6), policy=plan,
            profiles=ProfileCache(), fingerprint=model.fingerprint, deadline_s=4.0,
            indexes=IndexCache(),
        )  # fmt: skip
    finally:
        edge.kill(signal.SIGKILL)
    assert reported == [0, 1, 2]  # the forward pass never waits for nothing
    kept = result.loaded_chunks
    assert 1 <= kept < len(manifest.chunks), [
        (r.level, r.recompute_reason, round(r.start_s, 3), round(r.ready_s, 3))
        for r in result.chunks
    ]
    rest = result.chunks[kept:]
    assert all(r.level == "skipped" for r in rest)
    # given up at the deadline (late), or after a fetch cut off by it (late, then the
    # chunks after it)
    assert rest[0].recompute_reason == "late"
    assert {r.recompute_reason for r in rest} <= {"late", "after_failure"}
    kv = torch.cat([t.kv for t in targets])
    root = open_store(str(store))
    for chunk, report in zip(manifest.chunks[:kept], result.chunks, strict=False):
        alone = _PartTarget(manifest, Part((0, 30), (0, 3)))
        load_prefix_into(
            alone, manifest, root, chunks=(chunk.index, chunk.index + 1),
            quality=report.level, device="cpu", predictor=HarmonicPredictor(), policy=plan,
            profiles=ProfileCache(), fingerprint=model.fingerprint,
        )  # fmt: skip
        span = slice(chunk.start, chunk.end)
        assert torch.equal(kv[:, :, :, span], alone.kv[:, :, :, span]), chunk.index
