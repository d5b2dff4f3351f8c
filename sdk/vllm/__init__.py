"""kvcdn inside vLLM: a KV connector that loads published documents into vLLM's paged
KV cache, and captures vLLM's prefill for publishing.

Configure it with vLLM's ``--kv-transfer-config`` (docs/vllm.md)::

    {"kv_connector": "KvcdnConnector", "kv_connector_module_path": "kvcdn.sdk.vllm",
     "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"store": "s3://bucket/kv", "edges": ["http://edge:8080"]}}

How a request meets kvcdn. The scheduler (vLLM's engine-core process) hashes
the prompt's first ``chunk_tokens`` tokens as kvcdn chains chunk hashes, and
looks that hash up once in the store's prefix index (one small read, cached;
the request waits for it at most ``lookup_timeout_s``). A manifest found is
checked against the served model like every load, and the tokens the prompt
shares with the document, less at least one and rounded down to vLLM's block
size, are claimed. The worker (vLLM's model process) fetches those chunks
through the SDK's loader (edges with failover, every object verified against its
manifest before it is decoded) and decodes them into the blocks vLLM allocated,
in vLLM's layout. A chunk
that fails, or that is not in by the load's deadline, ends the load: its blocks and
all after it are reported to vLLM as failed, and vLLM recomputes them
(``kv_load_failure_policy`` ``recompute``). Nothing unverified is written, so
nothing wrong enters vLLM's prefix cache. kvcdn never makes the engine fail:
anything unexpected in the connector is logged and the request is computed by
vLLM.

A load never makes a request much slower than vLLM without kvcdn. Its deadline
is ``deadline_s`` (or the request's ``kvcdn_deadline_s``), else a budget: what
vLLM's own prefill of the claimed tokens is predicted to take, from its forward
passes as the workers measure them (:data:`~.scheduler.PRIOR_PREFILL_TOKENS_PER_S` before
the first), and at least :data:`~.scheduler.MIN_LOAD_BUDGET_S`. Every read is given up at
that deadline (:class:`~kvcdn.sdk.bounded.BoundedReader`: a hung mount or an
endpoint that never answers holds a thread, not the load), an edge that fails is
skipped for a while (the edge reader's circuit breaker), and a lookup the store
does not answer in ``lookup_timeout_s`` pauses lookups for
:data:`~.scheduler.LOOKUP_PAUSE_S`, so later requests do not wait for it.

Two ways to load (``load_mode``). *async*: the request waits in
``WAITING_FOR_REMOTE_KVS`` while the load runs beside the engine, which keeps
serving other requests; right when bytes cross a link. *sync*: the load runs
inside the step that first computes the request, as vLLM's own ExampleConnector
does: no extra scheduler steps and no idle steps polling for the load, but every
request in that step waits for it; right when the bytes are on a local disk
(tens of milliseconds, less than the prefill it replaces). ``auto`` (the default)
loads a local folder store without edges synchronously and everything else
asynchronously.

Producer (``kv_producer``/``kv_both``): a request whose ``kv_transfer_params``
hold ``{"kvcdn_capture": ID}`` has its prompt's KV copied out of vLLM's blocks
when its prefill completes, to ``{capture_dir}/{ID}.safetensors``;
:class:`VllmPrefill` drives this for ``kvcdn publish --engine vllm``.

The package, by role as vLLM's own connectors are: :mod:`.connector` (the class vLLM
instantiates, handing each call to a role), :mod:`.scheduler`, :mod:`.worker`,
:mod:`.layout` (vLLM's paged KV memory and the load's target), :mod:`.metadata`
(what the roles tell each other), :mod:`.config` and :mod:`.producer`.
"""

from .config import (
    CAPTURE_PARAM,
    DEADLINE_PARAM,
    LOAD_MODE_PARAM,
    LOAD_MODES,
    LOAD_PARAM,
    QUALITY_PARAM,
    ConnectorConfig,
)
from .connector import KvcdnConnector
from .metadata import unfilled_blocks
from .producer import VllmPrefill, engine_dtype, producer_config

__all__ = [
    "CAPTURE_PARAM",
    "DEADLINE_PARAM",
    "LOAD_MODES",
    "LOAD_MODE_PARAM",
    "LOAD_PARAM",
    "QUALITY_PARAM",
    "ConnectorConfig",
    "KvcdnConnector",
    "VllmPrefill",
    "engine_dtype",
    "producer_config",
    "unfilled_blocks",
]
