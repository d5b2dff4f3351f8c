"""Where kvcdn keeps files on this machine: the one definition of its folders.

Caches (``$XDG_CACHE_HOME/kvcdn``, default ``~/.cache/kvcdn``) hold what can be
recomputed or fetched again: the default local store, codec profiles, weight
digests, device speeds. State (``$XDG_STATE_HOME/kvcdn``, default
``~/.local/state/kvcdn``) holds what must not be lost: the versions a reader
has seen (rollback protection).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """kvcdn's cache folder (it may not exist yet)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "kvcdn"


def state_dir() -> Path:
    """kvcdn's state folder (it may not exist yet)."""
    root = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(root) / "kvcdn"
