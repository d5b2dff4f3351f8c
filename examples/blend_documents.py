"""Answer one question from several documents at once (CacheBlend).

    python examples/blend_documents.py --store /tmp/kv

Publishes two parts of the bundled sed manual (its options, its commands) as two
documents, loads both
KV caches into one context, recomputing 15% of their tokens so the second
attends to the first, and compares the answer with a full prefill's.
"""

from __future__ import annotations

import argparse
from importlib.resources import files

from kvcdn import sdk
from kvcdn.publish import publish

QUESTION = "Which option edits files in place, and which command substitutes text?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="a folder, or s3://bucket/prefix")
    args = parser.parse_args()

    manual = (files("kvcdn.cli") / "data" / "sed-manual.txt").read_text()
    commands = manual.index("COMMAND SYNOPSIS")
    # the options, and the commands: two documents the question needs both of
    parts = {"sed-options": manual[:commands], "sed-commands": manual[commands:]}

    with sdk.Client(store=args.store) as client:
        model = client.model()
        for name, text in parts.items():
            try:
                client.resolve(name)
            except sdk.NotFound:
                publish(text=text, name=name, model=model, store=args.store)

        ctx = client.load_contexts(list(parts), question=QUESTION)
        report = ctx.blend
        print(f"blended {ctx.name}: {report.tokens:,} tokens, {report.recomputed:,} recomputed, "
              f"ready in {ctx.ready_s:.2f} s")  # fmt: skip
        answer = ctx.generate(QUESTION, max_new_tokens=40)
        baseline = ctx.answer_with_prefill(QUESTION, max_new_tokens=40)
        print(f"Q: {QUESTION}\nkvcdn:   {answer.text.strip()}\nprefill: {baseline.text.strip()}")


if __name__ == "__main__":
    main()
