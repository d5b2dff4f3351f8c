"""The loading pipeline: fetch, decode and recompute a document's chunks, re-planning as it goes.

Three kinds of work overlap:
- fetches, a few at a time (``concurrency``), in document order, each read
  in pieces so the link's throughput is measured while it runs and a fetch
  can be cancelled;
- decoding, on the device, straight into the chunk's slice of the cache tensor;
- recomputing ``text`` chunks, on the device, with the chunks before them
  (already in the cache) as context.

One device thread runs the decodes and recomputes, one at a time, as a GPU
stream would. The calling thread is the controller: it plans, launches work,
feeds the throughput predictor, and plans again once a chunk has completed, when
the plan is next used (a fetch or a recompute about to start).
When a fetch in flight can no longer make the deadline and dropping it gives
a faster plan, it is cancelled and its chunk planned again (a lower level or
``text``).

An engine's layer-ordered load (:class:`LayerGroups`) is one pipeline over (group of
layers, chunk) items, group by group: its "chunks" below are those items, and a
chunk given up is given up in every group.

An object that cannot be had (missing, as after a gc, damaged, from a store
or an edge that failed, or not in by the deadline) is treated like a late
one: its level is dropped for that chunk, which is planned again (another
stored level where the deadline allows, otherwise ``text``). An engine's load
(``partial``) instead leaves that chunk and the rest to the engine.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, ClassVar

from kvcdn.codec import IndexCache, PartRead, decode_into, read_more, read_part
from kvcdn.codecs import TensorDest
from kvcdn.container import Part
from kvcdn.errors import DeadlineExceeded, FormatError, KvcdnError, NotFound, TrustError
from kvcdn.manifest import ChunkEntry, Manifest, ObjectRef
from kvcdn.models import LoadedModel
from kvcdn.store import Cancel, FetchCancelled, Reader

from . import daemons
from .devspeed import DeviceSpeed
from .planner import (
    TEXT,
    Busy,
    ChunkChoice,
    Option,
    Plan,
    Policy,
    Refinement,
    ThroughputPredictor,
    next_refinement,
)
from .targets import KVTarget

if TYPE_CHECKING:

    from kvcdn.codec_profile import CodecProfile

log = logging.getLogger(__name__)

#: A chunk a partial load gave up (a failure, or the give-up time): it and every
#: later chunk are left for the engine to compute.
SKIPPED = "skipped"
TICK_S = 0.02  # how often the controller looks at the link when nothing else happens
SAMPLE_BYTES = 256 << 10  # a throughput sample spans at least this many bytes ...
SAMPLE_MAX_S = 0.5  # ... or this long (nothing arriving for this long is a stall)
CANCEL_GAIN = 0.9  # cancel a fetch only when dropping it is predicted 10% faster
#: At most this share of a load's time goes to plans made again for its progress
#: alone (an item arrived or was decoded), at what a plan costs an item still to plan
#: (measured on 2 CPUs: ~1 ms for 500): a load of 500 items (125 chunks in 4 groups of
#: layers) that planned after each of its ~1,000 events spent a second on it; a load
#: of 16 chunks still plans after nearly every event. A plan known to be wrong is made
#: at once.
PLAN_SHARE = 0.05
PLAN_S_PER_ITEM = 2e-6


@dataclass
class ChunkReport:
    """How one chunk was loaded. Times are seconds from the start of the load."""

    index: int
    tokens: int
    level: str  # the level it was decoded from, "text" (recomputed), or "skipped"
    source: str  # an edge URL, "origin", the store's URL, or "text"
    bytes: int
    start_s: float  # its (last) fetch or its recompute began
    ready_s: float  # its KV was in the cache
    quality: float = 1.0  # the level's quality score (1.0: exact)
    abandoned: list[str] = field(default_factory=list)  # levels whose fetch was cancelled
    #: "level: why" for each level whose object could not be used (missing, damaged,
    #: unreachable, late): the chunk was loaded another way (or, where a refinement to
    #: that level failed, kept the level it held).
    failed: list[str] = field(default_factory=list)
    #: The levels it held before refinements raised it to ``level``, in order (a
    #: nested object's further tiers, fetched once it was loaded).
    refined_from: list[str] = field(default_factory=list)
    #: Why a chunk recomputed or skipped was not loaded (:data:`RECOMPUTE_REASONS`); ""
    #: for a loaded one.
    recompute_reason: str = ""


#: Why a chunk is recomputed (by the engine, or from its tokens) instead of loaded: its
#: object was missing, damaged, untrusted, unreachable, or late; the plan found computing
#: it cheaper; an earlier chunk of an engine's prefix failed (what follows it is computed).
RECOMPUTE_REASONS = ("missing", "corrupt", "refused", "unreachable", "late", "planned",
                     "after_failure")  # fmt: skip


@dataclass
class PipelineResult:
    chunks: list[ChunkReport]
    predicted_s: float  # the first plan's estimate of the load
    feasible: bool  # the first plan expected to meet the deadline
    replans: int
    cancelled: int
    loaded_chunks: int  # the first loaded_chunks chunks of the range are in the target
    refined: int = 0  # refinements that raised a loaded chunk's level
    refinements_dropped: int = 0  # refinements started but not finished (late, failed)


class _State(Enum):
    PENDING = "pending"
    FETCHING = "fetching"
    FETCHED = "fetched"
    DEVICE = "device"
    DONE = "done"
    SKIPPED = "skipped"  # a partial load gave it up


@dataclass
class _Chunk:
    """One item of the pipeline: a chunk, or in a layer-ordered load one group of a
    chunk's layers."""

    entry: ChunkEntry
    key: int = 0  # its place in the pipeline's items (the planner's name for it)
    group: int = 0  # its group of layers (:class:`LayerGroups`), else 0
    state: _State = _State.PENDING
    planned: Option | None = None
    option: Option | None = None  # what is being (or was) fetched or recomputed
    received: int = 0
    attempt: int = 0  # events from an abandoned fetch carry an older attempt
    cancel: Cancel = field(default_factory=Cancel)
    data: bytes | PartRead = b""  # the whole object, or the part the target holds
    part_bytes: int = 0  # what a part read fetched (its index and sections)
    source: str = ""
    start_s: float = 0.0
    ready_s: float = 0.0
    abandoned: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unusable: set[str] = field(default_factory=set)  # levels that failed for this chunk
    why: str = ""  # the kind of its last failure (failure_kind)
    # refinement (a loaded chunk of a nested object raised to a better level)
    held: PartRead | None = None  # its read, kept while a refinement may extend it
    refining: Option | None = None  # the level a refinement under way brings it to
    refine_cancel: Cancel | None = None
    refine_read: PartRead | None = None  # the refinement's read, once fetched
    refine_stage: str = ""  # "fetching", "fetched" (waiting for the device), "decoding"
    refine_started: float = 0.0  # when its refinement's fetch started (perf_counter)
    refined_from: list[str] = field(default_factory=list)


