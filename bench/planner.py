"""What choosing each chunk's level costs a load: the planner's search, in CPU seconds.

    python bench/planner.py [--chunks 16,32,64,128,256] [--json OUT]

A load plans again after every chunk it fetches or decodes, so a document of n
chunks is planned about 2n times, over fewer chunks each time. Each plan starts from
every chunk's best level and, while the estimate misses the deadline, takes one
downgrade at a time. Synthetic chunks of the embedded model's shape (256 tokens; five
levels of 2.2-4.0 bits a value and ``text``; a 50 MB/s link; 32K tokens = 128
chunks), two deadlines:

- ``fits``: the time the link takes to carry every chunk at ``default``: the search
  stops part of the way down;
- ``cannot``: half the time it takes at ``lowest``: no plan meets it, and every plan
  searches to the end (the best effort).

For each:

- ``one plan``: the first plan of the whole document, best of 3;
- ``a load's plans``: the 2n plans of a load, chunk k planning chunks k.. with its
  share of the deadline.

Each row is timed for three searches, in the same run: the planner as shipped with its
harmonic predictor (:func:`kvcdn.sdk.planner.plan`, a compiled kernel,
:mod:`kvcdn.kernels.downgrade`), the same planner with a predictor it cannot compile
for (``arrays``: numpy, every (chunk, option) pair of a step at once), and the search
one pair at a time (``tests/planner_reference.py``, as first written). All three choose
the same plan (checked here too). The reference's load rows above 128 chunks are left
out (minutes each: the search is cubic in the chunks there). Prints a table, writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvcdn.sdk import planner  # noqa: E402
from kvcdn.sdk.planner import TEXT, Busy, ChunkChoice, HarmonicPredictor, Option  # noqa: E402
from tests.planner_reference import downgrade_pairwise  # noqa: E402

ELEMENTS = 30 * 2 * 3 * 256 * 64  # a 256-token chunk of the embedded model
LEVELS = (("nearlossless", 3.95, 0.984), ("high", 3.58, 0.983), ("default", 2.95, 0.964),
          ("low", 2.60, 0.917), ("lowest", 2.17, 0.857))  # fmt: skip
REFERENCE_LOAD_MAX = 128


def chunks(n: int) -> list[ChunkChoice]:
    out = []
    for i in range(n):
        options = tuple(Option(name, int(ELEMENTS * bits / 8), q, 0.004 * bits / 3)
                        for name, bits, q in LEVELS)  # fmt: skip
        out.append(ChunkChoice(i, 256, (*options, Option(TEXT, 0, 1.0, 0.05 + 0.0005 * i))))
    return out


def link() -> HarmonicPredictor:
    predictor = HarmonicPredictor()
    for _ in range(3):
        predictor.observe(50_000_000, 1.0)
    return predictor


class OpaqueLink:
    """The same link, through a predictor that does not say it is linear: the planner
    searches it with numpy arrays."""

    def __init__(self) -> None:
        self.link = link()

    def predict_seconds(self, nbytes: int) -> float:
        return self.link.predict_seconds(nbytes)

    def predict_seconds_many(self, nbytes: Any) -> Any:
        return self.link.predict_seconds_many(nbytes)

    def observe(self, nbytes: int, seconds: float) -> None:
        self.link.observe(nbytes, seconds)


def one_plan(cs: list[ChunkChoice], deadline: float, make_link: Any
             ) -> tuple[float, planner.Plan]:  # fmt: skip
    best, result = float("inf"), None
    for _ in range(3):
        started = time.process_time()
        result = planner.plan(cs, make_link(), deadline)
        best = min(best, time.process_time() - started)
    assert result is not None
    return best, result


def a_loads_plans(cs: list[ChunkChoice], deadline: float, make_link: Any) -> float:
    n, predictor, busy = len(cs), make_link(), Busy(1_000_000, 0.01, 0.0)
    started = time.process_time()
    for k in range(n):
        for _ in range(2):
            planner.plan(cs[k:], predictor, deadline * (n - k) / n, busy)
    return time.process_time() - started


def _against(row: dict[str, Any], key: str, unit: float, fmt: str) -> str:
    """The compiled search's figure, then the others' with their ratio to it."""
    own, other, ref = (row[f"{name}_{key}"] for name in ("compiled", "arrays", "pairwise"))
    cells = [f"{own * unit:{fmt}}", f"{other * unit:{fmt}} ({other / own:4.1f}x)"]
    cells.append("(not run)" if ref is None else f"{ref * unit:{fmt}} ({ref / own:5.1f}x)")
    return " / ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="16,32,64,128,256", help="documents' chunk counts")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "planner.json")
    args = parser.parse_args()
    rows = []
    shipped = planner._downgrade
    bytes_of = {o.level: o.bytes for o in chunks(1)[0].options}
    cases = [(n, case) for n in [int(x) for x in args.chunks.split(",")]
             for case in ("fits", "cannot")]  # fmt: skip
    for n, case in cases:
        cs = chunks(n)
        link_s = n * bytes_of["default" if case == "fits" else "lowest"] / 50e6
        deadline = link_s if case == "fits" else link_s / 2
        row: dict[str, Any] = {"chunks": n, "deadline": case, "deadline_s": deadline}
        searches = (("compiled", shipped, link), ("arrays", shipped, OpaqueLink),
                    ("pairwise", downgrade_pairwise, link))  # fmt: skip
        for name, search, make_link in searches:
            planner._downgrade = search
            try:
                row[f"{name}_one_plan_s"], made = one_plan(cs, deadline, make_link)
                row[f"{name}_levels"] = {lv: sum(o.level == lv for o in made.choices.values())
                                         for lv in [*(x[0] for x in LEVELS), TEXT]}  # fmt: skip
                row[f"{name}_load_s"] = (None if name == "pairwise" and n > REFERENCE_LOAD_MAX
                                         else a_loads_plans(cs, deadline, make_link))  # fmt: skip
            finally:
                planner._downgrade = shipped
        if not row["compiled_levels"] == row["arrays_levels"] == row["pairwise_levels"]:
            raise SystemExit(f"{n} chunks, {case}: the searches chose differently")
        rows.append(row)

        print(f"{n:4d} chunks, deadline {case:6s} ({deadline:5.2f} s): one plan, ms, compiled / "
              f"arrays / pairwise: {_against(row, 'one_plan_s', 1e3, '7.2f')}; a load's plans, "
              f"s: {_against(row, 'load_s', 1, '7.3f')}", flush=True)  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    setup = {"python": sys.version.split()[0], "platform": platform.platform(),
             "link_bps": 50e6, "cpu_seconds": "time.process_time"}  # fmt: skip
    args.json.write_text(json.dumps({"benchmark": "planner", "setup": setup, "rows": rows},
                                    indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
