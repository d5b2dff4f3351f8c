"""Choosing each chunk's quality: the adaptive-bitrate planner of ``load_context``.

Like a video player choosing each segment's bitrate, but for a deadline on
the time to first token rather than a playback buffer. Every remaining chunk
gets a level (fetched over the network, then decoded on the device) or
``text`` (recomputed on the device from its tokens, in parallel with the
fetches of other chunks). The plan maximises the summed quality of the chunks
subject to finishing by the deadline, and is made again after every chunk
completes, with what the transfers so far say about the link.

The time model has two resources that work in parallel:
- the link, which carries the fetched chunks one after another at the
  predicted throughput: ``link = latency + sum(bytes) / throughput``;
- the device, which decodes fetched chunks and recomputes ``text`` chunks:
  ``device = sum(decode) + sum(recompute)``.

The load finishes at ``max(link + the last chunk's decode, device)``; work
already under way (:class:`Busy`) adds to both. Recomputing a chunk needs the
chunks before it in the cache, so ``text`` chunks are put first, where the
device can start on them while the link carries the rest.

Choosing is a multiple-choice knapsack. The planner starts from the best
option of every chunk and, while the estimate misses the deadline, takes the
downgrade that saves the most time per unit of quality lost (free
downgrades first), until the estimate fits or nothing saves time; then the
plan is the best effort and says so.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvcdn.manifest import TEXT_LEVEL

#: The option that recomputes a chunk from its tokens: the manifest's ``text`` level.
TEXT = TEXT_LEVEL


@dataclass(frozen=True)
class Option:
    """One way to obtain a chunk: a level (``bytes`` > 0) or ``text`` (recompute).

    ``device_s`` is the device time it costs: decoding a fetched level, or
    recomputing the chunk's tokens for ``text``.
    """

    level: str
    bytes: int
    quality: float  # higher is better; 1.0 is exactly the model's own KV
    device_s: float = 0.0


@dataclass(frozen=True)
class ChunkChoice:
    index: int
    tokens: int
    options: tuple[Option, ...]  # the chunk's levels and ``text``


class ThroughputPredictor(Protocol):
    """How long a transfer will take, learnt from the transfers so far.

    A learned predictor can replace the default by implementing these two.
    """

    def predict_seconds(self, nbytes: int) -> float: ...

    def observe(self, nbytes: int, seconds: float) -> None: ...


#: A new link's throughput before anything is known of it (100 Mbit/s).
INITIAL_BPS = 12.5e6


class HarmonicPredictor:
    """RobustMPC's predictor: the harmonic mean of the last ``window`` throughput
    samples, divided by ``1 + the largest recent relative prediction error``.

    Until the first sample it assumes ``initial_bps``. A period in which
    nothing arrived (zero bytes, positive time) is a stalled link and counts as
    ``min_bps``; zero bytes in zero time carry nothing and are ignored; bytes
    that took no measurable time count as ``max_bps``.
    """

    def __init__(
        self,
        initial_bps: float = INITIAL_BPS,
        *,
        window: int = 5,
        latency_s: float = 0.0,
        max_bps: float = 100e9,
        min_bps: float = 1e3,
    ) -> None:
        if initial_bps <= 0:
            raise ValueError("initial_bps must be positive")
        self._version = 0  # of the samples and the prior: a new one at each change
        self._throughput = (-1, 0.0)  # throughput() as of a version
        self.initial_bps = initial_bps
        self.latency_s = latency_s
        self.max_bps = max_bps
        self.min_bps = min_bps
        self._samples: deque[float] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=window)

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def initial_bps(self) -> float:
        return self._initial_bps

    @initial_bps.setter
    def initial_bps(self, bps: float) -> None:
        self._initial_bps = bps
        self._version += 1

    def throughput(self) -> float:
        """Predicted bytes per second, with the error margin applied."""
        # Computed once per sample (a plan asks hundreds of times), and kept with the
        # version of the samples it read: loads on other threads may observe meanwhile.
        cached, version = self._throughput, self._version
        if cached[0] == version:
            return cached[1]
        bps = self._harmonic() / (1.0 + max(self._errors, default=0.0))
        self._throughput = (version, bps)
        return bps

    def _harmonic(self) -> float:
        if not self._samples:
            return self.initial_bps
        return len(self._samples) / sum(1.0 / s for s in self._samples)

    def predict_seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.throughput()

    def linear(self) -> tuple[float, float]:
        """The prediction as ``latency_s + bytes / throughput``: (latency_s, throughput),
        for a planner that computes it itself (:mod:`kvcdn.kernels.downgrade`)."""
        return self.latency_s, self.throughput()

    def predict_seconds_many(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`predict_seconds` of each of ``nbytes`` (an integer array), the same
        arithmetic: what the planner asks for every option it weighs at once."""
        return np.where(nbytes <= 0, 0.0, self.latency_s + nbytes / self.throughput())

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 and seconds <= 0:
            return
        measured = self.max_bps if seconds <= 0 else nbytes / seconds
        measured = min(max(measured, self.min_bps), self.max_bps)
        if self._samples:  # the initial guess is not a prediction to hold against the link
            self._errors.append(abs(self._harmonic() - measured) / measured)
        self._samples.append(measured)
        self._version += 1