_ENDED = (_State.DONE, _State.SKIPPED)


class _Items:
    """The pipeline's items in order, and what its controller asks of them on every
    turn, kept as items change state instead of scanned for: how many are in each
    state, the first not ended, how many have ended in each group of layers. A load of
    128 chunks (32K tokens) in 4 groups of layers has 512 items and about two turns
    an item; its scans had cost the controller a quarter of a second at 500 items.

    Every change of an item's state goes through :meth:`move`."""

    def __init__(self, chunks: list[_Chunk], groups: int, per_group: int) -> None:
        self.all = chunks
        self.per_group = per_group
        self.count = Counter(c.state for c in chunks)
        self._ended_in = [0] * groups
        for c in chunks:
            self._ended_in[c.group] += c.state in _ENDED
        self._first_open = 0
        self.chunk_major = False  # a layer-ordered load past hope of its deadline

    def move(self, c: _Chunk, state: _State) -> None:
        self.count[c.state] -= 1
        self.count[state] += 1
        self._ended_in[c.group] += (state in _ENDED) - (c.state in _ENDED)
        c.state = state

    def open(self) -> bool:
        """Whether an item has not ended."""
        return self.count[_State.DONE] + self.count[_State.SKIPPED] < len(self.all)

    def first_open(self) -> int:
        """The place of the first item not ended (``len`` when all have): ended items
        never reopen, so the search resumes where it stopped."""
        i = self._first_open
        while i < len(self.all) and self.all[i].state in _ENDED:
            i += 1
        self._first_open = i
        return i

    def from_first_open(self) -> Iterator[_Chunk]:
        return itertools.islice(self.all, self.first_open(), None)

    def to_chunk_major(self) -> None:
        """Put the items in document order, each chunk's groups together, and name
        each by its new place (the planner's name for it)."""
        self.chunk_major = True
        self.all.sort(key=lambda c: (c.entry.index, c.group))
        for place, c in enumerate(self.all):
            c.key = place
        self._first_open = 0

    def group_ended(self, g: int) -> bool:
        return self._ended_in[g] == self.per_group


@dataclass(frozen=True)
class _Fetched:
    """A fetch of ``chunk`` ended: its bytes are in the chunk (``cancelled``: it stopped
    because it was cancelled). ``attempt`` tells an abandoned fetch's late news apart."""

    chunk: _Chunk
    attempt: int
    cancelled: bool = False


@dataclass(frozen=True)
class _DeviceDone:
    """The device finished decoding or recomputing ``chunk`` in ``seconds``."""

    chunk: _Chunk
    seconds: float


@dataclass(frozen=True)
class _RefineEvent:
    """A refinement of ``chunk``: its fetch ended (``seconds`` None) or its decode did;
    ``error`` set where it failed (the chunk keeps the level it has)."""

    chunk: _Chunk
    cancel: Cancel  # the refinement's own: news of one dropped earlier is ignored
    seconds: float | None = None
    error: BaseException | None = None
    read: PartRead | None = None  # what the fetch read


@dataclass(frozen=True)
class _Failed:
    """Work on ``chunk`` raised ``error`` (its fetch number ``attempt``, or its device
    work when None); the controller plans the chunk again, or raises it."""

    chunk: _Chunk
    error: BaseException
    attempt: int | None = None


_Event = _Fetched | _DeviceDone | _Failed | _RefineEvent


def failure_reason(error: KvcdnError, key: str = "") -> str:
    """Why the object ``key`` could not be used, in a few words (the log has the error)."""
    if isinstance(error, NotFound):
        return "missing from the store"
    if isinstance(error, DeadlineExceeded):
        return "not in by the deadline"
    if isinstance(error, (FormatError, TrustError)):
        return f"damaged ({_first_line(error, key)})"
    return f"could not be read ({_first_line(error, key)})"


def failure_kind(error: BaseException) -> str:
    """A failure as one of :data:`RECOMPUTE_REASONS`."""
    if isinstance(error, NotFound):
        return "missing"
    if isinstance(error, DeadlineExceeded):
        return "late"
    if isinstance(error, TrustError):
        return "refused"
    if isinstance(error, FormatError):
        return "corrupt"
    return "unreachable"


