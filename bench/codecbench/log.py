"""Progress and warnings on stderr, so that stdout holds only the tables."""

from __future__ import annotations

import time
from typing import Any

_console: Any = None


def _err() -> Any:
    global _console
    if _console is None:  # rich is imported on first use: ``--help`` stays quick
        from rich.console import Console

        _console = Console(stderr=True)
    return _console


def log(msg: str) -> None:
    _err().print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")


def warn(msg: str) -> None:
    _err().print(f"[yellow]warning:[/yellow] {msg}")
