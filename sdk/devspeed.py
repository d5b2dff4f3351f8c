"""How fast this device decodes each level and recomputes text, measured once and cached.

The planner weighs fetching a chunk (link time, then decoding) against
recomputing it from its tokens (device time). Both device costs are measured
here on the real model and codec: recomputing 256 and 64 tokens after a
256-token and after a 1,024-token context (recompute time grows with the
context a chunk attends to, linearly in the attention, and every forward pass
pays a fixed cost, its weights read once however few its tokens), and each
level's encode-then-decode of one 256-token chunk. Results are cached per model
fingerprint, device, level id and software versions in
``~/.cache/kvcdn/device-speed.json`` (``KVCDN_SPEED_CACHE`` overrides), so a
device pays the measurement (a few seconds; 10-12 s on a 2-CPU AMD EPYC) on its first
adaptive load only: a load at one level weighs nothing and measures nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcdn import __version__, paths
from kvcdn.codec import TEXT_LEVEL, Level, decode_chunk, encode_chunk, uses_profile
from kvcdn.codecs import known_codec
from kvcdn.manifest import Manifest
from kvcdn.models import LoadedModel

if TYPE_CHECKING:
    from kvcdn.codec_profile import CodecProfile

log = logging.getLogger(__name__)

#: Recompute speed is measured for this many tokens after each of these contexts ...
MEASURE_TOKENS = 256
MEASURE_CONTEXTS = (256, 1024)
#: ... and for this many, to tell a forward pass's fixed cost from its cost a token
#: (a question's forward pass is this short; a chunk's 256 tokens hide the fixed cost).
MEASURE_SHORT_TOKENS = 64
CACHE_FORMAT = "3"  # "3": with s_per_forward


@dataclass
class DeviceSpeed:
    """Measured device costs: decode seconds per token by level id, and recompute cost.

    A forward pass over ``tokens`` costs ``s_per_forward`` (the weights read once,
    however few its tokens: most of a short question's time on a CPU) plus
    ``s_per_token + s_per_token_context * context`` seconds per token, ``context``
    being the tokens it attends to.
    """

    s_per_token: float
    s_per_token_context: float
    decode_s_per_token: dict[str, float] = field(default_factory=dict)
    #: False for :func:`assumed_speed`'s figures: no prediction is made from them
    measured: bool = True
    s_per_forward: float = 0.0
    #: What this process's loads have shown of the device against these figures
    #: (contention with the fetches beside it, clocks), as factors on each: a load
    #: starts from what the last one learnt and goes on correcting it. Not cached: it
    #: describes the process's conditions, not the device.
    decode_factor: float = 1.0
    recompute_factor: float = 1.0

    def decode_seconds(self, level_id: str, tokens: int) -> float:
        return self.decode_s_per_token[level_id] * tokens

    def recompute_seconds(self, tokens: int, context: int = 0) -> float:
        """Seconds of one forward pass over ``tokens`` tokens that follow ``context``
        cached tokens (a chunk recomputed, a question asked)."""
        per_token = self.s_per_token + self.s_per_token_context * (context + tokens / 2)
        return self.s_per_forward + tokens * per_token


#: Decode cost assumed where a device was never measured (an engine's load, which
#: has no model here to measure with); a load corrects it by its own decodes.
ASSUMED_DECODE_S_PER_TOKEN = 4e-5


def assumed_speed(manifest: Manifest) -> DeviceSpeed:
    """A device's speed before any measurement, for loads that never recompute."""
    return DeviceSpeed(
        s_per_token=0.0,
        s_per_token_context=0.0,
        decode_s_per_token={
            lv.id: ASSUMED_DECODE_S_PER_TOKEN
            for name, lv in manifest.levels.items()
            if name != TEXT_LEVEL
        },
        measured=False,
    )


def _filled_in(known: DeviceSpeed | None, manifest: Manifest) -> DeviceSpeed:
    """What is ``known`` of a device, and :func:`assumed_speed`'s figures for the rest."""
    speed = assumed_speed(manifest)
    if known is not None:
        speed.s_per_token, speed.s_per_token_context = known.s_per_token, known.s_per_token_context
        speed.s_per_forward = known.s_per_forward
        speed.decode_s_per_token.update(known.decode_s_per_token)
    return speed


def cache_path() -> Path:
    return Path(os.environ.get("KVCDN_SPEED_CACHE") or paths.cache_dir() / "device-speed.json")


class DeviceSpeeds:
    """What a client knows of its devices' speeds: read from the machine's cache file,
    measured when missing (and then written to it), remembered for the client's life."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memo: dict[str, DeviceSpeed] = {}
        self._warmed: set[str] = set()  # devices whose codec kernels are loaded

    def get(
        self, loaded: LoadedModel, manifest: Manifest, profile: CodecProfile | None,
        *, measure: bool = True,
    ) -> tuple[DeviceSpeed, float]:  # fmt: skip
        """This device's speed for ``loaded`` and every level of ``manifest``, and the
        seconds spent measuring it now (0.0 when it was known). Without ``measure``
        (a load at one level, which weighs nothing against anything), what is not
        known is not measured either: :func:`assumed_speed`'s figures (``measured``
        False) in place of the missing ones."""
        import torch

        key = "|".join(
            (
                CACHE_FORMAT,
                loaded.fingerprint[:16],
                _device_name(loaded.device),
                torch.__version__,
                __version__,
            )
        )
        levels = {
            lv.id: Level(name, lv.codec, lv.params)
            for name, lv in manifest.levels.items()
            if name != TEXT_LEVEL and known_codec(lv.codec) is not None
            and (not uses_profile(lv.codec) or profile is not None)
        }
        measured_s = 0.0
        with self._lock:
            speed = self._memo.get(key) or _read_cache(key)
            if speed is not None:
                self._memo[key] = speed
            missing = speed is None or bool(set(levels) - set(speed.decode_s_per_token))
            if missing and not measure:
                speed = _filled_in(speed, manifest)
            elif missing:
                t = time.perf_counter()
                speed = _measure(loaded, levels, profile, speed)  # this also warms the kernels
                _write_cache(key, speed)
                self._memo[key] = speed
                self._warmed.add(loaded.device)
                measured_s = time.perf_counter() - t
            warm = profile is not None and loaded.device not in self._warmed
            if warm:
                self._warmed.add(loaded.device)
        if warm:
            assert profile is not None
            # Not a daemon: a daemon thread still inside a torch op when the interpreter
            # exits is ended by CPython unwinding through torch's C++ frames, which
            # aborts the process ("terminate called without an active exception").
            # Python joins this one first: an exit waits for it (80 ms; a few seconds
            # while numba loads its kernels).
            threading.Thread(
                target=_warm_kernels, args=(profile, loaded.device), name="kvcdn-warm-kernels"
            ).start()
        return speed, measured_s

    def is_known(self, loaded: LoadedModel) -> bool:
        """Whether this device's speeds for ``loaded`` are known (no measuring to come)."""
        device = _device_name(loaded.device)
        with self._lock:
            return any(
                k.split("|")[1:3] == [loaded.fingerprint[:16], device] for k in self._memo
            )


