"""Reading JSON that came from a store, an edge or a network: bounded and strict.

Every JSON document kvcdn reads from outside (manifests, pointers, signed
envelopes, chunk headers, profile metadata) goes through :func:`loads`, which
refuses, with a :class:`~kvcdn.errors.FormatError` naming the document:

* more than ``max_bytes`` bytes (checked before anything is parsed);
* nesting deeper than ``max_depth`` (checked on the raw bytes first, so a
  100,000-deep array never reaches the recursive parser);
* text that is not UTF-8, duplicate keys in one object (two parsers could
  disagree about which one counts), and ``NaN`` or ``Infinity``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import FormatError

MAX_DEPTH = 32
# A JSON string, unrolled so that matching it never backtracks.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def loads(data: bytes, *, what: str, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data`` as strict JSON; ``what`` names it in errors."""
    if len(data) > max_bytes:
        raise FormatError(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit")
    depth = nesting(data)
    if depth > max_depth:
        raise FormatError(f"{what} nests {depth} levels deep (at most {max_depth} allowed)")
    try:
        text = bytes(data).decode("utf-8")
        return json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise FormatError(f"{what} is not UTF-8 text") from None
    except _Strict as exc:
        raise FormatError(f"{what}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{what} is not valid JSON: {exc}") from None


def nesting(data: bytes) -> int:
    """How deep arrays and objects nest in ``data`` (strings skipped)."""
    brackets = _STRING.sub(b"", bytes(data)).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for c in brackets:
        if c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class _Strict(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Strict(f"duplicate key {key[:64]!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise _Strict(f"{name} is not a JSON number")
