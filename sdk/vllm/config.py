"""The connector's configuration (``kv_connector_extra_config``), the per-request
parameters it reads from ``kv_transfer_params``, and what both roles set up from them:
the model the KV is for, the trust policy, and the reader (opened once)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcdn.errors import ArgumentError, KvcdnError
from kvcdn.kv import DEFAULT_CHUNK_TOKENS
from kvcdn.models import ModelIdentity, model_identity
from kvcdn.signing import TrustPolicy

from .. import checks
from ..bounded import BoundedReader
from ..loader import AUTO, open_reader

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

#: ``kv_transfer_params`` key of a request whose prompt KV is to be captured.
CAPTURE_PARAM = "kvcdn_capture"
#: ``kv_transfer_params`` key that, set to false, keeps kvcdn out of one request.
LOAD_PARAM = "kvcdn_load"
#: ``kv_transfer_params`` key: the quality (a level, or auto) one request loads at.
QUALITY_PARAM = "kvcdn_quality"
#: ``kv_transfer_params`` key: one request's load deadline in seconds.
DEADLINE_PARAM = "kvcdn_deadline_s"
#: ``kv_transfer_params`` key: how one request is loaded (one of LOAD_MODES).
LOAD_MODE_PARAM = "kvcdn_load_mode"
LOAD_MODES = ("auto", "sync", "async")


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, checked once."""

    store: str | None = None  # where manifests and objects are (a folder, s3://...)
    endpoint_url: str | None = None  # an S3 endpoint other than AWS's
    edges: list[str] | None = None  # edge caches to read objects through, in front of store
    edge_token: str | None = None
    trust: str | None = None  # a trust file: manifests must be signed by its keys
    model: str | None = None  # the kvcdn model name (default: the model vLLM serves)
    quality: str = AUTO  # a level, or auto
    deadline_s: float | None = None  # a load not in by then is left to vLLM's prefill
    load_mode: str = "auto"  # sync, async, or auto: sync for a local folder without edges
    lookup_timeout_s: float = 2.0  # a request waits this long for a document lookup
    lookup_ttl_s: float = 30.0  # a lookup's answer (found or not) is reused this long
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the chunk size documents were published with
    capture_dir: str | None = None  # producer: where captured prompt KV is written
    #: A synchronous load of sectioned objects runs in this many groups of layers, in
    #: layer order, beside the forward pass, which waits per layer (1: whole, before it;
    #: docs/vllm.md says when more pays).
    layer_groups: int = 1

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise KvcdnError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        config = cls(**extra)
        checks.optional_string(config.store, "store")
        checks.optional_string(config.endpoint_url, "endpoint_url")
        checks.optional_string(config.edge_token, "edge_token")
        checks.optional_string(config.trust, "trust")
        checks.optional_string(config.model, "model")
        checks.optional_string(config.capture_dir, "capture_dir")
        if config.edges is not None and (
            not isinstance(config.edges, list) or not all(isinstance(e, str) for e in config.edges)
        ):
            raise KvcdnError("edges must be a list of edge URLs")
        if not isinstance(config.quality, str) or not config.quality:
            raise KvcdnError("quality must be a level name or 'auto'")
        if config.load_mode not in LOAD_MODES:
            raise KvcdnError(f"load_mode must be one of {', '.join(LOAD_MODES)}")
        for key in ("deadline_s", "lookup_timeout_s", "lookup_ttl_s"):
            value = getattr(config, key)
            if value is not None and seconds(value, zero=key == "lookup_ttl_s") is None:
                raise KvcdnError(f"{key} must be a positive number of seconds")
        if type(config.chunk_tokens) is not int or config.chunk_tokens < 16:
            raise KvcdnError("chunk_tokens must be an integer of at least 16")
        if type(config.layer_groups) is not int or not 1 <= config.layer_groups <= 1024:
            raise KvcdnError("layer_groups must be an integer from 1 to 1024")
        return config


def seconds(value: Any, *, zero: bool = False) -> float | None:
    """``value`` as a number of seconds (positive; or zero too), or None if it is not one."""
    if zero and value == 0 and not isinstance(value, bool):
        return 0.0
    try:
        return checks.deadline(value)
    except ArgumentError:
        return None


class ConnectorSetup:
    """What both roles set up from vLLM's configuration: the checked configuration, the
    model the KV is for, the trust policy, and the reader (opened once, on first use).

    Anything wrong disables the connector, with one log line saying why: vLLM then
    serves as if kvcdn were absent (:attr:`disabled` holds the reason)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        self.block_size: int = vllm_config.cache_config.block_size
        self.loads_enabled = bool(transfer.is_kv_consumer)
        self.captures_enabled = bool(transfer.is_kv_producer)
        self.config = ConnectorConfig()
        self.identity: ModelIdentity | None = None
        self.trust: TrustPolicy | None = None
        self.disabled: str | None = None
        self._reader: BoundedReader | None = None
        self._reader_lock = threading.Lock()
        try:
            self.config = ConnectorConfig.parse(dict(transfer.kv_connector_extra_config or {}))
            self.identity = model_identity(self.config.model or vllm_config.model_config.model)
            if self.config.trust:
                self.trust = TrustPolicy.from_file(self.config.trust)
            if self.config.chunk_tokens % self.block_size:
                raise KvcdnError(
                    f"vLLM's block size {self.block_size} does not divide kvcdn's chunk size "
                    f"{self.config.chunk_tokens}: set --block-size to a divisor of it"
                )
            if self.loads_enabled and transfer.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvcdn: kv_load_failure_policy is %r; with 'recompute' vLLM recomputes a "
                    "chunk kvcdn cannot load instead of failing the request",
                    transfer.kv_load_failure_policy,
                )
            if self.identity.unsupported:
                raise KvcdnError(f"{self.identity.name}: {self.identity.unsupported}")
        except Exception as exc:  # the engine runs on without kvcdn, and says why
            self.disable(str(exc))

    @property
    def active(self) -> bool:
        """The connector loads or captures (it was not disabled)."""
        return self.identity is not None and self.disabled is None

    def disable(self, reason: str) -> None:
        if self.disabled is None:
            log.error("kvcdn connector disabled: %s", reason)
        self.disabled = reason

    def reader(self) -> BoundedReader:
        with self._reader_lock:
            if self._reader is None:
                c = self.config
                self._reader = open_reader(
                    c.store, endpoint_url=c.endpoint_url, edges=c.edges,
                    edge_token=c.edge_token, trust=self.trust,
                )  # fmt: skip
            return self._reader

    def open_reader_soon(self) -> None:
        """Open the reader in a daemon thread: not on a request's clock (an exit need not
        wait for it; the first load meets an error there, and says so)."""

        def run() -> None:
            try:
                self.reader()
            except Exception as exc:
                log.warning("kvcdn: cannot open %s yet: %s", self.config.store, exc)

        threading.Thread(target=run, name="kvcdn-open", daemon=True).start()