def _first_line(error: BaseException, key: str, limit: int = 160) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if key:
        text = text.replace(f"object {key}", "it").replace(key, "it")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _LinkMeter:
    """Turns the bytes arriving over all fetches into throughput samples.

    The link is shared by the fetches in flight, so a sample is the bytes
    that arrived while any fetch was running over that time, not one
    fetch's own rate.
    """

    def __init__(self, predictor: ThroughputPredictor) -> None:
        self.predictor = predictor
        self._lock = threading.Lock()
        self._bytes = 0
        self._since: float | None = None  # None: no fetch running

    def add(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    def start(self, now: float) -> None:
        """A fetch starts: if the link was idle, a sample window opens now."""
        if self._since is None:
            with self._lock:
                self._bytes = 0
            self._since = now

    def tick(self, now: float, active: bool) -> None:
        """Emit a sample when the window holds enough; close it when the link goes idle."""
        if self._since is None:
            return
        span = now - self._since
        with self._lock:
            nbytes = self._bytes
            due = (
                (nbytes >= SAMPLE_BYTES and span >= TICK_S)
                or span >= SAMPLE_MAX_S
                or (not active and nbytes > 0 and span >= TICK_S)
            )
            if due:
                self._bytes = 0
        if due:
            self.predictor.observe(nbytes, span)
            self._since = now
        if not active:
            self._since = None


@dataclass(frozen=True)
class LoadOptions:
    """What a load may fetch, and by when (``perf_counter`` seconds)."""

    levels: tuple[str, ...]  # the stored levels it may fetch
    quality_of: Mapping[str, float]  # each level's quality score (``text``'s too)
    deadline_at: float | None = None  # the plan aims to have every chunk in by then
    fetch_deadline: float | None = None  # every fetch ends by then: one not in fails
    concurrency: int = 4  # fetches in flight
    #: A fetch that can no longer make ``deadline_at`` is abandoned and its chunk
    #: planned again (False for policies that never revisit a choice).
    cancel_late_fetches: bool = True
    failed_levels: Mapping[str, str] = field(default_factory=dict)  # unusable: level -> why
    #: With a deadline, once every chunk has its level, raise chunks of nested objects
    #: to better levels (fetching only the tiers they lack) while the deadline allows.
    refine: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {self.concurrency}")


@dataclass(frozen=True)
class LayerGroups:
    """A target's layers in groups, loaded in that order (layer-ordered delivery):
    one pipeline over (group, chunk) items, group by group, so that the first groups
    are in while later ones are read. ``loaded(g)`` is called once groups ``0..g``
    hold every chunk they will (loaded, or given up with the chunks after it)."""

    targets: tuple[KVTarget, ...]
    loaded: Callable[[int], None]

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("a layer-ordered load needs at least one group of layers")


@dataclass(frozen=True)
class _Group:
    """Where one group of items is decoded: its target, the part of each chunk's KV
    the target holds (None: all of it), and that part's share of the KV."""

    target: KVTarget
    part: Part | None
    share: float


@dataclass(frozen=True)
class AppLoad:
    """An app's load: every chunk ends in the target. A level that fails for a chunk is
    dropped and the chunk planned again (another level, or recomputed by ``loaded``)."""

    loaded: LoadedModel
    allow_text: bool  # the planner may recompute chunks it could fetch

    partial: ClassVar[bool] = False
    give_up_at: ClassVar[float | None] = None
    indexes: ClassVar[IndexCache | None] = None  # each object is read once

    @property
    def device(self) -> str:
        return self.loaded.device

    def chunk_range(self, chunks: int) -> tuple[int, int]:
        return 0, chunks


@dataclass(frozen=True)
class EngineLoad:
    """An engine's load: the longest run of chunks ``[first, end)`` that arrives,
    verifies and decodes by ``give_up_at``; a chunk that fails ends it, and the engine
    computes what is left. Nothing is recomputed here."""

    chunks: tuple[int, int]
    give_up_at: float | None
    device: str
    #: The engine's checked indexes: a layer-ordered load reads each object in several
    #: parts, and fetches its index once.
    indexes: IndexCache | None = None

    partial: ClassVar[bool] = True
    loaded: ClassVar[None] = None
    allow_text: ClassVar[bool] = False

    def chunk_range(self, chunks: int) -> tuple[int, int]:
        return self.chunks


class Pipeline:
    """Loads ``manifest``'s chunks into ``target`` by ``policy``, as ``mode`` says;
    into each group of a :class:`LayerGroups` in turn (an engine's load only)."""

    def __init__(
        self,
        manifest: Manifest,
        target: KVTarget | LayerGroups,
        reader: Reader,
        profile: CodecProfile | None,
        speed: DeviceSpeed,
        predictor: ThroughputPredictor,
        policy: Policy,
        options: LoadOptions,
        mode: AppLoad | EngineLoad,
    ) -> None:
        self.manifest = manifest
        self.mode = mode
        self.options = options
        self.layer_groups = target if isinstance(target, LayerGroups) else None
        if self.layer_groups is not None and not mode.partial:
            raise ValueError("only an engine's load runs in groups of layers")
        targets = (target,) if self.layer_groups is None else self.layer_groups.targets
        self.groups = [_group(manifest, t) for t in targets]
        self._settled = 0  # groups whose items have all ended (told to ``layer_groups``)
        self.reader = reader
        self.placement = manifest.chain_hash  # a document's objects are served together
        self.profile = profile
        self.speed = speed
        self.predictor = predictor
        self.policy = policy
        self.cancel_late_fetches = options.cancel_late_fetches and options.deadline_at is not None
        first, end = mode.chunk_range(len(manifest.chunks))
        entries = manifest.chunks[first:end]
        self.per_group = len(entries)
        # group by group, each in document order: fetches start in this order
        self.chunks = [_Chunk(e, key=g * len(entries) + i, group=g)
                       for g in range(len(self.groups)) for i, e in enumerate(entries)]  # fmt: skip
        self.items = _Items(self.chunks, len(self.groups), len(entries))
        self._of_chunk: dict[int, list[_Chunk]] = {}  # a chunk's items, one a group
        for c in self.chunks:
            self._of_chunk.setdefault(c.entry.index, []).append(c)
        for level, why in options.failed_levels.items():
            for c in self.chunks:
                c.unusable.add(level)
                c.failed.append(f"{level}: {why}")
        self.meter = _LinkMeter(predictor)
        self.events: queue.Queue[_Event] = queue.Queue()
        # device costs as measured, corrected by what the device work of this load (and
        # of the loads before it with this speed) takes
        self.decode_factor = speed.decode_factor
        self.recompute_factor = speed.recompute_factor
        self._device_task: tuple[float, float] | None = None  # (started, predicted seconds)
        self.replans = 0
        # an event since the last plan may have changed it: planned again before use,
        # once its cost is paid for (PLAN_SHARE) ...
        self._stale = False
        # ... or a chunk's plan is wrong (its level failed, its fetch was cancelled)
        self._must_plan = False
        self._planned_at = 0.0
        # Without a deadline the plan is each chunk's best level, whatever the time and
        # the link: only a level dropped for a chunk changes it, not a chunk's progress.
        self._timed = options.deadline_at is not None
        self.cancelled = 0
        self.refined = 0
        self.refinements_dropped = 0
        self.refine = options.refine and options.deadline_at is not None
        self._refining: _Chunk | None = None  # one refinement at a time, fetch to decode
        self._holding: list[_Chunk] = []  # loaded chunks that kept their read to refine
        self._t0 = 0.0

    # ---- the model of what is left ---------------------------------------------
    def _index_held(self, ref: ObjectRef) -> bool:
        return self.mode.indexes is not None and self.mode.indexes.get(ref) is not None

    def _choice(self, chunk: _Chunk) -> ChunkChoice:
        entry = chunk.entry
        tokens = entry.end - entry.start
        options = []
        for name in self.options.levels:
            ref = entry.objects.get(name)
            if ref is None or name in chunk.unusable:
                continue
            decode_s = self.speed.decode_seconds(self.manifest.levels[name].id, tokens)
            nbytes = ref.level_bytes  # of a nested level, the index and its tiers only
            group = self.groups[chunk.group]
            if group.part is not None:  # the part's share of the decode, and of the bytes
                decode_s *= group.share
                if ref.index is not None:
                    index = 0 if self._index_held(ref) else ref.index.bytes
                    nbytes = index + round((nbytes - ref.index.bytes) * group.share)
            options.append(
                Option(name, nbytes, self.options.quality_of[name],
                       decode_s * self.decode_factor)  # fmt: skip
            )
        if self.mode.allow_text or not options:
            recompute_s = self.speed.recompute_seconds(tokens, entry.start)
            options.append(Option(TEXT, 0, 1.0, recompute_s * self.recompute_factor))
        return ChunkChoice(chunk.key, tokens, tuple(options))

    def _busy(self, now: float, without: _Chunk | None = None) -> Busy:
        link_bytes = 0
        device_s = 0.0
        if self._device_task is not None:
            started, predicted = self._device_task
            device_s += max(0.0, predicted - (now - started))
        first_pending = next(
            (c.key for c in self.chunks if c.state is _State.PENDING or c is without),
            len(self.chunks),
        )
        fetching_before = False
        waiting_before = False
        for c in self.chunks:
            if c is without:
                continue
            if c.state is _State.FETCHING:
                assert c.option is not None
                link_bytes += max(0, c.option.bytes - c.received)
                device_s += c.option.device_s
                fetching_before |= c.key < first_pending
            elif c.state is _State.FETCHED:
                assert c.option is not None
                device_s += c.option.device_s
                waiting_before |= c.key < first_pending
            elif c.state is _State.DEVICE:
                waiting_before |= c.key < first_pending
        text_ready = 0.0
        if fetching_before:
            text_ready = self.predictor.predict_seconds(link_bytes)
        elif waiting_before:
            text_ready = device_s
        return Busy(link_bytes, device_s, text_ready)

    def _remaining_s(self, now: float) -> float | None:
        deadline_at = self.options.deadline_at
        return None if deadline_at is None else deadline_at - now

    def _plan(self, now: float) -> Plan:
        pending = [c for c in self.chunks if c.state is _State.PENDING]
        choices = [self._choice(c) for c in pending]
        result = self.policy(choices, self.predictor, self._remaining_s(now), self._busy(now))
        for c in pending:
            c.planned = result.choices[c.key]
        self.replans += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "plan %d at %.3f s: 1 MB in %.3f s; predicted %.3f s (%s); %s",
                self.replans,
                now - self._t0 if self._t0 else 0.0,
                self.predictor.predict_seconds(1_000_000),
                result.predicted_s,
                "feasible" if result.feasible else "best effort",
                " ".join(result.choices[c.key].level for c in pending),
            )
        give_up_at = self.mode.give_up_at
        late = give_up_at is not None and now + result.predicted_s > give_up_at
        if late and self.layer_groups is not None and not self.items.chunk_major:
            # Group by group, a load cut at its deadline holds no whole chunk: the last
            # group has barely started, and a chunk is usable only with all its layers.
            # Chunk by chunk, it holds the prefix that arrived, as a whole load does.
            # The forward pass then starts only once the load ends.
            self.items.to_chunk_major()  # renames the items: after the log above
            log.info("%s cannot be loaded in layer order by its deadline: loading it "
                     "chunk by chunk", self.manifest.ref)  # fmt: skip
        self._planned_at = now
        return result

    def _fresh_plan(self, now: float) -> None:
        """Plan again if something happened since the last plan: called where a plan is
        about to be used (a fetch slot free, the device free for a recompute), not after
        every event: a plan of many chunks that miss their deadline costs milliseconds.
        A plan made for progress alone waits until its cost would be :data:`PLAN_SHARE`
        of the time since the last one."""
        cost = PLAN_S_PER_ITEM * self.items.count[_State.PENDING]
        due = self._stale and now - self._planned_at >= cost / PLAN_SHARE
        if self._must_plan or due:
            self._stale = self._must_plan = False
            self._plan(now)

    # ---- running ---------------------------------------------------------------
    def run(self) -> PipelineResult:
        self._t0 = time.perf_counter()
        first = self._plan(self._t0)
        device = ThreadPoolExecutor(1, thread_name_prefix="kvcdn-device")
        try:
            self._loop(device)
        except BaseException:
            for c in self.chunks:
                c.cancel.set()
            raise
        finally:
            # Fetches no longer needed are not waited for: each runs in a daemon thread
            # that only reads (a read blocked on a hung store must not hold the process
            # at exit); the device's work, which writes into the target, is.
            device.shutdown(wait=True, cancel_futures=True)
        self._settle_groups()
        by_group = sorted(self.chunks, key=lambda c: (c.group, c.entry.index))
        reports = []
        for c in by_group:
            if c.state is _State.SKIPPED:
                reports.append(
                    ChunkReport(c.entry.index, c.entry.end - c.entry.start, SKIPPED, "", 0,
                                c.start_s, 0.0, 0.0, c.abandoned, c.failed,
                                recompute_reason=c.why or "late")  # fmt: skip
                )
                continue
            assert c.option is not None
            reports.append(
                ChunkReport(
                    index=c.entry.index,
                    tokens=c.entry.end - c.entry.start,
                    level=c.option.level,
                    source=c.source,
                    # what a part read fetched (its index and sections), else the object
                    bytes=c.part_bytes or c.option.bytes,
                    start_s=c.start_s,
                    ready_s=c.ready_s,
                    quality=c.option.quality,
                    abandoned=c.abandoned,
                    failed=c.failed,
                    refined_from=c.refined_from,
                    recompute_reason=(c.why or "planned") if c.option.level == TEXT else "",
                )
            )
        n = self.per_group
        loaded = next((i for i in range(n) if any(
            by_group[g * n + i].state is not _State.DONE for g in range(len(self.groups))
        )), n)  # fmt: skip
        if len(self.groups) > 1:  # a chunk's report covers all its groups
            reports = [_merged(reports[i::n]) for i in range(n)]
        return PipelineResult(reports, first.predicted_s, first.feasible, self.replans,
                              self.cancelled, loaded, self.refined,
                              self.refinements_dropped)  # fmt: skip

    def _loop(self, device: ThreadPoolExecutor) -> None:
        device_busy = False
        last_cancel = 0.0
        while self.refine or self.items.open():
            self._settle_groups()
            now = time.perf_counter()
            give_up_at = self.mode.give_up_at
            if give_up_at is not None and now > give_up_at:
                late = [c for c in self.chunks if c.state not in (_State.DONE, _State.DEVICE,
                                                                  _State.SKIPPED)]  # fmt: skip
                if late:  # a chunk being written is let finish
                    first_late = min(c.entry.index for c in late)
                    log.info("chunks %d..%d of %s: not loaded by the give-up time; left to "
                             "the engine", first_late, self.chunks[-1].entry.index,
                             self.manifest.ref)  # fmt: skip
                    self._skip_from(first_late)
                    continue
            # launch fetches, in document order
            fetching = self.items.count[_State.FETCHING]
            if fetching < self.options.concurrency and self.items.count[_State.PENDING]:
                self._fresh_plan(now)
                for c in self.items.from_first_open():
                    if fetching >= self.options.concurrency:
                        break
                    if (c.state is _State.PENDING and c.planned is not None
                            and c.planned.level != TEXT
                            and not self._waits_for_index(c)):  # fmt: skip
                        self._start_fetch(c, now)
                        fetching += 1
            # give the device work: decode what has arrived, else the next text chunk
            if not device_busy:
                device_busy = self._start_device(device, now)
            if self.refine:
                self._refine_step(now)
                if self._refining is None and not self.items.open():
                    break  # nothing more to load, nothing more worth refining
            try:
                event = self.events.get(timeout=TICK_S)
            except queue.Empty:
                event = None
            now = time.perf_counter()
            if isinstance(event, _RefineEvent):
                if event.seconds is not None:
                    device_busy = False
                    self._device_task = None
                self._refine_event(event, now)
                continue
            if event is None:
                self.meter.tick(now, self.items.count[_State.FETCHING] > 0)
                if self.cancel_late_fetches and now - last_cancel > 2 * TICK_S:
                    if self._cancel_late_fetch(now):
                        last_cancel = now
                        self._must_plan = True
                continue
            chunk = event.chunk
            if isinstance(event, _Failed) and event.attempt not in (None, chunk.attempt):
                continue  # from a fetch abandoned earlier
            if isinstance(event, _Failed) and not self.mode.partial:
                if chunk.state is _State.DEVICE:
                    device_busy = False
                    self._device_task = None
                self._drop_level(chunk, event.error)
                self._must_plan = True
                continue
            if isinstance(event, _Failed):
                log.warning(
                    "chunk %d of %s: %s; it and the chunks after it are left to the engine",
                    chunk.entry.index, self.manifest.ref, event.error,
                )  # fmt: skip
                if chunk.state is _State.DEVICE:
                    device_busy = False
                    self._device_task = None
                chunk.why = failure_kind(event.error)
                self._skip_from(chunk.entry.index, failed=chunk)
                continue
            if isinstance(event, _Fetched):
                if event.attempt != chunk.attempt:
                    continue  # from a fetch abandoned earlier
                if event.cancelled:  # it stopped by itself when cancelled
                    self._abandon(chunk)
                else:
                    self.items.move(chunk, _State.FETCHED)
                    self.meter.tick(now, self.items.count[_State.FETCHING] > 0)
                self._stale |= self._timed
            else:
                device_busy = False
                self._learn_device(chunk, event.seconds)
                self.items.move(chunk, _State.DONE)
                if self.refine and isinstance(chunk.data, PartRead) and chunk.data.index:
                    chunk.held = chunk.data if chunk.data.index.tiers > 1 else None
                    if chunk.held is not None:
                        self._holding.append(chunk)
                chunk.data = b""
                chunk.ready_s = now - self._t0
                self._device_task = None
                self._stale |= self._timed

    def _skip_from(self, index: int, failed: _Chunk | None = None) -> None:
        """Give up chunk ``index`` and every later one, in every group of layers, but
        those being written (their decode ends, and is not counted): ``failed`` is the
        one that failed."""
        for c in self.chunks:
            if c.entry.index < index:
                continue
            if c.state is _State.DEVICE and c is not failed:
                continue
            c.cancel.set()
            c.attempt += 1  # news from its fetch is ignored
            self.items.move(c, _State.SKIPPED)
            c.data = b""
            if c is not failed:
                c.why = "after_failure" if failed is not None else "late"

    def _settle_groups(self) -> None:
        """Tell the layer groups' owner of each group, in order, whose items have all
        ended (a later group's may end first: it waits for the ones before it)."""
        if self.layer_groups is None:
            return
        while self._settled < len(self.groups) and self.items.group_ended(self._settled):
            self.layer_groups.loaded(self._settled)
            self._settled += 1

    def _drop_level(self, c: _Chunk, error: BaseException) -> None:
        """A level of ``c`` failed (its fetch, its check or its decode): plan the chunk
        again without it. Anything but a kvcdn error, or a failed recompute, is raised."""
        level = c.option.level if c.option is not None else ""
        if not isinstance(error, KvcdnError) or level in ("", TEXT) or self.mode.loaded is None:
            raise error
        log.warning("chunk %d of %s: its %s object cannot be used (%s); loading it another "
                    "way", c.entry.index, self.manifest.ref, level, error)  # fmt: skip
        c.failed.append(f"{level}: {failure_reason(error, c.entry.objects[level].key)}")
        c.why = failure_kind(error)
        c.unusable.add(level)
        c.cancel.set()
        c.cancel = Cancel()
        c.attempt += 1  # news from the failed fetch is ignored
        self.items.move(c, _State.PENDING)
        c.data = b""
        c.received = 0

    def _start_fetch(self, c: _Chunk, now: float) -> None:
        assert c.planned is not None
        c.option = c.planned
        self.items.move(c, _State.FETCHING)
        c.received = 0
        c.attempt += 1
        c.start_s = now - self._t0
        ref = c.entry.objects[c.option.level]
        part = self.groups[c.group].part
        fetch_deadline = self.options.fetch_deadline
        if fetch_deadline is not None:  # the same instant, on the readers' clock
            c.cancel.limit(time.monotonic() + fetch_deadline - time.perf_counter())
        cancel, attempt = c.cancel, c.attempt

        def on_bytes(n: int) -> None:
            if not cancel.is_set():
                c.received += n
            self.meter.add(n)

        def work() -> None:
            try:
                options = {"placement": self.placement, "on_bytes": on_bytes, "cancel": cancel}
                if (part is not None and ref.index is not None) or ref.tiers is not None:
                    read = read_part(self.reader, ref, part, name=f"object {ref.key}",
                                     indexes=self.mode.indexes, **options)  # fmt: skip
                    data, source = read, read.source
                else:
                    got = self.reader.fetch(ref, **options)
                    data, source = got.data, got.source
                if not cancel.is_set():
                    c.data, c.source = data, source
                    c.part_bytes = data.nbytes if isinstance(data, PartRead) else 0
                self.events.put(_Fetched(c, attempt))
            except FetchCancelled:
                self.events.put(_Fetched(c, attempt, cancelled=True))
            except BaseException as exc:
                if not cancel.is_set() or cancel.deadline_passed():  # for the controller
                    self.events.put(_Failed(c, exc, attempt))

        self.meter.start(now)
        daemons.start(work, "kvcdn-fetch")

    def _waits_for_index(self, c: _Chunk) -> bool:
        """Whether another group's item of ``c``'s chunk is fetching the index that
        ``c``'s read needs: ``c`` starts once the index is held, instead of fetching it
        too (chunk by chunk, a chunk's groups are next to each other)."""
        if self.layer_groups is None or self.mode.indexes is None:
            return False
        assert c.planned is not None
        ref = c.entry.objects[c.planned.level]
        if ref.index is None or self._index_held(ref):
            return False
        return any(o is not c and o.state is _State.FETCHING and o.option is not None
                   and o.entry.objects[o.option.level].key == ref.key
                   for o in self._of_chunk[c.entry.index])  # fmt: skip

    def _abandon(self, c: _Chunk) -> None:
        """Put a cancelled fetch's chunk back to be planned, without waiting for its
        thread: a fetch still waiting for a stalled edge's headers cannot be interrupted
        and ends at its read timeout, its result ignored."""
        if c.state is _State.FETCHING:
            self.items.move(c, _State.PENDING)
            c.received = 0
            c.attempt += 1
            c.cancel = Cancel()

    def _start_device(self, pool: ThreadPoolExecutor, now: float) -> bool:
        ready = None
        if self.items.count[_State.FETCHED]:
            ready = next(c for c in self.items.from_first_open() if c.state is _State.FETCHED)
            assert ready.option is not None
            self.items.move(ready, _State.DEVICE)
            self._device_task = (now, ready.option.device_s)
            pool.submit(self._device_work, ready, self._decode)
            return True
        r = self._refining
        if r is not None and r.refine_stage == "fetched" and r.refine_read is not None:
            read, r.refine_read, r.refine_stage = r.refine_read, None, "decoding"
            assert r.refining is not None
            self._device_task = (now, r.refining.device_s)
            pool.submit(self._refine_decode, r, read)
            return True
        first = next(self.items.from_first_open(), None)
        if first is not None and first.state is _State.PENDING:
            self._fresh_plan(now)  # it may be planned as text now
        if (
            first is not None
            and first.state is _State.PENDING
            and first.planned is not None
            and first.planned.level == TEXT
        ):
            first.option = first.planned
            self.items.move(first, _State.DEVICE)
            first.source = TEXT
            first.start_s = now - self._t0
            self._device_task = (now, first.option.device_s)
            pool.submit(self._device_work, first, self._recompute)
            return True
        return False

    def _device_work(self, c: _Chunk, work: Callable[[_Chunk], None]) -> None:
        started = time.perf_counter()
        try:
            work(c)
            if self.mode.device.startswith("cuda"):
                import torch

                torch.cuda.synchronize(torch.device(self.mode.device))
        except BaseException as exc:
            self.events.put(_Failed(c, exc))
            return
        self.events.put(_DeviceDone(c, time.perf_counter() - started))

    def _decode(self, c: _Chunk) -> None:
        assert c.option is not None
        ref = c.entry.objects[c.option.level]
        # its bytes were checked against the manifest's sha256 when they arrived
        group = self.groups[c.group]
        part = c.data.part if isinstance(c.data, PartRead) else group.part
        decode_into(c.data, group.target.chunk(c.entry.start, c.entry.end),
                    name=f"object {ref.key}", profile=self.profile, verified=True,
                    chunk_hash=c.entry.hash, part=part)  # fmt: skip
        group.target.commit(c.entry.start, c.entry.end)

    def _recompute(self, c: _Chunk) -> None:
        start, end = c.entry.start, c.entry.end
        loaded = self.mode.loaded
        if loaded is None:
            raise FormatError(f"chunk {c.entry.index} has no stored level to load")
        target = self.groups[c.group].target  # an app's load: the one group
        kv = loaded.extend(target.prefix(start), c.entry.tokens)
        target.chunk(start, end).write(kv)
        target.commit(start, end)

    def _learn_device(self, c: _Chunk, seconds: float) -> None:
        """Correct the measured device speed by what this load sees (contention, clocks)."""
        assert c.option is not None
        predicted = c.option.device_s
        if predicted <= 0:
            return
        ratio = min(4.0, max(0.25, seconds / predicted))
        if c.option.level == TEXT:
            self.recompute_factor = min(4.0, max(0.25, self.recompute_factor * ratio**0.5))
            self.speed.recompute_factor = self.recompute_factor  # for the next load
        else:
            self.decode_factor = min(4.0, max(0.25, self.decode_factor * ratio**0.5))
            self.speed.decode_factor = self.decode_factor

    def _cancel_late_fetch(self, now: float) -> bool:
        """If keeping the fetches in flight misses the deadline, cancel the one whose
        dropping helps most."""
        remaining = self._remaining_s(now)
        assert remaining is not None
        pending = [c for c in self.chunks if c.state is _State.PENDING]
        keep = self.policy(
            [self._choice(c) for c in pending], self.predictor, remaining, self._busy(now)
        )
        if keep.feasible:
            return False
        in_flight = sorted(
            (c for c in self.chunks if c.state is _State.FETCHING and not c.cancel.is_set()),
            key=lambda c: (c.option.bytes if c.option else 0) - c.received,
            reverse=True,
        )
        for c in in_flight:
            assert c.option is not None
            again = sorted([*pending, c], key=lambda x: x.key)
            drop = self.policy(
                [self._choice(x) for x in again], self.predictor, remaining, self._busy(now, c)
            )
            if drop.predicted_s < keep.predicted_s * CANCEL_GAIN and (
                drop.choices[c.key].level != c.option.level
            ):
                log.info(
                    "chunk %d: cancelling its %s fetch (%d of %d bytes in): it cannot make the "
                    "deadline; re-planned as %s",
                    c.entry.index,
                    c.option.level,
                    c.received,
                    c.option.bytes,
                    drop.choices[c.key].level,
                )
                c.abandoned.append(c.option.level)
                c.cancel.set()
                self._abandon(c)
                self.cancelled += 1
                return True
        return False

    # ---- refinement ------------------------------------------------------------
    def _refine_step(self, now: float) -> None:
        """Once no chunk is left to fetch, start the refinement worth most per second
        that fits the deadline; cancel one under way that can no longer make it."""
        r = self._refining
        if r is not None:
            deadline_at = self.options.deadline_at
            assert deadline_at is not None and r.refine_cancel is not None
            assert r.refining is not None
            if now > deadline_at and r.refine_stage == "fetching":
                # still fetching at the deadline: the chunk keeps its level
                self._drop_refinement(r, "not in by the deadline")
            elif r.refine_stage == "fetched" and now + r.refining.device_s > deadline_at:
                self._drop_refinement(r, "no time left to decode it")  # the device was busy
            return
        if self.items.count[_State.PENDING] or self.items.count[_State.FETCHING]:
            return  # the first pass owns the link
        remaining = self._remaining_s(now)
        give_up_at = self.mode.give_up_at
        if remaining is None or (give_up_at is not None and now >= give_up_at):
            return
        if give_up_at is not None:
            remaining = min(remaining, give_up_at - now)
        candidates = self._refinements()
        if not candidates:  # a cheap answer, asked on each of the load's last turns
            return
        chosen = next_refinement(candidates, self.predictor, remaining, self._busy(now))
        if chosen is not None:
            self._start_refine(self.chunks[chosen.index], chosen, now)

    def _refinements(self) -> list[Refinement]:
        """Every level a loaded chunk of a nested object could be raised to: its object's
        further tiers, bytes and decode time at the part's share."""
        out = []
        for c in self._holding:
            if c.state is not _State.DONE or c.held is None or c.option is None:
                continue
            have = c.entry.objects[c.option.level]
            assert have.tiers is not None and have.index is not None
            tokens = c.entry.end - c.entry.start
            for name in self.options.levels:
                ref = c.entry.objects.get(name)
                quality = self.options.quality_of.get(name, 0.0)
                if (ref is None or name in c.unusable or ref.key != have.key or ref.tiers is None
                        or ref.tiers.count <= have.tiers.count or quality <= c.option.quality):
                    continue  # fmt: skip
                share = self.groups[c.group].share
                extra = round((ref.level_bytes - have.level_bytes) * share)
                decode_s = (self.speed.decode_seconds(self.manifest.levels[name].id, tokens)
                            * share * self.decode_factor)  # fmt: skip
                to = Option(name, c.option.bytes + extra, quality, decode_s)
                out.append(Refinement(c.key, to, extra, decode_s,
                                      (quality - c.option.quality) * tokens))  # fmt: skip
        return out

    def _start_refine(self, c: _Chunk, chosen: Refinement, now: float) -> None:
        assert c.held is not None and self.options.deadline_at is not None
        held = c.held
        ref = c.entry.objects[chosen.to.level]
        cancel = Cancel()
        # the fetch ends, at the latest, when its decode could no longer make the deadline
        cancel.limit(time.monotonic() + self.options.deadline_at - chosen.device_s
                     - time.perf_counter())  # fmt: skip
        c.refining, c.refine_cancel, c.refine_read = chosen.to, cancel, None
        c.refine_stage, c.refine_started = "fetching", now
        self._refining = c
        log.debug("chunk %d: refining %s to %s (%d bytes)", c.entry.index, c.option and
                  c.option.level, chosen.to.level, chosen.bytes)  # fmt: skip

        def work() -> None:
            try:
                read = read_more(self.reader, ref, held, name=f"object {ref.key}",
                                 placement=self.placement, cancel=cancel)  # fmt: skip
                self.events.put(_RefineEvent(c, cancel, read=read))
            except BaseException as exc:
                self.events.put(_RefineEvent(c, cancel, error=exc))

        daemons.start(work, "kvcdn-refine")

    def _refine_decode(self, c: _Chunk, read: PartRead) -> None:
        """The refined read decoded apart, then written over the chunk's KV: a refinement
        that fails leaves the chunk as it was."""
        import torch

        started = time.perf_counter()
        assert c.refine_cancel is not None
        cancel = c.refine_cancel
        try:
            ref = c.entry.objects[c.refining.level if c.refining else ""]
            staged = torch.empty(read.part.shape(read.header.shape), dtype=torch.float32)
            decode_into(read, TensorDest(staged), name=f"object {ref.key}", profile=self.profile,
                        verified=True, chunk_hash=c.entry.hash, part=read.part)  # fmt: skip
            target = self.groups[c.group].target
            target.chunk(c.entry.start, c.entry.end).write(staged)
            target.commit(c.entry.start, c.entry.end)
            if self.mode.device.startswith("cuda"):
                torch.cuda.synchronize(torch.device(self.mode.device))
        except BaseException as exc:
            self.events.put(_RefineEvent(c, cancel, time.perf_counter() - started, exc))
            return
        c.held = read
        self.events.put(_RefineEvent(c, cancel, time.perf_counter() - started))

    def _refine_event(self, event: _RefineEvent, now: float) -> None:
        c = event.chunk
        if c is not self._refining or c.refining is None or event.cancel is not c.refine_cancel:
            return  # a refinement dropped earlier
        if event.error is not None:
            if not isinstance(event.error, KvcdnError):
                raise event.error
            self._drop_refinement(c, failure_reason(event.error, c.entry.objects[
                c.refining.level].key))  # fmt: skip
            return
        if event.seconds is None:  # fetched: the device decodes it when free
            # One sample of the whole fetch, not the first pass's windows: a refinement
            # runs alone on the link, and a window of it that the controller looks at late
            # (a busy host) would read as a stalled link, after which no refinement is
            # predicted to fit and none is started that could show the link is back.
            assert event.read is not None
            self.predictor.observe(event.read.nbytes, now - c.refine_started)
            c.refine_read, c.refine_stage = event.read, "fetched"
            return
        assert c.option is not None
        c.refined_from.append(c.option.level)
        assert c.held is not None
        c.part_bytes += c.held.nbytes  # what the refinement fetched
        c.option, c.refining, c.refine_stage, self._refining = c.refining, None, "", None
        c.ready_s = now - self._t0
        self.refined += 1

    def _drop_refinement(self, c: _Chunk, why: str) -> None:
        assert c.refining is not None
        log.info("chunk %d of %s: refinement to %s dropped (%s); it keeps %s", c.entry.index,
                 self.manifest.ref, c.refining.level, why, c.option and c.option.level)  # fmt: skip
        c.unusable.add(c.refining.level)
        c.failed.append(f"{c.refining.level}: {why}")
        if c.refine_cancel is not None:
            c.refine_cancel.set()
        c.refining, c.refine_read, c.refine_stage, self._refining = None, None, "", None
        self.refinements_dropped += 1


def _group(manifest: Manifest, target: KVTarget) -> _Group:
    """``target``'s group: the layers and heads it holds, when not all, are read in part
    where the objects have sections (version 2), else whole."""
    layout = manifest.kv_layout
    part = target.part
    if part is None or part.is_whole((layout["layers"], 2, layout["kv_heads"])):
        return _Group(target, None, 1.0)
    share = part.layer_count * part.head_count / (layout["layers"] * layout["kv_heads"])
    return _Group(target, part, share)


def _merged(groups: list[ChunkReport]) -> ChunkReport:
    """One chunk's report from its groups' (a layer-ordered load): given up if any group
    gave it up (why: the group that failed, not those given up with it); else at its
    worst group's level, with every group's bytes."""
    skipped = [r for r in groups if r.level == SKIPPED]
    if skipped:
        return min(skipped, key=lambda r: r.recompute_reason == "after_failure")
    worst = min(groups, key=lambda r: r.quality)
    return replace(
        worst,
        bytes=sum(r.bytes for r in groups),
        start_s=min(r.start_s for r in groups),
        ready_s=max(r.ready_s for r in groups),
        abandoned=[a for r in groups for a in r.abandoned],
        failed=[f for r in groups for f in r.failed],
    )
