"""Hugging Face model folders materialised once from models that are not one (GGUF).

Loading a GGUF file through transformers parses it three times and
dequantises every tensor: 18-26 s for the embedded 135M model on two CPUs.
The first load of such a model writes what it produced as a standard Hugging
Face folder (``config.json``, ``generation_config.json``, ``model.safetensors``
in the dequantised dtype, the tokenizer files), which every later load, in
any process, reads memory-mapped in a fraction of a second. It is a complete
folder: ``AutoModelForCausalLM.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)`` open it on their own, and so does
vLLM.

Layout: ``$XDG_CACHE_HOME/kvcdn/models/{name}-{sha256 of the GGUF[:16]}/``,
so a changed GGUF makes a new folder. A folder is built in a temporary folder
beside it under an exclusive lock (``.lock-{key}``; a second process waits,
then uses the first one's folder), then renamed into place: a crash leaves
no half folder under the final name. ``kvcdn-model.json``, written last,
records the source file's sha256 and every file's size and sha256. Before a
folder is loaded, each file is checked against it: by a full hash the first
time, later by its stat stamp (size, mtime, ctime, inode; any write to a
file changes its ctime), and the folder may hold nothing else (transformers
would read an added index or weights file). A folder that fails is rebuilt,
never loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import paths
from .errors import InputError, ModelError

log = logging.getLogger(__name__)

MANIFEST = "kvcdn-model.json"
STAMPS = ".kvcdn-verified.json"  # stat stamps of files whose hash was checked
FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 20
_KEY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,80}-[0-9a-f]{16}$")


def models_dir() -> Path:
    """Where materialised model folders live (it may not exist yet)."""
    return paths.cache_dir() / "models"


def folder_key(name: str, source_sha256: str) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "model"
    return f"{slug[:64]}-{source_sha256[:16]}"


@dataclass(frozen=True)
class CachedModel:
    """One materialised folder, as :func:`list_cached` finds it."""

    key: str
    path: Path
    name: str  # the model name it was made for
    source_file: str  # the GGUF file's name
    source_sha256: str
    bytes: int
    created_at: str
    complete: bool  # a manifest and every file it lists, at its size (no hashing)


# ---- checking ----------------------------------------------------------------------
def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        manifest = json.loads(data) if len(data) <= MAX_MANIFEST_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    files = manifest.get("files")
    source = manifest.get("source")
    if not isinstance(files, dict) or not isinstance(source, dict):
        return None
    for rel, entry in files.items():
        if (
            not isinstance(rel, str)
            or "/" in rel
            or rel.startswith(".")
            or not isinstance(entry, dict)
            or type(entry.get("bytes")) is not int
            or not isinstance(entry.get("sha256"), str)
        ):
            return None
    return manifest


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def source_of(folder: Path) -> tuple[str, str] | None:
    """(model name, source sha256) when ``folder`` is one kvcdn materialised and its
    files are still the ones it wrote."""
    manifest = _read_manifest(folder)
    if manifest is None:
        return None
    name, sha256 = manifest.get("name"), manifest["source"].get("sha256")
    if not isinstance(name, str) or not isinstance(sha256, str):
        return None
    if not check_folder(folder, sha256):
        return None
    return name, sha256


def check_folder(folder: Path, source_sha256: str) -> bool:
    """Whether ``folder`` is a complete materialisation of the source with this sha256.

    Files are hashed when their stat stamp differs from the one recorded at
    their last full check (the first check, or after any write to them).
    """
    manifest = _read_manifest(folder)
    if manifest is None or manifest["source"].get("sha256") != source_sha256:
        return False
    try:
        stamps = json.loads((folder / STAMPS).read_text())
        if not isinstance(stamps, dict):
            stamps = {}
    except (OSError, ValueError):
        stamps = {}
    checked: dict[str, list[int]] = {}
    try:
        # nothing beside what was written: transformers would read an added index,
        # weights file or config as readily as the recorded ones
        present = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
        if present != {*manifest["files"], MANIFEST}:
            log.warning("%s holds files it was not made with", folder)
            return False
        for rel, entry in manifest["files"].items():
            path = folder / rel
            stamp = _stamp(path)
            if stamp[0] != entry["bytes"]:
                log.warning("%s is %d bytes, not %d", path, stamp[0], entry["bytes"])
                return False
            if stamps.get(rel) != stamp:
                if _sha256(path) != entry["sha256"]:
                    log.warning("%s does not match its recorded sha256", path)
                    return False
            checked[rel] = stamp
    except OSError as exc:
        log.warning("cannot check %s: %s", folder, exc)
        return False
    if checked != stamps:
        with contextlib.suppress(OSError):  # a read-only cache is checked again next time
            _write_json(folder / STAMPS, checked)
    return True


# ---- building ----------------------------------------------------------------------
def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(key: str) -> Iterator[None]:
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".lock-{key}", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


#: Writes a model's files into an empty folder (``save_pretrained`` of the model
#: and of its tokenizer).
Writer = Callable[[Path], None]


def ensure_folder(
    name: str, source_file: Path, source_sha256: str, write: Writer
) -> tuple[Path, float]:
    """The checked materialised folder of ``source_file``, built with ``write`` if
    missing or failing its check. Returns the folder and the seconds spent building
    it (0.0 when it was already there)."""
    key = folder_key(name, source_sha256)
    final = models_dir() / key
    if check_folder(final, source_sha256):
        return final, 0.0
    with _locked(key):
        if check_folder(final, source_sha256):  # another process built it meanwhile
            return final, 0.0
        started = time.perf_counter()
        root = models_dir()
        for stale in root.glob(f".tmp-{key}-*"):  # left by a build that crashed
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            log.warning("rebuilding %s: it is incomplete or was modified", final)
            _remove(final)
        tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write(tmp)
            files = {}
            for path in sorted(tmp.iterdir()):
                if not path.is_file():
                    raise ModelError(f"materialising {name} wrote {path.name}, not a file")
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
                files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            _write_json(
                tmp / MANIFEST,
                {
                    "format": FORMAT,
                    "name": name,
                    "source": {"file": source_file.name, "sha256": source_sha256},
                    "files": files,
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
            )
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.perf_counter() - started
        log.info("materialised %s into %s in %.1f s", name, final, seconds)
        if not check_folder(final, source_sha256):  # records the stamps; never expected
            raise ModelError(f"the folder just materialised for {name} does not check out")
        return final, seconds


# ---- listing and removing ---------------------------------------------------------
def list_cached() -> list[CachedModel]:
    """The materialised folders on this machine, by key."""
    root = models_dir()
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(root.iterdir()):
        if not folder.is_dir() or not _KEY.match(folder.name):
            continue
        manifest = _read_manifest(folder)
        try:
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            complete = manifest is not None and all(
                (folder / rel).is_file() and (folder / rel).stat().st_size == entry["bytes"]
                for rel, entry in manifest["files"].items()
            )
        except OSError:  # being removed or rebuilt by another process right now
            continue
        source = (manifest or {}).get("source", {})
        found.append(
            CachedModel(
                key=folder.name,
                path=folder,
                name=str((manifest or {}).get("name", "?")),
                source_file=str(source.get("file", "?")),
                source_sha256=str(source.get("sha256", "")),
                bytes=size,
                created_at=str((manifest or {}).get("created_at", "")),
                complete=complete,
            )
        )
    return found


def _remove(folder: Path) -> None:
    """Move aside, then delete: a reader never sees a half-deleted folder under its name."""
    trash = folder.with_name(f".tmp-{folder.name}-trash-{uuid.uuid4().hex[:8]}")
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_cached(key: str) -> CachedModel:
    """Delete the materialised folder ``key`` (as :func:`list_cached` names it)."""
    for cached in list_cached():
        if cached.key == key:
            with _locked(key):
                if cached.path.exists():
                    _remove(cached.path)
            return cached
    raise InputError(f"no cached model folder '{key}' (see `kvcdn models`)")
