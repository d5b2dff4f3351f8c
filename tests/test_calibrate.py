"""The calibration's searches on a model that cannot reach the ladder's targets: the
random-weight Llama, whose KL stays far above them even at the finest steps 8-bit
symbols allow. The search measures each step array once, says which levels missed,
and still gives a profile whose nested tiers decode."""

from __future__ import annotations

import logging

import pytest

from kvcdn import calibrate as cal
from tests.conftest import SED_MANUAL


@pytest.fixture(scope="module")
def llama(random_llama):
    from kvcdn.models import load_model

    return load_model(str(random_llama), "cpu")


def test_a_search_measures_each_step_array_once(llama, monkeypatch, caplog):
    measured: list[bytes] = []
    plain = cal._kl_plain

    def counted(model, sample, mean, step, sinks):
        measured.append(step.tobytes())
        return plain(model, sample, mean, step, sinks)

    monkeypatch.setattr(cal, "_kl_plain", counted)
    text = SED_MANUAL.read_text()[:6000]  # one short text: ~600 tokens of context
    with caplog.at_level(logging.INFO, logger="kvcdn.calibrate"):
        profile = cal.calibrate(llama, {"sed": text}, context_tokens=512,
                                levels=("nearlossless", "high", "default"),
                                nested_tiers=("minimal", "lowest", "low"))  # fmt: skip
    # One sample: one measure per step array, and none twice. Nearlossless goes finer
    # until its steps stop changing (every stream at its floor); high and default
    # start there and stop at once: 3 measures, where the search used to take 15.
    assert len(measured) == len(set(measured)) <= 4
    missed = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("no strength tried reached KL" in m for m in missed) == 3, missed
    # a nested tier all of whose streams are split, still above its target, is
    # measured once, not once per correction
    streams = llama.layout.layers * 2 * llama.layout.kv_heads * llama.layout.head_dim
    tiers = [r.getMessage() for r in caplog.records if "streams split ->" in r.getMessage()]
    assert len(tiers) == 2 and all(f" {streams} streams split" in m for m in tiers), tiers
    assert profile.nested is not None and profile.nested.tiers == ("minimal", "lowest", "low")
    for name in ("nearlossless", "high", "default"):
        assert profile.levels[name].quality["kl"] > cal.LADDER[name]
