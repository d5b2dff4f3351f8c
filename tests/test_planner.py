"""The adaptive planner with exact sizes and synthetic predictors (no network, no model)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcdn.sdk.planner import (
    TEXT,
    Busy,
    ChunkChoice,
    HarmonicPredictor,
    Option,
    Refinement,
    base_first,
    fetch_first,
    next_refinement,
    plan,
)

# A ladder like the embedded model's: bytes of a 256-token chunk, top-1 agreement.
LADDER = (
    ("nearlossless", 2_900_000, 0.986),
    ("default", 2_170_000, 0.960),
    ("lowest", 1_600_000, 0.921),
)
DECODE_BPS = 1e9  # the synthetic device decodes 1 GB/s ...
PREFILL_TPS = 400.0  # ... and recomputes 400 tokens/s (256 tokens: 0.64 s)


class FixedLink:
    """A synthetic predictor: a link of exactly ``bps`` bytes per second."""

    def __init__(self, bps: float) -> None:
        self.bps = bps

    def predict_seconds(self, nbytes: int) -> float:
        return 0.0 if nbytes == 0 else nbytes / self.bps

    def observe(self, nbytes: int, seconds: float) -> None:
        pass


def chunks(n: int, tokens: int = 256, ladder=LADDER) -> list[ChunkChoice]:
    options = tuple(Option(name, b, q, b / DECODE_BPS) for name, b, q in ladder)
    options += (Option(TEXT, 0, 1.0, tokens / PREFILL_TPS),)
    return [ChunkChoice(i, tokens, options) for i in range(n)]


def finish_time(cs, choices, link) -> float:
    """The time model, computed independently of the planner."""
    fetched = [choices[c.index] for c in cs if choices[c.index].level != TEXT]
    link_s = link.predict_seconds(sum(o.bytes for o in fetched))
    last_decode = max((o.bytes / DECODE_BPS for o in fetched), default=0.0)
    device_s = sum(o.bytes / DECODE_BPS for o in fetched) + sum(
        c.tokens / PREFILL_TPS for c in cs if choices[c.index].level == TEXT
    )
    return max(link_s + last_decode, device_s)


def test_without_a_deadline_every_chunk_gets_its_best_level():
    p = plan(chunks(8), FixedLink(1e6), None)
    assert {o.level for o in p.choices.values()} == {"nearlossless"}
    assert p.feasible


def test_with_slack_the_best_quality_is_chosen():
    link = FixedLink(1e9)  # 8 chunks of 2.9 MB in 23 ms
    p = plan(chunks(8), link, deadline_s=1.0)
    assert p.feasible and {o.level for o in p.choices.values()} <= {"nearlossless", TEXT}
    assert p.quality == pytest.approx(8 * 0.986, abs=0.03)  # exact text only where free


def test_the_deadline_is_met_when_it_can_be():
    cs = chunks(8)
    link = FixedLink(20e6)  # 20 MB/s: all nearlossless (23 MB) would take 1.16 s
    p = plan(cs, link, deadline_s=0.8)
    assert p.feasible
    assert finish_time(cs, p.choices, link) <= 0.8 + 1e-9
    assert p.predicted_s == pytest.approx(finish_time(cs, p.choices, link))
    levels = {o.level for o in p.choices.values()}
    assert levels - {"nearlossless"}  # something had to give


def test_text_is_chosen_when_the_link_collapses():
    cs = chunks(4)
    link = FixedLink(1_000.0)  # 1 kB/s: nothing arrives in time
    p = plan(cs, link, deadline_s=3.0)  # recomputing all 4 takes 2.56 s
    assert p.feasible
    assert {o.level for o in p.choices.values()} == {TEXT}


def test_a_deadline_that_cannot_be_met_gives_the_fastest_plan_and_says_so():
    cs = chunks(6)
    link = FixedLink(1e6)
    p = plan(cs, link, deadline_s=0.01)
    assert not p.feasible
    fastest = min(
        finish_time(cs, dict(enumerate(combo)), link)
        for combo in itertools.product(*(c.options for c in cs))
    )
    assert p.predicted_s <= fastest * 1.05


@settings(max_examples=60, deadline=None)
@given(
    bps=st.floats(1e4, 1e9),
    deadline=st.floats(0.05, 5.0),
    sizes=st.lists(st.integers(10_000, 5_000_000), min_size=3, max_size=3, unique=True),
    n=st.integers(1, 4),
)
def test_greedy_matches_brute_force_on_small_cases(bps, deadline, sizes, n):
    sizes = sorted(sizes, reverse=True)
    ladder = tuple(zip(("a", "b", "c"), sizes, (0.99, 0.95, 0.90), strict=True))
    cs = chunks(n, ladder=ladder)
    link = FixedLink(bps)
    p = plan(cs, link, deadline)
    best_q, fastest = -1.0, float("inf")
    for combo in itertools.product(*(c.options for c in cs)):
        choices = {c.index: o for c, o in zip(cs, combo, strict=True)}
        t = finish_time(cs, choices, link)
        fastest = min(fastest, t)
        if t <= deadline:
            best_q = max(best_q, sum(o.quality for o in combo))
    if best_q >= 0:  # feasible: the planner finds a feasible plan of near-best quality
        assert p.feasible and finish_time(cs, p.choices, link) <= deadline + 1e-9
        assert p.quality >= 0.95 * best_q
    else:
        assert not p.feasible
        assert p.predicted_s <= fastest * 1.25


def test_harmonic_predictor_learns_and_keeps_a_margin():
    pr = HarmonicPredictor(initial_bps=1e6)
    assert pr.predict_seconds(1_000_000) == pytest.approx(1.0)
    for _ in range(5):
        pr.observe(10_000_000, 1.0)  # 10 MB/s, steady
    assert pr.throughput() == pytest.approx(10e6, rel=0.01)
    pr.observe(1_000_000, 1.0)  # a sudden drop to 1 MB/s
    assert pr.throughput() < 5e6  # the harmonic mean and the error margin both react
    assert pr.predict_seconds(0) == 0.0


def test_harmonic_predictor_handles_zero_bytes_and_zero_time():
    pr = HarmonicPredictor(initial_bps=1e6)
    pr.observe(0, 0.0)  # nothing in no time: no information
    assert pr.throughput() == 1e6
    pr.observe(1000, 0.0)  # instantaneous: capped, not a division by zero
    assert 0 < pr.throughput() <= pr.max_bps
    pr.observe(0, 0.5)  # half a second with nothing arriving: a stalled link
    assert 0 < pr.throughput() <= 1e3 and pr.predict_seconds(1) < float("inf")
    for _ in range(5):
        pr.observe(4_000_000, 1.0)  # the link recovers, and so does the prediction
    assert pr.throughput() > 1e6


def test_a_stall_makes_the_plan_recompute():
    cs = chunks(4)
    pr = HarmonicPredictor(initial_bps=50e6)
    assert {o.level for o in plan(cs, pr, 3.0).choices.values()} == {"nearlossless"}
    pr.observe(0, 0.5)
    assert {o.level for o in plan(cs, pr, 3.0).choices.values()} == {TEXT}


def test_text_goes_first_so_the_device_starts_at_once():
    cs = chunks(8)
    link = FixedLink(8e6)  # 8 chunks of 1.6 MB: 1.6 s even at the lowest level
    p = plan(cs, link, deadline_s=1.5)
    assert p.feasible
    levels = [p.choices[i].level for i in range(8)]
    n_text = levels.count(TEXT)
    assert 0 < n_text < 8 and levels[:n_text] == [TEXT] * n_text
    assert p.predicted_s == pytest.approx(finish_time(cs, p.choices, link))


def test_work_under_way_is_counted():
    cs = chunks(4)
    link = FixedLink(20e6)
    idle = plan(cs, link, deadline_s=0.6)
    busy = plan(cs, link, deadline_s=0.6, busy=Busy(link_bytes=4_000_000))  # 0.2 s more link
    assert busy.predicted_s > idle.predicted_s or busy.quality < idle.quality
    assert plan(cs, link, 0.6, Busy(device_s=10.0)).feasible is False


def test_a_fetch_in_flight_on_a_dead_link_makes_the_plan_infeasible():
    cs = chunks(2)
    link = FixedLink(1_000.0)
    p = plan(cs, link, deadline_s=5.0, busy=Busy(link_bytes=50_000))  # 50 s still to come
    assert {o.level for o in p.choices.values()} == {TEXT}
    assert not p.feasible and p.predicted_s >= 50.0


def test_quality_scores_come_from_the_manifest(tmp_path):
    from kvcdn.manifest import LevelInfo, Manifest
    from kvcdn.sdk.loader import quality_scores

    def level(codec, bits, quality):
        return LevelInfo("id", codec, {}, 1, bits, quality=quality)

    m = Manifest(
        "d", 1, "0" * 64, 1, "now", "m", "0" * 64, "t", 1, 256, {},
        {
            "fp16": level("fp16", 16.0, {}),
            "int8": level("int8-channel-zstd", 7.7, {}),
            "default": level("kvcdn-rans-v1", 2.98, {"top1_agree": 0.966, "kl": 0.0048}),
            "lowest": level("kvcdn-rans-v1", 2.2, {"top1_agree": 0.896, "kl": 0.0341}),
            TEXT: level("recompute", 0.0, {}),
        },
    )  # fmt: skip
    scores = quality_scores(m)
    assert scores["fp16"] == scores[TEXT] == 1.0
    assert scores["default"] == pytest.approx(0.966 - 0.0048)
    assert scores["int8"] == scores["default"]  # unmeasured: like the best with fewer bits
    assert scores["lowest"] < scores["default"]


def test_a_new_link_starts_from_the_prior_unless_the_manifest_shows_it_is_slower():
    """The manifest's read, less the pointer read's overhead, lowers the prior, never raises it."""
    from kvcdn.sdk.loader import TimedReader
    from kvcdn.store import open_store

    store = open_store("memory://timed-reader")
    store.put("pointer", b"{}")
    store.put("manifest", b"m" * 30_000)
    timed = TimedReader(store)
    assert timed.get("manifest") == b"m" * 30_000  # reads pass through, and are timed
    assert len(timed.reads) == 1 and timed.reads[0][0] == 30_000
    prior = 12.5e6
    timed.reads = [(90, 0.004), (30_000, 0.0045)]  # 30 kB in 0.5 ms beyond the overhead
    assert timed.throughput_bound(prior) == prior  # 60 MB/s: can't tell; the prior stands
    timed.reads = [(90, 0.004), (30_000, 0.034)]  # 30 kB in 30 ms: a 1 MB/s link
    assert timed.throughput_bound(prior) == pytest.approx(1e6)
    timed.reads = [(30_000, 0.034)]  # no small read to tell the overhead: all of it counts
    assert timed.throughput_bound(prior) == pytest.approx(30_000 / 0.034)
    timed.reads = [(90, 0.004)]  # nothing large enough to say anything
    assert timed.throughput_bound(prior) == prior


def test_base_first_takes_every_chunk_s_smallest_level_unless_that_misses() -> None:
    cs = chunks(4)
    link = FixedLink(100e6)
    p = base_first(cs, link, deadline_s=1.0)
    assert [p.choices[c.index].level for c in cs] == ["lowest"] * 4 and p.feasible
    # the bases alone miss: the planner's own choice (text first, where it helps)
    slow = FixedLink(1e6)
    assert base_first(cs, slow, deadline_s=2.0).choices == plan(cs, slow, 2.0).choices


def test_fetch_first_recomputes_only_where_fetching_alone_misses() -> None:
    cs = chunks(8)
    link = FixedLink(20e6)  # all nearlossless (23 MB) would take 1.16 s
    # the planner recomputes the first chunk: it loses no quality and saves link time
    assert plan(cs, link, deadline_s=0.8).choices[0].level == TEXT
    p = fetch_first(cs, link, deadline_s=0.8)
    assert p.feasible and TEXT not in {o.level for o in p.choices.values()}
    assert finish_time(cs, p.choices, link) <= 0.8 + 1e-9
    # fetching alone cannot meet the deadline: the planner's choice, recomputing
    dead = FixedLink(1_000.0)
    assert fetch_first(cs[:4], dead, deadline_s=3.0).choices == plan(cs[:4], dead, 3.0).choices
    # on a prior (no sample of the link yet) it fetches at the fastest levels, whatever
    # the prior predicts: a recompute started on a prior cannot be taken back
    prior = HarmonicPredictor(1_000.0)
    p = fetch_first(cs[:4], prior, deadline_s=3.0)
    assert not p.feasible and {o.level for o in p.choices.values()} == {"lowest"}
    prior.observe(1_000, 1.0)  # the link said it is this slow: recompute
    assert fetch_first(cs[:4], prior, 3.0).choices == plan(cs[:4], prior, 3.0).choices
    # a chunk with no fetched level: the planner's choice
    only_text = [ChunkChoice(9, 256, (Option(TEXT, 0, 1.0, 0.64),))]
    assert fetch_first(only_text, link, 1.0).choices == plan(only_text, link, 1.0).choices


def test_a_refinement_is_started_only_where_it_fits_and_gains_most_per_second() -> None:
    link = FixedLink(10e6)
    best = Option("nearlossless", 0, 0.986, 0.01)
    mid = Option("default", 0, 0.960, 0.01)
    small = Refinement(0, mid, 1_000_000, 0.01, 0.039 * 256)  # 0.11 s
    large = Refinement(0, best, 3_000_000, 0.01, 0.065 * 256)  # 0.31 s
    assert next_refinement([small, large], link, deadline_s=1.0) is small  # more gain a second
    assert next_refinement([large], link, deadline_s=1.0) is large
    assert next_refinement([large], link, deadline_s=0.3) is None  # would finish late
    assert next_refinement([small, large], link, deadline_s=None) is None  # no deadline
    # work under way comes first: a busy device or link leaves less time
    assert next_refinement([small], link, 0.5, Busy(device_s=0.45)) is small  # overlaps
    assert next_refinement([small], link, 0.5, Busy(device_s=0.495)) is None
    assert next_refinement([small], link, 0.5, Busy(link_bytes=4_000_000)) is None
    assert next_refinement([small], link, 0.5, Busy(link_bytes=3_000_000)) is small
    assert next_refinement([Refinement(0, mid, 10, 0.0, 0.0)], link, 1.0) is None  # no gain


def _random_choices(rng: random.Random) -> list[ChunkChoice]:
    """0-40 chunks with 0-5 fetched levels and maybe ``text``, their figures drawn from a few
    values (so that ties happen), indices not 0..n-1."""
    bytes_of = [0, 400_000, 1_000_000, 1_000_000, 2_500_000]
    out = []
    for i in range(rng.randint(0, 40)):
        options = [Option(f"l{k}", rng.choice(bytes_of), rng.choice([0.5, 0.9, 0.95, 0.99]),
                          rng.choice([0.0, 0.002, 0.004, 0.01]))
                   for k in range(rng.randint(0, 5))]  # fmt: skip
        if not options or rng.random() < 0.8:
            options.insert(rng.randint(0, len(options)),
                           Option(TEXT, 0, 1.0, rng.choice([0.05, 0.2, 0.64])))  # fmt: skip
        out.append(ChunkChoice(3 * i + 7, 256, tuple(options)))
    return out


def test_the_search_weighing_every_pair_at_once_makes_the_scalar_searchs_plan(monkeypatch):
    """The downgrade search (compiled for the harmonic predictor, numpy arrays for any
    other); on 1,000 random plans (ties, text-only and fetched-only chunks, work under
    way, both kinds of predictor, so both searches) it chooses exactly what the
    pair-by-pair search chooses."""
    from kvcdn.sdk import planner as planner_module
    from tests.planner_reference import downgrade_pairwise

    rng = random.Random(20261127)
    searched = 0
    for trial in range(1000):
        chunks = _random_choices(rng)
        if trial % 2:
            predictor = HarmonicPredictor(latency_s=rng.choice([0.0, 0.03]))
            for _ in range(rng.randint(0, 4)):
                predictor.observe(rng.randint(1, 50_000_000), rng.uniform(0.05, 2.0))
        else:
            predictor = FixedLink(rng.choice([5e6, 25e6, 125e6]))
        busy = Busy(rng.choice([0, 300_000]), rng.choice([0.0, 0.05]), rng.choice([0.0, 0.1]))
        deadline = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0, 3.0])
        fast = plan(chunks, predictor, deadline, busy)
        with monkeypatch.context() as m:
            m.setattr(planner_module, "_downgrade", downgrade_pairwise)
            slow = plan(chunks, predictor, deadline, busy)
        assert {i: o.level for i, o in fast.choices.items()} == {
            i: o.level for i, o in slow.choices.items()}, trial  # fmt: skip
        assert all(fast.choices[i] is slow.choices[i] for i in fast.choices), trial
        assert (fast.predicted_s, fast.feasible) == (slow.predicted_s, slow.feasible), trial
        searched += any(fast.choices[c.index] is not planner_module._best_fetched(c)
                        for c in chunks)  # fmt: skip
    assert searched > 300  # a third of the plans or more downgraded something
