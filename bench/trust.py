"""What trust costs a reader: resolving and loading a document signed or not, trusted or not.

    python bench/trust.py [--doc FILE] [--repeats 20] [--json OUT]

Publishes the sed manual (2,818 tokens, the int8 level) twice into local
folders, once unsigned and once signed with a fresh ed25519 key, and measures
in the same run, median of --repeats:

- resolving ``name@latest`` (pointer, manifest, parse, checks): unsigned; signed
  read without a trust policy (signatures still checked against their own key);
  signed read with a trust policy (signature by a trusted key, rollback check);
- a whole warm ``load_context`` (resolve, fetch, sha256 per object, decode) in
  the same three ways;
- a fresh ``kvcdn inspect --json`` process, unsigned and with ``--trust``
  (what a user meets: imports included).

Prints a table and writes JSON; ratios are against the unsigned read.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, default=REPO / "cli" / "data" / "sed-manual.txt")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "trust.json")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from kvcdn import sdk
    from kvcdn.catalog import read_manifest
    from kvcdn.models import load_model
    from kvcdn.publish import publish
    from kvcdn.signing import SigningKey, TrustPolicy
    from kvcdn.store import open_store

    model = load_model()
    text = args.doc.read_text()
    work = Path(tempfile.mkdtemp(prefix="kvcdn-bench-trust-"))
    key = SigningKey.generate("bench")
    key.save(work / "bench.key")
    stores = {
        "unsigned": open_store(str(work / "plain")),
        "signed": open_store(str(work / "signed")),
    }
    publish(text=text, name="doc", model=model, store=stores["unsigned"], levels="int8")
    publish(text=text, name="doc", model=model, store=stores["signed"], levels="int8",
            sign_keys=[key])  # fmt: skip
    cases = {
        "unsigned": (stores["unsigned"], None),
        "signed, no trust policy": (stores["signed"], None),
        "signed, trusted": (stores["signed"], TrustPolicy([key.public])),
    }
    rows = []
    for name, (store, trust) in cases.items():
        resolve = _median(lambda s=store, t=trust: read_manifest(s, "doc", trust=t), args.repeats)
        load = _median(
            lambda s=store, t=trust: sdk.load_context(
                "doc", model=model, store=s, quality="int8", trust=t
            ),
            max(3, args.repeats // 4),
        )
        rows.append({"case": name, "resolve_s": resolve, "load_s": load})
    cli = {}
    env = {"XDG_STATE_HOME": str(work / "state"), "PATH": "/usr/bin:/bin"}
    for name, extra in (
        ("unsigned", ["--store", str(work / "plain")]),
        (
            "signed, trusted",
            ["--store", str(work / "signed"), "--trust", str(work / "bench.key.pub")],
        ),
    ):
        cmd = [sys.executable, "-m", "kvcdn.cli.main", "inspect", "doc", "--json", *extra]
        cli[name] = _median(
            lambda c=cmd: subprocess.run(c, check=True, capture_output=True, env=env), 5
        )
    base = rows[0]
    table = Table(title=f"trust on the reader's path: {args.doc.name}, int8, local store")
    for col in ("case", "resolve (ms)", "vs unsigned", "warm load (ms)", "vs unsigned",
                "fresh inspect (ms)"):  # fmt: skip
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        fresh = cli.get(r["case"])
        table.add_row(
            r["case"],
            f"{r['resolve_s'] * 1e3:.1f}",
            f"{r['resolve_s'] / base['resolve_s']:.2f}x",
            f"{r['load_s'] * 1e3:.0f}",
            f"{r['load_s'] / base['load_s']:.2f}x",
            f"{fresh * 1e3:.0f}" if fresh is not None else "-",
        )
    Console(width=120).print(table)
    report = {
        "conditions": {
            "document": args.doc.name,
            "level": "int8",
            "repeats": args.repeats,
            "machine": platform.platform(),
            "python": platform.python_version(),
        },
        "rows": rows,
        "fresh_inspect_s": cli,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
