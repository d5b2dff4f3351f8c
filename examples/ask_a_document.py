"""An app that answers questions about a published document, with an SDK client.

    python examples/ask_a_document.py --store /tmp/kv "How do I edit a file in place?"

Publishes the bundled sed manual to the store the first time (a full prefill,
a few seconds), then loads its KV cache from the store, instead of prefilling
it, for every run after.
"""

from __future__ import annotations

import argparse
from importlib.resources import files

from kvcdn import sdk
from kvcdn.publish import publish

NAME = "sed-manual"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", nargs="+")
    parser.add_argument("--store", required=True, help="a folder, or s3://bucket/prefix")
    args = parser.parse_args()

    with sdk.Client(store=args.store) as client:
        try:
            client.resolve(NAME)
        except sdk.NotFound:
            print(f"publishing {NAME} to {args.store} (once)")
            manual = files("kvcdn.cli") / "data" / "sed-manual.txt"
            publish(text=manual.read_text(), name=NAME, model=client.model(), store=args.store)

        ctx = client.load_context(NAME)
        plan = ctx.plan
        print(f"loaded {ctx.name}: {len(ctx.token_ids):,} tokens, {plan.bytes:,} bytes, "
              f"ready in {plan.ready_s:.2f} s")  # fmt: skip
        for question in args.questions:
            answer = ctx.generate(question, max_new_tokens=48)
            print(f"Q: {question}")
            print(f"A: {answer.text.strip()}  ({answer.ttft_s:.2f} s to the first token)")


if __name__ == "__main__":
    main()
