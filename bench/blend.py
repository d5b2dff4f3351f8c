"""CacheBlend: answering from several documents, against full prefill and the other reuse schemes.

    python bench/blend.py [--pages sed grep tar find] [--tokens 512] [--ratios 0.05 0.15 0.30]
                          [--answer-tokens 32] [--json OUT.json]

Publishes the first ``--tokens`` tokens of each man page (as the system
renders them) to a local folder. Each question needs two of the pages; for
each, the pages are read in a different order (rotated), and the time to
first token and the quality of the answer are measured, in the same run, for:

- ``prefill``: a full prefill of the documents and the question (the reference);
- ``full reuse``: the caches concatenated, keys moved to their positions,
  nothing recomputed (``load_contexts(blend=False)``);
- ``prefix caching``: the first document's cache reused, the rest prefilled;
- ``cacheblend R``: ``load_contexts(recompute_ratio=R, question=...)``, the
  question known at load time (as ``kvcdn ask`` knows it): the recomputed
  tokens are chosen for it and it is computed with them;
- ``cacheblend R, question unknown``: ``load_contexts(recompute_ratio=R)``,
  the choice by deviation alone, as in the paper, for ``--unknown-ratios``.

Quality, against full prefill: the KL divergence of the next-token
distributions over the reference answer (full prefill's greedy answer,
teacher-forced), the perplexity of that answer, and how often the greedy
answer is the same (whole answer and first token). Time to first token is
from the call (model loaded) to the first answer token.

The bench's own prefill is checked against the model run directly: the same
token ids prefilled by plain transformers (the same folder, dtype and threads)
in a fresh process that has run nothing of kvcdn's, median of 3; the ratio is
printed (target: within 1.3x). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGES = ("sed", "grep", "tar", "find")
# Each needs two of the pages.
QUESTIONS = (
    "Which option makes grep ignore case, and which option makes sed edit files in place?",
    "How do I list the files in a tar archive, and how do I find files by name?",
    "Which of these commands searches file contents and which one searches file names?",
    "What does sed do, and what does tar do?",
    "Which option makes grep print line numbers, and how do I extract a tar archive?",
    "How can find delete the files it finds, and how can sed delete lines?",
    "Which tool would you use to search a directory tree for files changed today, "
    "and which one to count matching lines?",
    "Explain the difference between the synopsis of tar and the synopsis of find.",
)


# A fresh process: plain transformers, the same folder, dtype and threads; one JSON line.
_PLAIN_PREFILL = r"""
import json, statistics, sys, time
import torch
from transformers import AutoModelForCausalLM
folder, threads, ids = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
runs = []
with torch.inference_mode():
    model(torch.tensor([ids[:32]]))  # PyTorch's one-off costs
    for _ in range(3):
        t = time.perf_counter()
        model(torch.tensor([ids]), use_cache=True).logits[0, -1]
        runs.append(time.perf_counter() - t)