@dataclass
class Plan:
    choices: dict[int, Option]  # chunk index -> chosen option
    predicted_s: float  # estimated seconds from now until every chunk is loaded
    feasible: bool  # the estimate meets the deadline (always True without one)

    @property
    def quality(self) -> float:
        return sum(o.quality for o in self.choices.values())


@dataclass(frozen=True)
class Busy:
    """Work already under way when a plan is made (all zero before the load starts).

    ``link_bytes``: bytes still to arrive for fetches in flight; ``device_s``:
    device work queued or running (including decoding the fetches in flight);
    ``text_ready_s``: when the chunks before the first chunk still to start
    will be in the cache, so that recomputing it can begin.
    """

    link_bytes: int = 0
    device_s: float = 0.0
    text_ready_s: float = 0.0


IDLE = Busy()


class Policy(Protocol):
    """Chooses an option for each chunk still to start (``plan`` is the default)."""

    def __call__(
        self,
        chunks: Sequence[ChunkChoice],
        predictor: ThroughputPredictor,
        deadline_s: float | None,
        busy: Busy = IDLE,
    ) -> Plan: ...


class _Estimate:
    """The time model, kept as running sums so a swap is evaluated in O(1)."""

    def __init__(self, predictor: ThroughputPredictor, busy: Busy) -> None:
        self.predictor = predictor
        self.busy = busy
        self.bytes = 0
        self.device_s = 0.0
        self.text_s = 0.0

    def add(self, option: Option, sign: int = 1) -> None:
        self.bytes += sign * option.bytes
        self.device_s += sign * option.device_s
        if option.level == TEXT:
            self.text_s += sign * option.device_s

    def finish(self, decode_max: float) -> float:
        return self.finish_with(self.bytes, self.device_s, self.text_s, decode_max)

    def finish_with(self, nbytes: int, device_s: float, text_s: float, decode_max: float) -> float:
        finish = self.busy.device_s + device_s
        link_bytes = self.busy.link_bytes + nbytes
        if link_bytes:
            finish = max(finish, self.predictor.predict_seconds(link_bytes) + decode_max)
        if text_s:
            finish = max(finish, self.busy.text_ready_s + text_s)
        return finish


def plan(
    chunks: Sequence[ChunkChoice],
    predictor: ThroughputPredictor,
    deadline_s: float | None,
    busy: Busy = IDLE,
) -> Plan:
    """The options that maximise quality while finishing within ``deadline_s``
    seconds from now (None: no deadline, every chunk at its best level).

    ``chunks`` are the chunks still to start, in document order; ``busy`` is
    the work already under way. Recomputing is a way to meet the deadline,
    not a goal: with slack every chunk is fetched at its best level.
    """
    est = _Estimate(predictor, busy)
    chosen = {c.index: _best_fetched(c) for c in chunks}
    for option in chosen.values():
        est.add(option)
    decode_of = {i: (0.0 if o.level == TEXT else o.device_s) for i, o in chosen.items()}
    finish = est.finish(max(decode_of.values(), default=0.0))
    if deadline_s is None:
        return Plan(chosen, finish, True)

    if finish > deadline_s:
        chosen = _downgrade(chunks, chosen, est, deadline_s)
    chosen = _text_first(chunks, chosen, predictor, busy)
    finish = estimate(chunks, chosen, predictor, busy)
    return Plan(chosen, finish, finish <= deadline_s)


