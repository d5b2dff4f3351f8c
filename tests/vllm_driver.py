"""One real vLLM engine with kvcdn's connector, driven over stdin/stdout by the tests.

vLLM starts in 20-40 s on these CPUs, so the suite starts one engine per
session in this process (vLLM needs its own processes: it spawns its engine
core and worker) and sends it requests. Each request is one JSON line on stdin;
each reply is one line on stdout starting with ``REPLY`` (vLLM's own logging
goes to stderr and stdout too).

Usage: ``python tests/vllm_driver.py CONFIG_JSON`` where the config names the
model folder, the connector's ``kv_connector_extra_config``, the capture folder
and, optionally, ``tensor_parallel_size``, ``pipeline_parallel_size``, ``dtype``,
``max_model_len`` and ``compilation_config`` (given, it replaces ``enforce_eager``:
pipeline stages after the first need vLLM's warm-up run, which eager mode skips on
CPU). A request may bring ``beside``: more prompts (kvcdn kept out of them)
scheduled with it in one batch; their replies come in ``beside``; ``cache_salt`` is the
request's vLLM cache salt.
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
    options = {}
    if "compilation_config" in config:  # pipeline stages need vLLM's warm-up, never eager
        options["compilation_config"] = config["compilation_config"]
    else:
        options["enforce_eager"] = True
    llm = LLM(
        model=config["folder"],
        kv_transfer_config=transfer,
        block_size=256,
        max_model_len=config.get("max_model_len", 8192),
        enable_prefix_caching=True,
        seed=0,
        tensor_parallel_size=config.get("tensor_parallel_size", 1),
        pipeline_parallel_size=config.get("pipeline_parallel_size", 1),
        dtype=config.get("dtype", "auto"),
        **options,
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
        plain = SamplingParams(
            max_tokens=ask.get("max_tokens", 32), temperature=0.0, logprobs=ask.get("logprobs", 20),
            extra_args={"kv_transfer_params": {"kvcdn_load": False}},
        )  # fmt: skip
        beside = ask.get("beside") or []
        prompts = [{"prompt_token_ids": ids} for ids in [ask["prompt_ids"], *beside]]
        if ask.get("cache_salt") is not None:  # vLLM's tenant isolation of cached prefixes
            prompts[0]["cache_salt"] = ask["cache_salt"]
        t = time.perf_counter()
        outs = llm.generate(prompts, [sampling] + [plain] * len(beside), use_tqdm=False)
        seconds = time.perf_counter() - t
        answer = described(outs[0], seconds)
        answer["capture"] = params.get(CAPTURE_PARAM)
        answer["beside"] = [described(o, seconds) for o in outs[1:]]
        reply(answer)


def described(out, seconds: float) -> dict:
    completion = out.outputs[0]
    first = completion.logprobs[0] if completion.logprobs else {}
    return {
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "num_cached_tokens": out.num_cached_tokens,
        "seconds": seconds,  # the whole batch's
        # the first answer token's top logprobs (token id -> logprob)
        "first_logprobs": {str(k): v.logprob for k, v in first.items() if math.isfinite(v.logprob)},
        "kv_transfer_params": out.kv_transfer_params,
    }


def reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