def _warm_kernels(profile: CodecProfile, device: str) -> None:
    """Decode a tiny chunk of the ladder and one of the nested ladder, so the first real
    decode does not pay for loading the compiled kernels (about 0.4 s on a CPU) nor
    for the tables made once per profile (the nested vector kernel's: 90 ms in a new
    process on a 2-CPU EPYC), while the first fetches are on the wire."""
    import torch

    from kvcdn.codec import ladder_level, nested_level

    lay = profile.layout
    kv = torch.zeros(lay.layers, 2, lay.kv_heads, 8, lay.head_dim)
    levels = [ladder_level(next(iter(profile.levels)), profile)]
    if profile.nested is not None:
        levels.append(nested_level(profile.nested.tiers[0], profile))
    for level in levels:
        try:
            blob = encode_chunk(level, kv, "0" * 64, profile=profile, start=64)
            decode_chunk(blob, device=device, profile=profile, verified=True, tiers=level.tiers)
        except Exception as exc:  # only a warm-up: the real decode reports real errors
            log.debug("kernel warm-up of %s failed: %s", level.name, exc)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}cpu"


def _measure(
    loaded: LoadedModel,
    levels: dict[str, Level],
    profile: CodecProfile | None,
    known: DeviceSpeed | None,
) -> DeviceSpeed:
    import torch

    started = time.perf_counter()
    ids = _measure_ids(loaded, max(MEASURE_CONTEXTS) + MEASURE_TOKENS)
    timed: dict[tuple[int, int], float] = {}  # (tokens, context) -> seconds of a forward
    kv = None
    for context in MEASURE_CONTEXTS:
        prefix = loaded.prefill(ids[:context])
        for tokens in (MEASURE_SHORT_TOKENS, MEASURE_TOKENS):  # the chunk's kv last
            timings = []
            for _ in range(2):  # the first run also warms up
                t = time.perf_counter()
                kv = loaded.extend(prefix, ids[context : context + tokens])
                _sync(loaded.device)
                timings.append(time.perf_counter() - t)
            timed[tokens, context] = min(timings)
    assert kv is not None
    speed = _fitted(timed)
    speed.decode_s_per_token = dict(known.decode_s_per_token) if known else {}
    dtype = torch.float32 if loaded.device == "cpu" else next(loaded.model.parameters()).dtype
    out = torch.empty(kv.shape, dtype=dtype, device=loaded.device)
    for level_id, level in levels.items():
        if level_id in speed.decode_s_per_token:
            continue
        blob = encode_chunk(level, kv, "0" * 64, profile=profile, start=max(MEASURE_CONTEXTS))
        runs = []
        for _ in range(4):  # the first run loads the decode kernels
            t = time.perf_counter()
            decode_chunk(blob, device=loaded.device, profile=profile, out=out, verified=True,
                         tiers=level.tiers)
            _sync(loaded.device)
            runs.append(time.perf_counter() - t)
        speed.decode_s_per_token[level_id] = statistics.median(runs[1:]) / MEASURE_TOKENS
    log.info(
        "measured this device in %.1f s: recompute %.0f tokens/s (after 1,024 tokens), "
        "%.0f ms a forward pass besides; decode %s",
        time.perf_counter() - started,
        MEASURE_TOKENS / speed.recompute_seconds(MEASURE_TOKENS, 1024),
        speed.s_per_forward * 1e3,
        {k: f"{1 / v:.0f} tokens/s" for k, v in speed.decode_s_per_token.items()},
    )
    return speed