_PADDING = Option("", 0, 0.0)  # where a chunk has fewer options than others


def _downgrade(
    chunks: Sequence[ChunkChoice],
    chosen: dict[int, Option],
    est: _Estimate,
    deadline_s: float,
) -> dict[int, Option]:
    """:func:`plan`'s search: from ``chosen``, the swap that saves the most time per unit
    of quality lost, again and again, while the estimate misses ``deadline_s``.

    Each step weighs every (chunk, option) pair: a plan that misses its deadline takes
    a step per swap, some hundreds for a long document, made again after every chunk
    of the load. A link predicted as ``latency + bytes / throughput`` (``linear()``:
    :class:`HarmonicPredictor`) is searched by a compiled kernel
    (:mod:`kvcdn.kernels.downgrade`); any other predictor by numpy, every pair of a
    step at once. Both use the scalar model's arithmetic, operation for operation, and
    break ties toward the first pair in chunk and option order, so the plan is the same."""
    n = len(chunks)
    if not n:  # only the work under way misses the deadline
        return chosen
    width = max(len(c.options) for c in chunks)
    # [chunks, options], a chunk's missing options padded (and not valid)
    pad = [(_PADDING,) * (width - len(c.options)) for c in chunks]
    rows = [c.options + p for c, p in zip(chunks, pad, strict=True)]
    valid = np.array([[True] * len(c.options) + [False] * len(p)
                      for c, p in zip(chunks, pad, strict=True)])  # fmt: skip
    nbytes = np.array([[o.bytes for o in r] for r in rows], dtype=np.int64)
    device = np.array([[o.device_s for o in r] for r in rows], dtype=np.float64)
    quality = np.array([[o.quality for o in r] for r in rows], dtype=np.float64)
    text = np.array([[o.level == TEXT for o in r] for r in rows], dtype=bool)
    at = np.array([next(k for k, o in enumerate(c.options) if o is chosen[c.index])
                   for c in chunks], dtype=np.int64)  # each chunk's chosen option  # fmt: skip
    linear = getattr(est.predictor, "linear", None)
    if linear is not None:
        from kvcdn.kernels.downgrade import downgrade

        latency_s, bps = linear()
        busy = est.busy
        downgrade(valid, nbytes, device, quality, text, at, float(busy.device_s),
                  int(busy.link_bytes), float(busy.text_ready_s), int(est.bytes),
                  float(est.device_s), float(est.text_s), float(latency_s), float(bps),
                  float(deadline_s))  # fmt: skip
    else:
        _downgrade_arrays(chunks, valid, nbytes, device, quality, text, at, est, deadline_s)
    return {c.index: c.options[at[i]] for i, c in enumerate(chunks)}


def warm_up() -> None:
    """Load the compiled search :func:`plan` uses for a harmonic predictor (on a
    client's warm-up thread, not on a load's clock)."""
    from kvcdn.kernels.downgrade import warm_up as load_kernel

    load_kernel()


