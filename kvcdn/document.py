"""Documents: the text a publish reads and a load finds by, checked once.

What a user passes as a document (a file, a folder, a glob, or the text itself) becomes
UTF-8 text here, with one clear error for a missing, empty or binary file; its sha256
(:func:`source_digest`) is what the source index finds a published version by.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from .errors import InputError
from .keys import check_name, name_from_filename


def read_document(path: str | Path) -> str:
    """A document's text; clear errors for missing, empty or binary files."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a document")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    return document_text(data, str(path))


def expand_documents(paths: Sequence[str | Path]) -> list[Path]:
    """The documents ``paths`` name, each once, in the order given: a file as is, a
    folder as the files under it (recursively, sorted, hidden ones skipped), and a
    glob pattern (``*``, ``?``, ``[``; ``**`` recurses) as its matches, for shells
    that pass patterns through. A path that names nothing is an :class:`InputError`."""
    import glob

    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            files = sorted(
                f for f in path.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in
                                           f.relative_to(path).parts)
            )  # fmt: skip
            if not files:
                raise InputError(f"{path}: the folder holds no document")
        elif path.exists() or not any(c in str(raw) for c in "*?["):
            files = [path]  # a missing file is reported by name when it is read
        else:
            files = sorted(Path(f) for f in glob.glob(str(path), recursive=True))
            files = [f for f in files if f.is_file()]
            if not files:
                raise InputError(f"{raw}: no file matches")
        found.update(dict.fromkeys(files))
    return list(found)


def is_document_path(source: str) -> bool:
    """Whether ``source`` names a file on this machine (a text or a name never does:
    multi-line strings, strings longer than a path can be, and NUL bytes are not)."""
    if "\n" in source or len(source) > 4096:
        return False
    try:
        return Path(source).expanduser().is_file()
    except (OSError, ValueError):  # a name too long for the system, a NUL byte
        return False


def document_text(data: bytes, what: str) -> str:
    if b"\0" in data[:65536]:
        raise InputError(f"{what} is a binary file; kvcdn publishes text documents")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{what} is not UTF-8 text; kvcdn publishes text documents") from None
    if not text.strip():
        raise InputError(f"{what} is empty")
    return text


def source_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def document_and_name(
    path: str | Path | None, text: str | None, name: str | None
) -> tuple[str, str]:
    """The text to publish and its document name, checked (nothing is loaded yet)."""
    if (path is None) == (text is None):
        raise InputError("publish needs either a path or a text")
    if path is not None:
        text = read_document(path)
        name = name or name_from_filename(Path(path).stem)
    else:
        if not isinstance(text, str):
            raise InputError(f"text must be a string, not {type(text).__name__}")
        text = document_text(text.encode("utf-8"), "the text")
        if not name:
            raise InputError("publishing a text needs a document name")
    return text, check_name(name)
