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
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from . import paths
from .calibrate import ProgressFn, calibrate
from .codec_profile import CodecProfile, parse_profile
from .errors import FormatError, NotFound, TrustError
from .keys import profile_key, profile_pointer_key
from .manifest import MAX_POINTER_BYTES, MAX_PROFILE_BYTES, ObjectRef
from .models import LoadedModel
from .signing import PROFILE_POINTER_TYPE, SigningKey, TrustPolicy, open_document, seal
from .store import Reader, Store

log = logging.getLogger(__name__)

#: Parsed profiles a :class:`ProfileCache` keeps (each is a few megabytes at most).
MAX_CACHED_PROFILES = 8


def cache_dir() -> Path:
    """This machine's folder of codec profiles (``KVCDN_PROFILE_CACHE`` overrides)."""
    return Path(os.environ.get("KVCDN_PROFILE_CACHE") or paths.cache_dir() / "profiles")


class ProfileCache:
    """Parsed codec profiles by sha256, the most recently used kept (what a client holds)."""

    def __init__(self, max_profiles: int = MAX_CACHED_PROFILES) -> None:
        self.max_profiles = max_profiles
        self._profiles: dict[str, CodecProfile] = {}
        self._lock = threading.Lock()

    def get(self, sha256: str) -> CodecProfile | None:
        with self._lock:
            profile = self._profiles.pop(sha256, None)
            if profile is not None:
                self._profiles[sha256] = profile
            return profile

    def add(self, sha256: str, profile: CodecProfile) -> None:
        with self._lock:
            self._profiles[sha256] = profile
            while len(self._profiles) > self.max_profiles:
                del self._profiles[next(iter(self._profiles))]


def load_profile(
    store: Reader,
    ref: ObjectRef,
    *,
    placement: str | None = None,
    cache: ProfileCache | None = None,
) -> CodecProfile:
    """The profile ``ref`` names, verified against its size and sha256: from ``cache``,
    this machine's profile folder, or ``store`` (read by ``placement``)."""
    if cache is not None and (profile := cache.get(ref.sha256)) is not None:
        return profile
    local = cache_dir() / f"{ref.sha256}.safetensors"
    data = local.read_bytes() if local.is_file() else None
    if data is None or hashlib.sha256(data).hexdigest() != ref.sha256:
        try:
            data = store.get(ref, placement=placement)
        except NotFound:
            raise NotFound(f"codec profile {ref.key} is missing from {store.url}") from None
        _write_local(ref.sha256, data)
    profile = parse_profile(data, name=f"codec profile {ref.key}")
    if cache is not None:
        cache.add(ref.sha256, profile)
    return profile


def current_profile(
    store: Store, fingerprint: str, trust: TrustPolicy | None = None
) -> tuple[CodecProfile, ObjectRef] | None:
    """The profile the store's pointer names for a model, if any (with ``trust``: only
    a pointer signed by a trusted key)."""
    key = profile_pointer_key(fingerprint)
    try:
        ref = read_profile_pointer(store, key, trust)
    except NotFound:
        return None
    if ref.key != profile_key(fingerprint, ref.sha256):
        raise FormatError(f"{key} does not point at a profile of this model")
    return load_profile(store, ref), ref


def read_profile_pointer(store: Reader, key: str, trust: TrustPolicy | None = None) -> ObjectRef:
    """The profile a ``profiles/FP/current.json`` pointer names (with ``trust``: only a
    pointer signed by a trusted key); :class:`NotFound` without the pointer."""
    data = store.get(key, max_bytes=MAX_POINTER_BYTES)
    raw, _ = open_document(
        data, PROFILE_POINTER_TYPE, what=key, trust=trust, max_bytes=MAX_POINTER_BYTES
    )
    try:
        ref = ObjectRef(key=str(raw["key"]), bytes=int(raw["bytes"]), sha256=str(raw["sha256"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{key} is not a valid profile pointer: {exc}") from None
    if not 0 < ref.bytes <= MAX_PROFILE_BYTES:
        raise FormatError(f"{key} names a profile of an impossible size")
    return ref


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


def bundled_profile(fingerprint: str) -> CodecProfile | None:
    """The profile shipped with kvcdn for ``fingerprint`` (the embedded model's), if any.

    Calibrating the embedded model takes minutes on a laptop's CPUs; its profile is made
    once by ``make embedded-profile`` and installed with the package, so a first publish
    (``kvcdn demo``) starts at once. Any other model is calibrated on first use.
    """
    folder = resources.files("kvcdn") / "data" / "profiles"
    if not folder.is_dir():
        return None
    for entry in sorted(folder.iterdir(), key=lambda f: f.name):
        if not entry.name.endswith(".safetensors"):
            continue
        try:
            profile = parse_profile(entry.read_bytes(), name=f"bundled profile {entry.name}")
        except (FormatError, OSError) as exc:  # made by an older kvcdn: calibrate instead
            log.warning("ignoring the bundled codec profile %s: %s", entry.name, exc)
            continue
        if profile.model_fingerprint == fingerprint:
            return profile
    return None


def publish_profile(
    store: Store, profile: CodecProfile, sign_keys: Sequence[SigningKey] = ()
) -> ObjectRef:
    """Store ``profile`` (create-only, content-addressed) and point the model at it
    (a pointer signed by ``sign_keys`` when given)."""
    data = profile.to_bytes()
    ref = ObjectRef(
        profile_key(profile.model_fingerprint, profile.sha256), len(data), profile.sha256
    )
    store.put_content(ref.key, data)
    pointer = json.dumps({"key": ref.key, "bytes": ref.bytes, "sha256": ref.sha256}).encode()
    if sign_keys:
        pointer = seal(pointer, PROFILE_POINTER_TYPE, sign_keys)
    store.put(profile_pointer_key(profile.model_fingerprint), pointer)
    _write_local(profile.sha256, data)
    return ref


def ensure_profile(
    store: Store,
    model: LoadedModel,
    progress: ProgressFn | None = None,
    *,
    sign_keys: Sequence[SigningKey] = (),
    trust: TrustPolicy | None = None,
) -> tuple[CodecProfile, ObjectRef]:
    """The model's profile: from the store, else this machine's cache, else the one
    shipped with kvcdn, else calibrate now.

    A signing publisher (``sign_keys``) uses the store's profile only when its
    pointer is signed by one of its keys or a key of ``trust``: it vouches for
    every profile its manifests name.
    """
    if sign_keys:
        own = [k.public for k in sign_keys]
        trust = trust.with_keys(own) if trust is not None else TrustPolicy(own)
    try:
        found = current_profile(store, model.fingerprint, trust)
    except (TrustError, FormatError) as exc:
        log.warning("not using the store's codec profile: %s", exc)
        found = None
    if found is not None:
        found[0].check_model(model.fingerprint, f"the codec profile in {store.url}")
        return found
    profile = local_profile(model.fingerprint) or bundled_profile(model.fingerprint)
    if profile is None:
        log.info("no codec profile for %s yet: calibrating", model.name)
        profile = calibrate(model, progress=progress)
    profile.check_model(model.fingerprint)
    return profile, publish_profile(store, profile, sign_keys)


def _write_local(sha256: str, data: bytes) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{sha256}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"{sha256}.safetensors")
    except OSError as exc:  # a read-only home must not stop a publish
        log.warning("cannot cache the codec profile locally: %s", exc)