def _downgrade_arrays(
    chunks: Sequence[ChunkChoice], valid: np.ndarray, nbytes: np.ndarray, device: np.ndarray,
    quality: np.ndarray, text: np.ndarray, at: np.ndarray, est: _Estimate, deadline_s: float,
) -> None:  # fmt: skip
    """:func:`_downgrade`'s search in numpy, for any predictor: each step weighs every
    (chunk, option) pair at once; ``at`` (each chunk's option) is changed in place."""
    n, width = valid.shape
    decode = np.where(text, 0.0, device)  # what an option adds to the last decode
    text_device = np.where(text, device, 0.0)
    rows = np.arange(n)
    decode_now = decode[rows, at]
    busy, finish = est.busy, est.finish(float(decode_now.max(initial=0.0)))
    while finish > deadline_s:
        held_bytes, held_device = nbytes[rows, at], device[rows, at]
        held_quality, held_text = quality[rows, at], text_device[rows, at]
        # the largest decode of the other chunks: the second largest for the first
        # chunk holding the largest, the largest for every other
        first = int(np.argmax(decode_now))
        others = np.full(n, decode_now[first])
        others[first] = np.delete(decode_now, first).max() if n > 1 else 0.0
        after = busy.device_s + ((est.device_s - held_device)[:, None] + device)
        link = busy.link_bytes + ((est.bytes - held_bytes)[:, None] + nbytes)
        last_decode = np.maximum(others[:, None], decode)
        after = np.where(link != 0, np.maximum(after, _link_seconds(est.predictor, link)
                                               + last_decode), after)  # fmt: skip
        text_s = (est.text_s - held_text)[:, None] + text_device
        after = np.where(text_s != 0, np.maximum(after, busy.text_ready_s + text_s), after)
        saved = finish - after
        loss = held_quality[:, None] - quality
        usable = valid & (saved > 1e-12)
        usable[rows, at] = False  # the option held
        usable &= text | (quality <= held_quality[:, None])  # a better level never saves time
        if not usable.any():
            break  # nothing saves time: the best effort
        with np.errstate(divide="ignore", invalid="ignore"):
            score = np.where(loss <= 0, np.inf, saved / loss)
        i, k = divmod(int(np.argmax(np.where(usable, score, -np.inf))), width)
        est.add(chunks[i].options[at[i]], -1)
        est.add(chunks[i].options[k])
        at[i], decode_now[i] = k, decode[i, k]
        finish = est.finish(float(decode_now.max(initial=0.0)))


def _link_seconds(predictor: ThroughputPredictor, nbytes: np.ndarray) -> np.ndarray:
    """``predictor.predict_seconds`` of each of ``nbytes``: at once where the predictor
    takes arrays (:meth:`HarmonicPredictor.predict_seconds_many`), else once per
    distinct value."""
    many = getattr(predictor, "predict_seconds_many", None)
    if many is not None:
        return many(nbytes)
    values, where = np.unique(nbytes, return_inverse=True)
    seconds = np.array([predictor.predict_seconds(int(v)) if v else 0.0 for v in values])
    return seconds[where].reshape(nbytes.shape)


def base_first(
    chunks: Sequence[ChunkChoice],
    predictor: ThroughputPredictor,
    deadline_s: float | None,
    busy: Busy = IDLE,
) -> Plan:
    """Every chunk at its smallest stored level (of a nested object: its base), for the
    load's refinements to raise while the deadline allows: the whole document is in
    early, and a link that turns slow costs quality, not the deadline. Where even that
    misses the deadline, :func:`plan`'s choice."""
    chosen = {}
    for c in chunks:
        fetched = [o for o in c.options if o.level != TEXT]
        chosen[c.index] = min(fetched, key=lambda o: (o.bytes, -o.quality)) if fetched else (
            _best_fetched(c))  # fmt: skip
    finish = estimate(chunks, chosen, predictor, busy)
    if deadline_s is not None and finish > deadline_s:
        return plan(chunks, predictor, deadline_s, busy)
    return Plan(chosen, finish, True)


def fetch_first(
    chunks: Sequence[ChunkChoice],
    predictor: ThroughputPredictor,
    deadline_s: float | None,
    busy: Busy = IDLE,
) -> Plan:
    """:func:`plan`'s choice among the fetched levels only, where that is predicted to meet
    the deadline; else :func:`plan`'s choice with recomputing.

    For a nested publication, whose loaded chunks the load's refinements raise while
    the deadline allows: a chunk fetched at a low level costs quality only until it is
    refined, where recomputing it holds the device for as long as a dozen decodes (on
    2 CPUs, a 256-token chunk's recompute ~1 s, a decode ~30 ms), and every chunk that
    arrives meanwhile waits to be decoded behind it, and refinement with it.

    Before the link has given a sample (a predictor that counts them, such as
    :class:`HarmonicPredictor`, at ``samples == 0``), its estimate is a prior, and a
    recompute once started cannot be taken back: the fetches go first, at the fastest
    levels that prior allows, and the plan made at the first sample decides."""
    fetched = [
        ChunkChoice(c.index, c.tokens, options)
        for c in chunks
        if (options := tuple(o for o in c.options if o.level != TEXT))
    ]
    if len(fetched) == len(chunks):
        choice = plan(fetched, predictor, deadline_s, busy)
        if choice.feasible or getattr(predictor, "samples", 1) == 0:
            return choice
    return plan(chunks, predictor, deadline_s, busy)