def _fitted(timed: dict[tuple[int, int], float]) -> DeviceSpeed:
    """The forward-pass model through the measured passes (``(tokens, context)`` ->
    seconds): the context's cost from the long passes' two contexts, then the cost a
    token and a pass's fixed cost from the long and the short pass at each context,
    averaged over the contexts."""
    n, m = MEASURE_TOKENS, MEASURE_SHORT_TOKENS
    c1, c2 = MEASURE_CONTEXTS
    slope = max(0.0, (timed[n, c2] - timed[n, c1]) / (n * (c2 - c1)))

    def attention(tokens: int, context: int) -> float:
        return slope * tokens * (context + tokens / 2)

    per_token = statistics.mean(
        (timed[n, c] - timed[m, c] - attention(n, c) + attention(m, c)) / (n - m)
        for c in MEASURE_CONTEXTS
    )
    per_token = max(per_token, 1e-9)
    fixed = statistics.mean(timed[m, c] - m * per_token - attention(m, c) for c in MEASURE_CONTEXTS)
    return DeviceSpeed(per_token, slope, s_per_forward=max(fixed, 0.0))


def _measure_ids(loaded: LoadedModel, n: int) -> list[int]:
    """``n`` tokens of ordinary prose (the cost of a forward pass hardly depends on them)."""
    text = (
        "A content delivery network keeps copies of what people ask for close to them, so "
        "that the second reader waits less than the first. Caches near the readers serve "
        "the bytes; the origin keeps the one true copy, and every copy can be checked. "
    )
    ids: list[int] = []
    while len(ids) < n:
        ids += loaded.document_ids(text)
    return ids[:n]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))


def _read_cache(key: str) -> DeviceSpeed | None:
    try:
        raw = json.loads(cache_path().read_text()).get(key)
        if not isinstance(raw, dict):
            return None
        # JSON allows NaN and Infinity: a figure that is not finite is damage too
        decode = {str(k): float(v) for k, v in raw["decode_s_per_token"].items()
                  if math.isfinite(float(v)) and float(v) > 0}  # fmt: skip
        speed = DeviceSpeed(float(raw["s_per_token"]), float(raw["s_per_token_context"]), decode,
                            s_per_forward=float(raw["s_per_forward"]))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # no cache, or a damaged one: measure again
    figures = (speed.s_per_token, speed.s_per_token_context, speed.s_per_forward)
    if not (all(map(math.isfinite, figures)) and speed.s_per_token > 0
            and speed.s_per_token_context >= 0 and speed.s_per_forward >= 0):  # fmt: skip
        return None
    return speed


def _write_cache(key: str, speed: DeviceSpeed) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            everything: dict[str, Any] = json.loads(path.read_text())
            if not isinstance(everything, dict):
                everything = {}
        except (OSError, ValueError):
            everything = {}
        everything[key] = {
            "s_per_token": speed.s_per_token,
            "s_per_token_context": speed.s_per_token_context,
            "s_per_forward": speed.s_per_forward,
            "decode_s_per_token": speed.decode_s_per_token,
        }
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(everything, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measure again next time
        log.warning("cannot cache the device speed in %s: %s", path, exc)
