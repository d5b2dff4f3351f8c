"""The connector's worker role (vLLM's model process): loads documents' chunks into
vLLM's blocks through the SDK's loader, reports the blocks that did not fill, captures
prompts' KV for publishing, and times vLLM's forward passes for the load budget."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from kvcdn.codec import IndexCache
from kvcdn.container import Part
from kvcdn.profile_store import ProfileCache

from ..loader import load_prefix_into
from ..planner import HarmonicPredictor, plan
from ..streaming import LayerGroups, failure_kind
from .config import ConnectorSetup
from .layout import PagedLayout, PagedTarget, write_capture
from .metadata import KvcdnMetadata, KvcdnWorkerMeta, LoadSpec

log = logging.getLogger(__name__)

#: A step that runs no model (the engine only waits for loads) waits this long for one
#: to finish: vLLM otherwise spins such steps, and its spinning thread starves the load's
#: threads of the GIL (a 0.1 s load took 10 s in an engine without multiprocessing).
IDLE_STEP_WAIT_S = 0.005
#: Forward passes of at least this many tokens are timed for the budget.
MIN_TIMED_TOKENS = 128


class KvcdnWorker:
    """The worker role of :class:`~kvcdn.sdk.vllm.KvcdnConnector`."""

    def __init__(self, setup: ConnectorSetup) -> None:
        self.setup = setup
        self.block_size = setup.block_size
        self._writer: PagedLayout | None = None
        self._load_pool = ThreadPoolExecutor(2, thread_name_prefix="kvcdn-load")
        self._done_lock = threading.Condition()
        self._done: dict[str, set[int]] = {}  # req_id -> blocks that failed
        self._in_flight = 0  # loads submitted, not finished
        self._failed_now: set[int] = set()
        self._profiles = ProfileCache()
        # a layer-ordered load reads each chunk's object once per group of layers (and a
        # tensor-parallel rank its heads): the object's index is fetched once
        self._indexes = IndexCache()
        self._predictor = HarmonicPredictor()
        self._prefill = _PrefillTimer()
        self._told: tuple[float | None, str | None] = (None, None)
        self._layered: list[_LayeredLoad] = []  # this step's layer-ordered loads

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        identity = self.setup.identity
        if not self.setup.active or identity is None:
            return
        try:
            self._writer = PagedLayout.detect(kv_caches, identity, self.block_size,
                                              _tensor_parallel_rank())  # fmt: skip
        except Exception as exc:
            self.setup.disable(str(exc))  # the scheduler stops claiming when it hears
            return
        # The decode kernels load, and the store opens, now: not on a request's clock.
        # The kernels in a thread Python joins at exit (a daemon thread inside torch
        # code at exit aborts the process).
        threading.Thread(target=self._writer.warm_up, name="kvcdn-warm-up").start()
        self.setup.open_reader_soon()

    def bind(self, meta: KvcdnMetadata) -> None:
        """The step's metadata, before its forward pass: timed from here to
        :meth:`get_finished`, after it."""
        self._prefill.start(meta.scheduled_tokens)

    def start_load_kv(self, meta: KvcdnMetadata) -> None:
        for spec in meta.loads:
            if spec.sync and (groups := self._layer_groups(spec)):
                # in layer order beside the forward pass, which waits per layer
                layered = _LayeredLoad(spec, groups)
                self._layered.append(layered)
                threading.Thread(target=self._load_layered, args=(layered,),
                                 name="kvcdn-layered-load", daemon=True).start()  # fmt: skip
            elif spec.sync:  # vLLM reads its failed blocks after this step's forward
                with self._prefill.paused():
                    self._failed_now |= self._load(spec)
            elif self._writer is None:
                self._finish(spec.req_id, spec.unfilled(spec.start, self.block_size))
            else:
                with self._done_lock:
                    self._in_flight += 1
                self._load_pool.submit(self._load_async, spec)

    def _load_async(self, spec: LoadSpec) -> None:
        failed = self._load(spec)
        with self._done_lock:
            self._in_flight -= 1
        self._finish(spec.req_id, failed)

    def _layer_groups(self, spec: LoadSpec) -> list[tuple[int, int]]:
        """The groups of this worker's layers a synchronous load of ``spec`` runs in, in
        order; none where it loads whole (one group asked for, or objects that cannot
        be read a layer at a time: version 1)."""
        groups = self.setup.config.layer_groups
        if self._writer is None or groups <= 1:
            return []
        chunk = self.setup.config.chunk_tokens
        first, end = spec.start // chunk, -(-spec.end // chunk)
        if any(ref.index is None for c in spec.manifest.chunks[first:end]
               for ref in c.objects.values()):  # fmt: skip
            return []
        layers = len(self._writer.caches)
        bounds = [layers * g // groups for g in range(min(groups, layers) + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def _load_layered(self, layered: _LayeredLoad) -> None:
        """One load over every group of layers, group by group: the forward pass starts
        on the first layers while later ones are read."""
        spec = layered.spec
        started = time.perf_counter()
        try:
            if spec.end > spec.start:
                # what a group leaves out (a chunk that failed, and those after it) is
                # left out of every group: vLLM computes it for every layer
                layered.failed |= self._load(spec, layered)
        except BaseException as exc:  # never leave the forward pass waiting
            log.error("kvcdn: layer-ordered load of request %s failed: %s", spec.req_id, exc)
            layered.failed |= spec.unfilled(spec.start, self.block_size)
        finally:
            layered.finish()
        log.info("kvcdn: request %s: loaded in %d layer groups in %.3f s, beside the forward "
                 "pass (%d bytes read)", spec.req_id, len(layered.groups),
                 time.perf_counter() - started, layered.nbytes)  # fmt: skip

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before this step's forward pass computes ``layer_name``'s attention: wait until
        the step's layer-ordered loads hold that layer."""
        if not self._layered or self._writer is None:
            return
        m = re.search(r"layers\.(\d+)\.", layer_name)
        if m is None:
            return
        local = int(m.group(1)) - self._writer.part.layers[0]
        with self._prefill.paused():
            for layered in self._layered:
                layered.wait(local)
                layered.waited = max(layered.waited, local)

    def _collect_layered(self) -> None:
        """After the forward pass: every layer-ordered load of the step has ended (the
        last layer waited for it); their unfilled blocks go to vLLM as failed."""
        for layered in self._layered:
            layered.wait(None)
            self._failed_now |= layered.failed
            if layered.waited < layered.groups[-1][1] - 1:
                # the forward pass did not wait for every layer (a path of vLLM that
                # skips the hook): what it read may not have been loaded yet, so vLLM
                # computes every claimed block again
                log.warning("kvcdn: request %s: vLLM's forward did not wait for the "
                            "layer-ordered load; its blocks are recomputed",
                            layered.spec.req_id)  # fmt: skip
                self._failed_now |= layered.spec.unfilled(layered.spec.start, self.block_size)
        self._layered = []

    def _load(self, spec: LoadSpec, layered: _LayeredLoad | None = None) -> set[int]:
        """Load ``spec`` into the worker's layers (in ``layered``'s groups, in order,
        when given) within its deadline; the ids of the blocks it did not fill."""
        identity = self.setup.identity
        writer = self._writer
        if writer is None or identity is None:
            return spec.unfilled(spec.start, self.block_size)
        target: PagedTarget | LayerGroups
        if layered is None:
            target = PagedTarget(writer, spec)
        else:
            target = LayerGroups(
                tuple(PagedTarget(writer.layers(first, end), spec)
                      for first, end in layered.groups),
                loaded=lambda g: layered.advance(layered.groups[g][1]),
            )  # fmt: skip
        loaded_to = spec.start
        chunk = self.setup.config.chunk_tokens
        first_chunk, end_chunk = spec.start // chunk, -(-spec.end // chunk)
        started = time.perf_counter()
        try:
            result = load_prefix_into(
                target,
                spec.manifest,
                self.setup.reader(spec.tenant),
                chunks=(first_chunk, end_chunk),
                quality=spec.quality,
                device=writer.device,
                predictor=self._predictor,
                policy=plan,
                profiles=self._profiles,
                fingerprint=identity.fingerprint,
                deadline_s=spec.deadline_s,
                indexes=self._indexes,
            )
            loaded_to = min(spec.end, (first_chunk + result.loaded_chunks) * chunk)
            if layered is not None:
                layered.nbytes += sum(c.bytes for c in result.chunks)
            # tokens are counted by the scheduler, once for every worker
            self.setup.stats_of(spec.tenant).load(
                result.chunks, time.perf_counter() - started,
                refinements_dropped=result.refinements_dropped, loaded_tokens=0,
            )  # fmt: skip
        except Exception as exc:
            log.warning("kvcdn: loading %s for request %s failed: %s", spec.manifest.ref,
                        spec.req_id, exc)  # fmt: skip
            self.setup.stats_of(spec.tenant).inc("kvcdn_recomputed_chunks",
                                                 end_chunk - first_chunk,
                                                 reason=failure_kind(exc))  # fmt: skip
        failed = spec.unfilled(loaded_to, self.block_size)
        if failed:
            log.info("kvcdn: request %s: %d of %d tokens loaded; vLLM computes the rest",
                     spec.req_id, max(loaded_to - spec.start, 0),
                     spec.end - spec.start)  # fmt: skip
        return failed

    def _finish(self, req_id: str, failed_blocks: set[int]) -> None:
        with self._done_lock:
            self._done[req_id] = failed_blocks
            self._done_lock.notify_all()

    def wait_for_save(self, meta: KvcdnMetadata) -> None:
        if self._writer is None:
            return
        for spec in meta.captures:
            try:
                layout = self.setup.identity.layout  # active: identity is known
                write_capture(self._writer.read(spec.block_ids, spec.tokens), spec.path,
                              self._writer.part, Part.whole(layout.layers, layout.kv_heads))
            except Exception as exc:
                log.error("kvcdn: capturing request %s failed: %s", spec.req_id, exc)

    def get_finished(self, meta: KvcdnMetadata | None) -> tuple[set[str] | None, set[str] | None]:
        self._collect_layered()
        idle = meta is not None and meta.idle
        self._prefill.stop()
        with self._done_lock:
            if idle and self._in_flight and not self._done:
                self._done_lock.wait(IDLE_STEP_WAIT_S)
            done, self._done = self._done, {}
        for blocks in done.values():
            self._failed_now |= blocks
        return None, (set(done) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._collect_layered()
        failed, self._failed_now = self._failed_now, set()
        return failed

    def build_connector_worker_meta(self) -> KvcdnWorkerMeta | None:
        """vLLM's prefill speed when it changed, and why this worker cannot load."""
        news = (self._prefill.seconds_per_token, self.setup.disabled)
        if news == self._told:
            return None
        self._told = news
        return KvcdnWorkerMeta(*news)

    def shutdown(self) -> None:
        self._load_pool.shutdown(wait=False, cancel_futures=True)


class _LayeredLoad:
    """A synchronous load run in groups of layers: how far it has come, for the forward
    pass to wait on, and the blocks any group left unfilled."""

    def __init__(self, spec: LoadSpec, groups: list[tuple[int, int]]) -> None:
        self.spec = spec
        self.groups = groups
        self.failed: set[int] = set()
        self.nbytes = 0  # read by its groups
        self.waited = -1  # the last layer the forward pass waited for
        self._loaded = 0  # the worker's layers [0, loaded) are in (or given up)
        self._ended = False
        self._cond = threading.Condition()

    def advance(self, layers: int) -> None:
        with self._cond:
            self._loaded = layers
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, layer: int | None) -> None:
        """Until ``layer`` is in (None: until the whole load has ended)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended or (layer is not None
                                                          and layer < self._loaded))  # fmt: skip


def _tensor_parallel_rank() -> tuple[int, int]:
    """This worker's tensor-parallel (rank, size) in vLLM's process group."""
    from vllm.distributed import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())  # fmt: skip


class _PrefillTimer:
    """vLLM's forward passes, timed on the worker from ``bind_connector_metadata`` (before
    the forward) to ``get_finished`` (after it), less the synchronous loads between:
    the seconds a token of prefill takes, a moving average of passes of at least
    :data:`MIN_TIMED_TOKENS` tokens (on a GPU, the host's view of them)."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None
        self._started: float | None = None
        self._tokens = 0
        self._excluded = 0.0

    def start(self, tokens: int) -> None:
        self._started, self._tokens, self._excluded = time.perf_counter(), tokens, 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - t

    def stop(self) -> None:
        if self._started is None or self._tokens < MIN_TIMED_TOKENS:
            self._started = None
            return
        sample = (time.perf_counter() - self._started - self._excluded) / self._tokens
        self._started = None
        if sample <= 0:
            return
        old = self.seconds_per_token
        self.seconds_per_token = sample if old is None else 0.7 * old + 0.3 * sample