def _text_first(
    chunks: Sequence[ChunkChoice],
    chosen: dict[int, Option],
    predictor: ThroughputPredictor,
    busy: Busy,
) -> dict[int, Option]:
    """The same choices with the ``text`` chunks moved to the front, if that is faster.

    Recomputing a chunk needs every chunk before it in the cache, so a text
    chunk behind fetched ones waits for the link; at the front it starts at
    once, in parallel with the fetches of the chunks after it. (The greedy
    search treats chunks as interchangeable; this puts its choices in order.)
    """
    n_text = sum(1 for c in chunks if chosen[c.index].level == TEXT)
    fetched_levels = [chosen[c.index].level for c in chunks if chosen[c.index].level != TEXT]
    moved: dict[int, Option] = {}
    for pos, chunk in enumerate(chunks):
        options = {o.level: o for o in chunk.options}
        if pos < n_text:
            if TEXT not in options:  # this chunk cannot be recomputed: keep the order
                return chosen
            moved[chunk.index] = options[TEXT]
        else:
            wanted = fetched_levels[pos - n_text]
            moved[chunk.index] = options.get(wanted) or _best_fetched(chunk)
    if estimate(chunks, moved, predictor, busy) <= estimate(chunks, chosen, predictor, busy):
        return moved
    return chosen


def _best_fetched(chunk: ChunkChoice) -> Option:
    fetched = [o for o in chunk.options if o.level != TEXT] or list(chunk.options)
    return max(fetched, key=lambda o: (o.quality, -o.bytes))


def estimate(
    chunks: Sequence[ChunkChoice],
    chosen: dict[int, Option],
    predictor: ThroughputPredictor,
    busy: Busy = IDLE,
) -> float:
    """Seconds from now until every chunk is loaded with ``chosen``, simulated in order.

    The link delivers the fetched chunks one after another; the device
    decodes each after it arrives, and recomputes a text chunk once every
    chunk before it is in the cache.
    """
    link_bytes = busy.link_bytes
    device_free = busy.text_ready_s if chunks and chosen[chunks[0].index].level == TEXT else 0.0
    device_free = max(device_free, busy.device_s)
    for chunk in chunks:
        option = chosen[chunk.index]
        if option.level != TEXT:
            link_bytes += option.bytes
            device_free = max(device_free, predictor.predict_seconds(link_bytes))
        device_free += option.device_s
    if link_bytes:  # the fetches in flight must arrive too, even if nothing follows them
        device_free = max(device_free, predictor.predict_seconds(link_bytes))
    return device_free


@dataclass(frozen=True)
class Refinement:
    """Raising a loaded chunk to a better level of its nested object: ``bytes`` more to
    fetch (the tiers it lacks), ``device_s`` to decode the chunk again at ``to``, and
    ``gain``, the quality it adds (weighted by the chunk's tokens)."""

    index: int
    to: Option
    bytes: int
    device_s: float
    gain: float


def next_refinement(
    candidates: Sequence[Refinement],
    predictor: ThroughputPredictor,
    deadline_s: float | None,
    busy: Busy = IDLE,
) -> Refinement | None:
    """The refinement to start now, or None: of those predicted to be fetched and decoded
    within ``deadline_s`` seconds after the work under way (``busy``), the one that
    adds the most quality per second it takes. A refinement runs after every chunk has
    its level, so it can delay nothing but itself; one predicted not to fit is not
    started, so no fetched byte is thrown away unless the link falls short of even the
    predictor's cautious estimate (then the controller cancels it at the deadline and
    the chunk keeps the level it has)."""
    if deadline_s is None:
        return None
    best: tuple[float, Refinement] | None = None
    for r in candidates:
        if r.gain <= 0:
            continue
        link_s = predictor.predict_seconds(busy.link_bytes + r.bytes)
        finish = max(link_s, busy.device_s) + r.device_s
        if finish > deadline_s:
            continue
        own_s = predictor.predict_seconds(r.bytes) + r.device_s
        score = r.gain / max(own_s, 1e-9)
        if best is None or score > best[0]:
            best = (score, r)
    return None if best is None else best[1]
