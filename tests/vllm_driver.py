"""One real vLLM engine with kvcdn's connector, driven over stdin/stdout by the tests.

vLLM starts in 20-40 s on these CPUs, so the suite starts one engine per
session in this process (vLLM needs its own processes: it spawns its engine
core and worker) and sends it requests. Each request is one JSON line on stdin;
each reply is one line on stdout starting with ``REPLY`` (vLLM's own logging
goes to stderr and stdout too).

Usage: ``python tests/vllm_driver.py CONFIG_JSON`` where the config names the
model folder, the connector's ``kv_connector_extra_config`` and the capture
folder.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid

REPLY = "REPLY "


def main() -> None:
    from vllm import LLM, SamplingParams

    from kvcdn.sdk.vllm import CAPTURE_PARAM, producer_config

    config = json.loads(sys.argv[1])
    transfer = producer_config(config["capture_dir"], role="kv_both", **config["extra"])
    started = time.perf_counter()
    llm = LLM(
        model=config["folder"],
        kv_transfer_config=transfer,
        block_size=256,
        enforce_eager=True,
        max_model_len=8192,
        enable_prefix_caching=True,
        seed=0,
    )
    reply({"ready": True, "seconds": time.perf_counter() - started})
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()
        params = dict(ask.get("params") or {})
        if ask.get("capture"):
            params[CAPTURE_PARAM] = uuid.uuid4().hex
        sampling = SamplingParams(
            max_tokens=ask.get("max_tokens", 32),
            temperature=0.0,
            logprobs=ask.get("logprobs", 20),
            extra_args={"kv_transfer_params": params} if params else None,
        )
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ask["prompt_ids"]}], sampling, use_tqdm=False)[0]
        seconds = time.perf_counter() - t
        completion = out.outputs[0]
        first = completion.logprobs[0] if completion.logprobs else {}
        reply(
            {
                "token_ids": list(completion.token_ids),
                "text": completion.text,
                "num_cached_tokens": out.num_cached_tokens,
                "seconds": seconds,
                # the first answer token's top logprobs (token id -> logprob)
                "first_logprobs": {
                    str(k): v.logprob for k, v in first.items() if math.isfinite(v.logprob)
                },
                "capture": params.get(CAPTURE_PARAM),
                "kv_transfer_params": out.kv_transfer_params,
            }
        )


def reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
