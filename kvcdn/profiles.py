"""Where codec profiles live: the store (shared), and a local cache (per machine).

A profile is a content-addressed object (``profiles/{fp16}/{sha256}.safetensors``)
plus a small pointer per model (``profiles/{fp16}/current.json``) that the
first publish writes. Manifests name the exact object they were encoded
with, so a later recalibration never changes how an old version decodes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from .calibrate import ProgressFn, calibrate
from .errors import FormatError, IntegrityError, NotFound
from .manifest import ObjectRef
from .models import LoadedModel
from .profile import CodecProfile, parse_profile, profile_key, profile_pointer_key
from .store import Reader, Store

log = logging.getLogger(__name__)

_loaded: dict[str, CodecProfile] = {}  # sha256 -> parsed profile, per process
_lock = threading.Lock()


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("KVCDN_PROFILE_CACHE", root / "kvcdn" / "profiles"))


def load_profile(store: Reader, ref: ObjectRef) -> CodecProfile:
    """The profile ``ref`` names, verified against its checksum (cached per process)."""
    with _lock:
        if ref.sha256 in _loaded:
            return _loaded[ref.sha256]
    local = cache_dir() / f"{ref.sha256}.safetensors"
    data = local.read_bytes() if local.is_file() else None
    if data is None or hashlib.sha256(data).hexdigest() != ref.sha256:
        try:
            data = store.get(ref.key)
        except NotFound:
            raise NotFound(f"codec profile {ref.key} is missing from {store.url}") from None
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise IntegrityError(f"codec profile {ref.key} does not match its checksum")
        _write_local(ref.sha256, data)
    profile = parse_profile(data, name=f"codec profile {ref.key}")
    with _lock:
        _loaded[ref.sha256] = profile
    return profile


def current_profile(store: Store, fingerprint: str) -> tuple[CodecProfile, ObjectRef] | None:
    """The profile the store's pointer names for a model, if any."""
    key = profile_pointer_key(fingerprint)
    try:
        raw = json.loads(store.get(key))
        ref = ObjectRef(key=str(raw["key"]), bytes=int(raw["bytes"]), sha256=str(raw["sha256"]))
    except NotFound:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{key} is not a valid profile pointer: {exc}") from None
    return load_profile(store, ref), ref


def local_profile(fingerprint: str) -> CodecProfile | None:
    """The newest valid profile for ``fingerprint`` in this machine's cache."""
    folder = cache_dir()
    if not folder.is_dir():
        return None
    candidates = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            profile = parse_profile(path.read_bytes(), name=str(path))
        except (FormatError, OSError) as exc:
            log.warning("ignoring unreadable cached profile: %s", exc)
            continue
        if profile.model_fingerprint == fingerprint:
            return profile
    return None


def publish_profile(store: Store, profile: CodecProfile) -> ObjectRef:
    """Store ``profile`` (create-only, content-addressed) and point the model at it."""
    data = profile.to_bytes()
    ref = ObjectRef(
        profile_key(profile.model_fingerprint, profile.sha256), len(data), profile.sha256
    )
    if not store.exists(ref.key):
        store.put_new(ref.key, data)
    pointer = json.dumps({"key": ref.key, "bytes": ref.bytes, "sha256": ref.sha256}).encode()
    store.put(profile_pointer_key(profile.model_fingerprint), pointer)
    _write_local(profile.sha256, data)
    return ref


def ensure_profile(
    store: Store, model: LoadedModel, progress: ProgressFn | None = None
) -> tuple[CodecProfile, ObjectRef]:
    """The model's profile: from the store, else this machine's cache, else calibrate now."""
    found = current_profile(store, model.fingerprint)
    if found is not None:
        found[0].check_model(model.fingerprint, f"the codec profile in {store.url}")
        return found
    profile = local_profile(model.fingerprint)
    if profile is None:
        log.info("no codec profile for %s yet: calibrating", model.name)
        profile = calibrate(model, progress=progress)
    profile.check_model(model.fingerprint)
    return profile, publish_profile(store, profile)


def _write_local(sha256: str, data: bytes) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{sha256}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"{sha256}.safetensors")
    except OSError as exc:  # a read-only home must not stop a publish
        log.warning("cannot cache the codec profile locally: %s", exc)
