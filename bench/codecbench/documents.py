"""The documents the codec benchmark runs on: none of them a calibration text.

Default: bash(1) (from character 60,000 on), curl(1) and grep(1), rendered
with ``MANWIDTH=80 man -P cat NAME | col -bx``, and one seed text from
``../shared/seeds`` (a folder beside the checkout, not part of the
repository), each used where this machine has it; ``--docs`` replaces them.
Studies that compare two codecs document by document add more pages
(:data:`MORE_MAN_PAGES`: tar, ssh, man, dpkg, systemctl, journalctl, strace,
openssl, perl).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .log import warn

REPO = Path(__file__).resolve().parents[2]
MAN_PAGES = (("bash", 60000), ("curl", 0), ("grep", 0))  # (page, first character kept)
#: More held-out pages (none a calibration text), for studies that compare two codecs'
#: quality document by document and need more documents than the default set.
MORE_MAN_PAGES = (("tar", 0), ("ssh", 0), ("man", 0), ("dpkg", 0), ("systemctl", 0),
                  ("journalctl", 0), ("strace", 0), ("openssl", 0), ("perl", 0))  # fmt: skip
#: Relative to the checkout, so any machine with the shared folder beside it finds it.
SEED_DOC = REPO.parent / "shared" / "seeds" / "000_5ef0ab13d28a5ea6.txt"


def render_man(page: str, skip: int, folder: Path) -> Path | None:
    """``man page`` as plain text from character ``skip`` on, in ``folder``; None without it."""
    env = {**os.environ, "MANWIDTH": "80"}
    try:
        raw = subprocess.run(
            ["man", "-P", "cat", page], env=env, capture_output=True, check=True, timeout=60
        ).stdout
        text = subprocess.run(
            ["col", "-bx"], input=raw, capture_output=True, check=True, timeout=60
        ).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.SubprocessError) as exc:
        warn(f"cannot render man {page}: {exc}; skipping it")
        return None
    path = folder / f"man-{page}.txt"
    path.write_text(text[skip:], encoding="utf-8")
    return path


def gather_docs(paths: list[Path] | None, folder: Path, *, more: bool = False
                ) -> list[tuple[str, Path, str]]:  # fmt: skip
    """(name, path, origin) of each document: ``paths``, or the default set rendered in
    ``folder`` (``more``: and :data:`MORE_MAN_PAGES`).

    Names are made unique with a ``-2``, ``-3`` ... suffix.
    """
    out: list[tuple[str, Path, str]] = []
    if paths:
        for p in paths:
            out.append((p.stem, p, str(p)))
    else:
        for page, skip in MAN_PAGES + (MORE_MAN_PAGES if more else ()):
            path = render_man(page, skip, folder)
            if path is not None:
                origin = f"MANWIDTH=80 man -P cat {page} | col -bx"
                out.append((f"man-{page}", path, origin + (f", from char {skip}" if skip else "")))
        if SEED_DOC.is_file():
            out.append((SEED_DOC.stem, SEED_DOC, str(SEED_DOC)))
        else:
            warn(
                f"{SEED_DOC} not found (the seed text lives in ../shared/seeds beside the "
                "checkout, not in the repository): skipping it; pass --docs FILE ... to choose "
                "the documents"
            )
    seen: dict[str, int] = {}
    named = []
    for name, path, origin in out:
        seen[name] = seen.get(name, 0) + 1
        named.append((name if seen[name] == 1 else f"{name}-{seen[name]}", path, origin))
    return named