print(json.dumps({"seconds": statistics.median(runs)}))
"""


def _plain_prefill_s(folder: str, ids: list[int]) -> float:
    """The model's own prefill of ``ids``, run directly in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_PREFILL, folder, str(os.cpu_count() or 1), json.dumps(ids)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def _man(page: str) -> str:
    out = subprocess.run(
        f"man -P cat {page} | col -bx",
        shell=True, capture_output=True, text=True, env={**os.environ, "MANWIDTH": "80"},
    )  # fmt: skip
    if out.returncode or len(out.stdout) < 1000:
        raise SystemExit(f"the man page of {page} is not installed")
    return out.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", nargs="+", default=list(PAGES))
    parser.add_argument("--tokens", type=int, default=512, help="tokens per document")
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.05, 0.15, 0.30])
    parser.add_argument(
        "--unknown-ratios", nargs="*", type=float, default=[0.15],
        help="ratios to also run without the question known at load time",
    )  # fmt: skip
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "blend.json")
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import DynamicCache

    from kvcdn import sdk
    from kvcdn.models import crop_cache, kv_from_cache, load_model, model_folder
    from kvcdn.publish import publish
    from kvcdn.store import open_store

    console = Console(stderr=True)
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model()
    work = Path(tempfile.mkdtemp(prefix="kvcdn-blend-"))
    store = open_store(str(work / "store"))
    names = []
    for page in args.pages:
        ids = model.document_ids(_man(page))
        prefix = len(model.prefix_ids())
        text = model.tokenizer.decode(ids[prefix : prefix + args.tokens])
        name = f"{page}-man-{args.tokens}"
        with console.status(f"publishing {name}…"):
            publish(text=text, name=name, model=model, store=store)
        names.append(name)

    def first_token_and_scores(cache: Any, n_ctx: int, q_ids: list[int], ref: list[int]):
        """Teacher-force the question and the reference answer after ``cache``."""
        with torch.inference_mode():
            logits = model.model(
                torch.tensor([q_ids + ref[:-1]]), past_key_values=cache, use_cache=True
            ).logits[0, len(q_ids) - 1 :]
        crop_cache(cache, n_ctx)
        return torch.log_softmax(logits.float(), dim=-1)

    def greedy(cache: Any, n_ctx: int, q_ids: list[int]) -> tuple[list[int], float]:
        out, ttft, _ = model.greedy(cache, q_ids, args.answer_tokens)
        crop_cache(cache, n_ctx)
        return out, ttft

    methods = [
        "prefill",
        "full reuse",
        "prefix caching",
        *[f"cacheblend {r:g}" for r in args.ratios],
        *[f"cacheblend {r:g}, question unknown" for r in args.unknown_ratios],
    ]
    # warm up: the position self-check, kernels, the device-speed measurement
    sdk.load_contexts(names[:2], model=model, store=store).generate("warm up", max_new_tokens=1)
    runs: list[dict[str, Any]] = []
    started_all = time.perf_counter()
    for qi, question in enumerate(QUESTIONS[: args.questions]):
        # a different order for each question: rotated, then reversed
        order = names[qi % len(names) :] + names[: qi % len(names)]
        if (qi // len(names)) % 2:
            order.reverse()
        for method in methods:
            t = time.perf_counter()
            if method == "prefill":
                ctx = sdk.load_contexts(order, model=model, store=store, blend=False)
                ids = ctx.token_ids
                q_ids = ctx._question_ids(question)
                t = time.perf_counter()
                cache = DynamicCache(config=model.model.config)
                model.greedy(cache, ids + q_ids, 1)
                ttft = time.perf_counter() - t
                crop_cache(cache, len(ids))
                report = None
            elif method == "prefix caching":
                ctx = sdk.load_contexts(order, model=model, store=store, blend=False)
                ids = ctx.token_ids
                q_ids = ctx._question_ids(question)
                t = time.perf_counter()
                first = sdk.load_context(order[0], model=model, store=store)
                kv_a = kv_from_cache(first.cache)
                rest = model.extend(kv_a, ids[kv_a.shape[3] :])
                cache = model.cache_from_kv(torch.cat([kv_a, rest], dim=3))
                model.greedy(cache, q_ids, 1)
                ttft = time.perf_counter() - t
                crop_cache(cache, len(ids))
                report = None
            else:
                ratio = 0.0 if method == "full reuse" else float(method.split()[1].strip(","))
                known = method.startswith("cacheblend") and not method.endswith("unknown")
                t = time.perf_counter()
                ctx = sdk.load_contexts(
                    order,
                    model=model,
                    store=store,
                    blend=ratio > 0,
                    recompute_ratio=ratio,
                    question=question if known else None,
                )
                ctx.generate(question, max_new_tokens=1)
                ttft = time.perf_counter() - t
                ids = ctx.token_ids
                q_ids = ctx._question_ids(question)
                cache = ctx.cache
                report = ctx.blend
            answer, _ = greedy(cache, len(ids), q_ids)
            if method == "prefill":
                reference = answer
                ref_logp = first_token_and_scores(cache, len(ids), q_ids, reference)
            logp = first_token_and_scores(cache, len(ids), q_ids, reference)
            kl = float(
                (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1).mean()
            )  # KL(prefill || method)
            nll = -logp.gather(1, torch.tensor(reference)[:, None]).mean()
            run = {
                "ids": ids + q_ids,
                "question": question,
                "order": order,
                "method": method,
                "tokens": len(ids),
                "ttft_s": ttft,
                "kl": kl,
                "perplexity": float(nll.exp()),
                "same_answer": answer == reference,
                "same_first_token": answer[:1] == reference[:1],
                "answer": model.decode(answer),
            }
            if report is not None:
                run["recomputed"] = report.recomputed
                run["reused"] = report.reused
            runs.append(run)
            console.log(
                f"q{qi} {method}: TTFT {ttft:.3f} s, KL {kl:.4f}, ppl {run['perplexity']:.2f}, "
                f"same answer {run['same_answer']}"
            )
            del cache

    summary: dict[str, Any] = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        summary[method] = {
            "runs": len(mine),
            "kl": statistics.fmean(r["kl"] for r in mine),
            "perplexity": statistics.fmean(r["perplexity"] for r in mine),
            "same_answer": statistics.fmean(r["same_answer"] for r in mine),
            "same_first_token": statistics.fmean(r["same_first_token"] for r in mine),
            "ttft_s": statistics.median(r["ttft_s"] for r in mine),
        }
    prefill_ttft = summary["prefill"]["ttft_s"]
    first = next(r for r in runs if r["method"] == "prefill")
    plain_s = _plain_prefill_s(model_folder(model.name), first["ids"])
    reuse_kl = summary["full reuse"]["kl"]
    for s in summary.values():
        s["speedup_vs_prefill"] = prefill_ttft / s["ttft_s"]
        s["kl_reduction_vs_full_reuse"] = reuse_kl / s["kl"] if s["kl"] > 0 else None
    # each question's KL reduction: how much the mean owes to a few questions
    blends = [m for m in methods if m.startswith("cacheblend")]
    per_question: list[dict[str, Any]] = []
    for question in QUESTIONS[: args.questions]:
        kls = {r["method"]: r["kl"] for r in runs if r["question"] == question}
        per_question.append(
            {
                "question": question,
                "full_reuse_kl": kls["full reuse"],
                "kl_reduction": {m: kls["full reuse"] / max(kls[m], 1e-12) for m in blends},
            }
        )

    table = Table(
        title=f"{len(args.pages)} documents of {args.tokens} tokens, "
        f"{args.questions} questions, {args.answer_tokens}-token reference answers"
    )
    for col in (
        "method", "KL to prefill", "KL vs full reuse", "perplexity", "same answer",
        "same 1st token", "TTFT s (median)", "vs prefill",
    ):  # fmt: skip
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, s in summary.items():
        table.add_row(
            method,
            f"{s['kl']:.4f}",
            ""
            if s["kl_reduction_vs_full_reuse"] is None or method == "full reuse"
            else f"{s['kl_reduction_vs_full_reuse']:.1f}x lower",
            f"{s['perplexity']:.3f}",
            f"{100 * s['same_answer']:.0f}%",
            f"{100 * s['same_first_token']:.0f}%",
            f"{s['ttft_s']:.3f}",
            f"{s['speedup_vs_prefill']:.1f}x",
        )
    out = Console(width=None if sys.stdout.isatty() else 150)
    out.print(table)
    by_question = Table(title="KL reduction against full reuse, per question")
    by_question.add_column("question")
    by_question.add_column("full reuse KL", justify="right")
    for m in blends:
        by_question.add_column(m.removeprefix("cacheblend "), justify="right")
    for row in per_question:
        by_question.add_row(
            row["question"][:60],
            f"{row['full_reuse_kl']:.4f}",
            *(f"{row['kl_reduction'][m]:.1f}x" for m in blends),
        )
    out.print(by_question)
    out.print(f"the bench's prefill (median {prefill_ttft:.3f} s) / the model run directly in a "
              f"fresh process ({plain_s:.3f} s, the same {len(first['ids'])} tokens): "
              f"{prefill_ttft / plain_s:.2f}x (target: at most 1.3x)")  # fmt: skip
    for r in runs:
        del r["ids"]
    result = {
        "benchmark": "blend",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "documents": names,
        "tokens_per_document": args.tokens,
        "summary": summary,
        "plain_prefill_s": plain_s,
        "prefill_vs_plain": prefill_ttft / plain_s,
        "per_question": per_question,
        "runs": runs,
        "seconds": time.perf_counter() - started_all,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
