"""The codec benchmark's outputs: means over documents, targets, tables, JSON and the plot."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .estimates import ABLATION_ROWS, BASELINE_ROWS, ESTIMATORS
from .measure import CONTINUATION_TOKENS, FIXED_ROWS

KL_FLOOR = 1e-7  # for the log-scale plot only

#: (row, metric, op, value); row "ladder" means every ladder level.
TARGETS: list[tuple[str, str, str, float]] = [
    ("default", "bits_per_element", "<=", 3.0),
    ("default", "ppl_delta_pct", "<=", 1.0),
    ("default", "kl", "<=", 0.01),
    ("nearlossless", "bits_per_element", "<=", 5.0),
    ("nearlossless", "kl", "<=", 0.002),
    ("ladder", "decode_mb_s", ">=", 1000.0),
    ("ladder", "encode_mb_s", ">=", 200.0),
]

#: Documents -> rows -> metrics, as measured.
Documents = dict[str, dict[str, dict[str, Any]]]


def summarise(documents: Documents) -> dict[str, dict[str, Any]]:
    """Each row's metrics, averaged over the documents that have it."""
    keys = (
        "bits_per_element",
        "kl",
        "ppl_delta_pct",
        "top1_agree",
        "encode_mb_s",
        "decode_mb_s",
        "decode_kernel_mb_s",
    )
    rows: list[str] = []
    for doc in documents.values():
        rows += [r for r in doc if r not in rows]
    summary: dict[str, dict[str, Any]] = {}
    for row in rows:
        present = [doc[row] for doc in documents.values() if row in doc]
        entry: dict[str, Any] = {"documents": len(present), "estimate": present[0]["estimate"]}
        for k in keys:
            vals = [r[k] for r in present if r.get(k) is not None]
            entry[k] = float(np.mean(vals)) if vals else None
        summary[row] = entry
    return summary


def check_targets(summary: dict[str, dict[str, Any]], ladder: list[str]) -> None:
    """Add ``checks`` and ``pass`` (None where no target applies) to each summary row."""
    for row, metrics in summary.items():
        checks = []
        for who, metric, op, value in TARGETS:
            if who != row and not (who == "ladder" and row in ladder):
                continue
            got = metrics.get(metric)
            ok = got is not None and (got <= value if op == "<=" else got >= value)
            checks.append(
                {"metric": metric, "op": op, "target": value, "value": got, "pass": bool(ok)}
            )
        metrics["checks"] = checks
        metrics["pass"] = all(c["pass"] for c in checks) if checks else None


# ---- tables ----------------------------------------------------------------------


def _fmt_kl(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.5f}" if v >= 1e-4 else f"{v:.1e}"


def _fmt_speed(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _metric_cells(m: dict[str, Any]) -> list[str]:
    """A row's cells from bits per element to the numba kernel's speed, as both tables show them."""
    return [
        f"{m['bits_per_element']:.3f}" + ("*" if m["estimate"] else ""),
        _fmt_kl(m["kl"]),
        f"{m['ppl_delta_pct']:+.3f}",
        f"{100 * m['top1_agree']:.1f}%",
        _fmt_speed(m["encode_mb_s"]),
        _fmt_speed(m["decode_mb_s"]),
        _fmt_speed(m.get("decode_kernel_mb_s")),
    ]


def print_tables(
    console: Any,
    model_name: str,
    context_tokens: int,
    repeat: int,
    documents: Documents,
    summary: dict[str, dict[str, Any]],
    triton: dict[str, Any] | str,
    busy_docs: list[str],
) -> None:
    """Every document's rows, then the means against the targets, then notes."""
    from rich.table import Table

    cols = ("doc", "level", "bits/elem", "KL", "PPL Δ%", "top-1", "encode MB/s", "decode MB/s")
    table = Table(
        title=f"KV codecs on {model_name}: {context_tokens}-token contexts, "
        f"{CONTINUATION_TOKENS}-token continuations (speed: fp16-equivalent MB/s, "
        f"best of {repeat}; * = entropy estimate)"
    )
    for col in (*cols, "numba doc MB/s"):
        table.add_column(col, justify="left" if col in ("doc", "level") else "right")
    for doc, rows in documents.items():
        for i, (row, r) in enumerate(rows.items()):
            table.add_row(
                doc if i == 0 else "", row, *_metric_cells(r), end_section=i == len(rows) - 1
            )
    console.print(table)

    stable = Table(title=f"summary: mean over {len(documents)} documents, against the targets")
    for col in (*cols[1:], "numba doc MB/s", "result"):
        stable.add_column(col, justify="left" if col in ("level", "result") else "right")
    for row, m in summary.items():
        if m["pass"] is None:
            verdict = ""
        elif m["pass"]:
            verdict = "[green]PASS[/green]"
        else:
            failed = [
                f"{c['metric']} {c['op']} {c['target']:g}" for c in m["checks"] if not c["pass"]
            ]
            verdict = "[red]FAIL[/red] (" + "; ".join(failed) + ")"
        stable.add_row(row, *_metric_cells(m), verdict)
    console.print(stable)
    targets_text = "; ".join(f"{who} {metric} {op} {value:g}" for who, metric, op, value in TARGETS)
    console.print(f"targets: {targets_text}")
    triton_text = (
        triton if isinstance(triton, str) else f"{triton['gbps']:.1f} GB/s on {triton['device']}"
    )
    console.print(f"triton GPU decode: {triton_text}")
    if busy_docs:
        console.print(
            f"[yellow]note:[/yellow] another process was using the CPU while "
            f"{', '.join(busy_docs)} {'was' if len(busy_docs) == 1 else 'were'} timed: "
            "their speed figures (and the means) understate this machine"
        )


# ---- JSON --------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """The machine and library versions the speeds were taken on."""
    import numba
    import torch

    from kvcdn.kernels import parallel

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numba": numba.__version__,
        "kernel_threads": parallel.get_threads(),
        "numpy": np.__version__,
        "loadavg_start": list(os.getloadavg()),
    }


