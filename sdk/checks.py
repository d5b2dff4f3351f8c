"""Checks of the SDK's arguments: a wrong type or value is an error that names the argument.

Each raises :class:`~kvcdn.errors.ArgumentError`, which is a ``TypeError`` for
Python callers and a kvcdn error (exit code 2) for the CLI, before anything
is read, loaded or allocated.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvcdn.errors import ArgumentError
from kvcdn.signing import TrustPolicy

#: A question longer than this many characters per token of the context window
#: cannot fit it, whatever the tokenizer: refused before tokenizing.
MAX_CHARS_PER_TOKEN = 32


def _kind(value: Any) -> str:
    return type(value).__name__


def optional_string(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ArgumentError(f"{name} must be a string, not {_kind(value)}")
    return value


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, not {_kind(value)}")
    return value


def source(value: Any, name: str = "source") -> str | Path:
    """A document: ``name[@version]``, a path, or the text itself."""
    if isinstance(value, Path):
        return value
    if not isinstance(value, str):
        raise ArgumentError(f"{name} must be a document name, a path or a text, not {_kind(value)}")
    if not value.strip():
        raise ArgumentError(f"{name} is empty")
    return value


def store(value: Any) -> None:
    from kvcdn.store import Store

    if value is None or isinstance(value, (str, Store)):
        return
    if all(hasattr(value, attr) for attr in ("get", "list", "url")):  # a Reader
        return
    raise ArgumentError(f"store must be a store URL or a Store, not {_kind(value)}")


def model(value: Any) -> None:
    from kvcdn.models import LoadedModel

    if value is not None and not isinstance(value, (str, LoadedModel)):
        raise ArgumentError(f"model must be a model name or a loaded model, not {_kind(value)}")


def quality(value: Any) -> str:
    if value is None:
        return "auto"
    if not isinstance(value, str):
        raise ArgumentError(f"quality must be a level name, 'auto' or 'text', not {_kind(value)}")
    return value.strip().lower() or "auto"


def deadline(value: Any, name: str = "deadline_s") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{name} must be a number of seconds, not {_kind(value)}")
    if not (value > 0 and math.isfinite(value)):
        raise ArgumentError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def ratio(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ArgumentError(f"{name} must be a number from 0 to 1, not {value!r}")
    return float(value)


def count(value: Any, name: str, minimum: int = 1, maximum: int = 1 << 20) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be an integer, not {_kind(value)}")
    if not minimum <= value <= maximum:
        raise ArgumentError(f"{name} must be from {minimum} to {maximum}, not {value}")
    return value


def question(value: Any, context_window: int, name: str = "question") -> str:
    """A non-empty question short enough that it could fit the context window."""
    if not isinstance(value, str):
        raise ArgumentError(f"{name} must be a string, not {_kind(value)}")
    if not value.strip():
        raise ArgumentError(f"the {name} is empty")
    if len(value) > MAX_CHARS_PER_TOKEN * context_window:
        raise ArgumentError(
            f"the {name} is {len(value):,} characters, more than a context window of "
            f"{context_window:,} tokens can hold"
        )
    return value


def policy(value: Any) -> Any:
    """A planner: a function with :func:`kvcdn.sdk.planner.plan`'s signature, or None."""
    if value is None or callable(value):
        return value
    raise ArgumentError(
        f"policy must be a planner function like kvcdn.sdk.planner.plan, not {_kind(value)}"
        + (f" {value!r}" if isinstance(value, str) else "")
    )


def predictor(value: Any) -> Any:
    """A throughput predictor: an object with ``predict_seconds(nbytes)`` and
    ``observe(nbytes, seconds)`` (:class:`kvcdn.sdk.planner.ThroughputPredictor`), or None."""
    if value is None:
        return value
    missing = [m for m in ("predict_seconds", "observe") if not callable(getattr(value, m, None))]
    if missing:
        raise ArgumentError(
            f"predictor must be a throughput predictor such as "
            f"kvcdn.sdk.planner.HarmonicPredictor(), not {_kind(value)}"
            + (f" {value!r}" if isinstance(value, str) else "")
            + f" (it has no {' or '.join(missing)})"
        )
    return value


def trust(value: Any) -> TrustPolicy | None:
    """A :class:`TrustPolicy`, or the path of a trust file (read now), or None."""
    if value is None or isinstance(value, TrustPolicy):
        return value
    if isinstance(value, (str, Path)):
        return TrustPolicy.from_file(value)
    raise ArgumentError(f"trust must be a TrustPolicy or a trust file's path, not {_kind(value)}")
