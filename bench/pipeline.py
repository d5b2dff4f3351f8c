"""What a load's pipeline costs as its items grow: chunks, and groups of layers.

    python bench/pipeline.py [--tokens 4000] [--chunk-tokens 256,32] [--groups 1,4]
                             [--quality default] [--deadline 30] [--repeats 5] [--json OUT]

A load's controller (``kvcdn.sdk.streaming.Pipeline``) runs one turn for every fetch
and every decode of an item; an item is a chunk, or in a layer-ordered load
(``LayerGroups``, what the vLLM connector runs with ``layer_groups`` > 1) one group of
a chunk's layers. A 32K-token document is 128 chunks of 256 tokens, 512 items in 4
groups; here the first ``--tokens`` of ``man bash`` published (embedded model,
``default`` and ``lowest``, local folder) at each ``--chunk-tokens`` gives 16 and 125 chunks.

For each chunk size and each ``--groups``, the document is loaded at ``--quality``
(``default``, or ``auto``: each chunk's level planned to meet the deadline) into float32
tensors of the model's KV shape the way an engine's worker loads it
(``load_prefix_into``), without a deadline and with ``--deadline`` seconds (the plan
made again as items end): the first load, then the median of ``--repeats`` loads, of
the wall time, the CPU time of the controller's own thread, the process's CPU time
(fetch threads, decodes and controller), and the plans the load made. Layer-ordered
rows give their ratio to the whole load of the same chunks (``/ whole``). Every load
must load every chunk. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _document(model: Any, tokens: int, folder: Path) -> str:
    sys.path.insert(0, str(REPO / "bench"))
    from codecbench.documents import render_man

    spec = importlib.util.spec_from_file_location("bench_vllm", REPO / "bench" / "vllm.py")
    assert spec is not None and spec.loader is not None
    bench_vllm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_vllm)
    page = render_man("bash", 0, folder)
    if page is None:
        raise SystemExit("bench/pipeline.py needs `man bash` (apt-get install man-db bash-doc)")
    return bench_vllm._cut(model, page.read_text(), tokens)


class _Target:
    """One group's layers of the document's KV in a float32 tensor, the shape a
    worker's KV has."""

    def __init__(self, part: Any, tokens: int, head_dim: int) -> None:
        import torch

        self.part, self.tokens = part, tokens
        self.kv = torch.empty((part.layer_count, 2, part.head_count, tokens, head_dim))

    def chunk(self, start: int, end: int) -> Any:
        from kvcdn.sdk.targets import TensorDest

        return TensorDest(self.kv[:, :, :, start:end])

    def prefix(self, end: int) -> Any:
        return self.kv[:, :, :, :end]

    def commit(self, start: int, end: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _load(layout: Any, manifest: Any, store: Any, profiles: Any, groups: int, quality: str,
          deadline: float | None) -> tuple[float, float, float, int]:  # fmt: skip
    """One load of every chunk in ``groups`` groups of layers: wall, the controller's
    thread's CPU and the process's CPU seconds, and the plans it made."""
    from kvcdn.codec import IndexCache
    from kvcdn.container import Part
    from kvcdn.sdk.loader import load_prefix_into
    from kvcdn.sdk.planner import HarmonicPredictor, plan
    from kvcdn.sdk.streaming import LayerGroups

    bounds = [layout.layers * i // groups for i in range(groups + 1)]
    targets = tuple(_Target(Part((a, b), (0, layout.kv_heads)), manifest.token_count,
                            layout.head_dim)
                    for a, b in zip(bounds, bounds[1:], strict=False))  # fmt: skip
    target = targets[0] if groups == 1 else LayerGroups(targets, loaded=lambda _: None)
    n = len(manifest.chunks)
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    result = load_prefix_into(
        target, manifest, store, chunks=(0, n), quality=quality, device="cpu",
        predictor=HarmonicPredictor(), policy=plan, profiles=profiles,
        fingerprint=manifest.model_fingerprint, deadline_s=deadline, indexes=IndexCache(),
    )  # fmt: skip
    times = (time.perf_counter() - wall, time.thread_time() - thread,
             time.process_time() - process, result.replans)  # fmt: skip
    if result.loaded_chunks != n:
        raise SystemExit(f"a load of {n} chunks loaded {result.loaded_chunks}")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--chunk-tokens", default="256,32")
    parser.add_argument("--groups", default="1,4")
    parser.add_argument("--quality", default="default", help="a stored level, or auto")
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.chunk_tokens.split(",")]
        groups = [int(x) for x in args.groups.split(",")]
    except ValueError:
        parser.error("--chunk-tokens and --groups take numbers like 256,32 and 1,4")
    if 1 not in groups:
        groups.insert(0, 1)  # the whole load is the baseline of every row

    from rich.console import Console
    from rich.table import Table

    from kvcdn.catalog import read_manifest
    from kvcdn.models import load_model
    from kvcdn.profile_store import ProfileCache
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    model = load_model(None, "cpu")
    work = Path(tempfile.mkdtemp(prefix="kvcdn-bench-pipeline-"))
    try:
        text = _document(model, args.tokens, work)
        rows: list[dict[str, Any]] = []
        for size in sizes:
            folder = work / f"store-{size}"
            publish(text=text, name="doc", model=model, store=str(folder),
                    levels="default,lowest",
                    chunk_tokens=size)  # fmt: skip
            store = open_store(str(folder), create=False)
            manifest = read_manifest(store, "doc")
            profiles = ProfileCache()
            n = len(manifest.chunks)
            for deadline in (None, args.deadline):
                for g in groups:
                    first = _load(model.layout, manifest, store, profiles, g, args.quality,
                                  deadline)  # fmt: skip
                    runs = [_load(model.layout, manifest, store, profiles, g, args.quality,
                                  deadline) for _ in range(args.repeats)]  # fmt: skip
                    median = [statistics.median(r[i] for r in runs) for i in range(4)]
                    rows.append({"chunk_tokens": size, "chunks": n, "groups": g, "items": n * g,
                                 "deadline_s": deadline, "first_s": first[0], "wall_s": median[0],
                                 "controller_cpu_s": median[1], "process_cpu_s": median[2],
                                 "plans": median[3]})  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"a load's pipeline: the first {args.tokens} tokens of man bash, "
                        f"{args.quality}")  # fmt: skip
    for col in ("chunks", "groups", "items", "deadline", "first s", "wall s", "wall / whole",
                "controller CPU s", "process CPU s", "CPU / whole", "plans"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        whole = next(w for w in rows if w["chunks"] == r["chunks"] and w["groups"] == 1
                     and w["deadline_s"] == r["deadline_s"])  # fmt: skip
        r["wall_over_whole"] = r["wall_s"] / whole["wall_s"]
        r["process_cpu_over_whole"] = r["process_cpu_s"] / whole["process_cpu_s"]
        table.add_row(
            str(r["chunks"]), str(r["groups"]), str(r["items"]),
            "none" if r["deadline_s"] is None else f"{r['deadline_s']:g} s",
            f"{r['first_s']:.3f}", f"{r['wall_s']:.3f}", f"{r['wall_over_whole']:.2f}x",
            f"{r['controller_cpu_s']:.3f}", f"{r['process_cpu_s']:.3f}",
            f"{r['process_cpu_over_whole']:.2f}x", f"{r['plans']:g}",
        )  # fmt: skip
    Console(width=130).print(table)
    out = {"setup": vars(args) | {"json": str(args.json) if args.json else None},
           "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "rows": rows}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