def result(
    model: Any,
    profile: Any,
    profile_key: str,
    run: dict[str, Any],
    machine: dict[str, Any],
    documents: Documents,
    summary: dict[str, dict[str, Any]],
    triton: dict[str, Any] | str,
) -> dict[str, Any]:
    """The JSON result. ``run``: context_tokens, chunk_tokens, repeat, documents
    (what each document was) and seconds, as the run used them."""
    return {
        "benchmark": "codec",
        "config": {
            "model": model.name,
            "model_fingerprint": model.fingerprint,
            "device": model.device,
            "layout": model.layout.to_json(),
            "profile_sha256": profile.sha256,
            "profile_key": profile_key,
            "profile_sinks": profile.sinks,
            "profile_calibration": profile.calibration,
            "profile_levels": {
                n: {"strength": s.strength, "calibration_quality": s.quality}
                for n, s in profile.levels.items()
            },
            "context_tokens": run["context_tokens"],
            "continuation_tokens": CONTINUATION_TOKENS,
            "chunk_tokens": run["chunk_tokens"],
            "repeat": run["repeat"],
            "documents": run["documents"],
            "estimators": ESTIMATORS,
            "speed_units": "fp16-equivalent MB/s (elements * 2 / seconds / 1e6), best of repeat",
            "seconds": run["seconds"],
        },
        "machine": machine,
        "documents": documents,
        "summary": summary,
        "targets": [
            {"row": who, "metric": metric, "op": op, "value": value}
            for who, metric, op, value in TARGETS
        ],
        "triton": triton,
    }


# ---- plot --------------------------------------------------------------------------

#: Label offsets (points) in the zoomed panel, where the ablations crowd the default level.
_LABEL_OFFSETS = {
    "default-est": (-6, -12, "right"),
    "no-sinks": (7, 2, "left"),
    "no-fisher": (7, -9, "left"),
    "hadamard": (-7, 3, "right"),
    "anchor-delta": (7, -10, "left"),
    "default": (7, 3, "left"),
}


def plot(summary: dict[str, dict[str, Any]], ladder: list[str], path: Path, title: str) -> None:
    """Rate-distortion (bits per element against KL), all rows and a zoom on the ladder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, zoom) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [1, 1.3]})

    def xy(rows: list[str]) -> tuple[list[float], list[float], list[str]]:
        rows = [r for r in rows if r in summary]
        return (
            [summary[r]["bits_per_element"] for r in rows],
            [max(summary[r]["kl"], KL_FLOOR) for r in rows],
            rows,
        )

    series = [
        (ladder, dict(marker="o", ls="-", color="C0"), "kvcdn ladder (real rANS containers)"),
        (list(FIXED_ROWS), dict(marker="s", ls="", color="C1"), "fixed levels (real)"),
        (
            list(BASELINE_ROWS),
            dict(marker="^", ls="", color="C2", mfc="none", ms=9),
            "baselines (* entropy estimate)",
        ),
        (
            list(ABLATION_ROWS),
            dict(marker="D", ls="", color="C3", mfc="none", ms=7),
            "ablations of default (* entropy estimate)",
        ),
    ]
    zoom_rows = [r for r in (*ladder, *BASELINE_ROWS, *ABLATION_ROWS) if r in summary]
    zx = [summary[r]["bits_per_element"] for r in zoom_rows]
    zy = [max(summary[r]["kl"], KL_FLOOR) for r in zoom_rows]
    for ax, zoomed in ((full, False), (zoom, True)):
        for rows, style, label in series:
            x, y, names = xy(rows)
            if not names:
                continue
            ax.plot(x, y, label=label, **style)
            for xi, yi, name in zip(x, y, names, strict=True):
                if not zoomed and name in ABLATION_ROWS:
                    continue  # labelled in the zoomed panel
                dx, dy, ha = _LABEL_OFFSETS.get(name, (6, 4, "left")) if zoomed else (6, 4, "left")
                star = "*" if summary[name]["estimate"] else ""
                ax.annotate(
                    name + star,
                    (xi, yi),
                    textcoords="offset points",
                    xytext=(dx, dy),
                    ha=ha,
                    fontsize=8,
                )
        ax.axhline(0.01, color="grey", ls=":", lw=1)
        ax.axvline(3.0, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("bits per element")
        ax.grid(True, which="both", alpha=0.25)
    if zx:
        zoom.set_xlim(min(zx) - 0.25, max(zx) + 0.9)
        zoom.set_ylim(min(zy) / 1.6, max(zy) * 1.6)
    full.set_ylabel(f"mean next-token KL vs exact KV (nats; floor {KL_FLOOR:g})")
    full.set_title("all rows", fontsize=10)
    zoom.set_title("zoom: ladder, baselines, ablations (dotted: default targets)", fontsize=10)
    full.legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
