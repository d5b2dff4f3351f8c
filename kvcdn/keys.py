"""Store keys: the one definition of every key kvcdn reads or writes.

Publisher, SDK, edge and catalog build keys with the functions here and
recognise them with :func:`parse_key`, which accepts only the canonical
spelling of each kind (specified in ``docs/manifest.md``):

| kind | key |
|---|---|
| ``object`` | ``objects/{h[:2]}/{h}/{level_id}.{sha256}.kvc`` (``h``: the chunk's chain hash) |
| ``profile`` | ``profiles/{fp[:16]}/{sha256}.safetensors`` |
| ``manifest`` | ``docs/{name}/versions/{N:06d}.json`` |
| ``pointer`` | ``docs/{name}/latest.json`` |
| ``removed`` | ``docs/{name}/removed.json`` (the highest version ``kvcdn rm`` removed) |
| ``profile-pointer`` | ``profiles/{fp[:16]}/current.json`` |
| ``index`` | ``index/sources/{fp[:16]}/{sha256}.json`` |
| ``prefix-index`` | ``index/prefixes/{fp[:16]}/{h}.json`` (``h``: the first chunk's chain hash) |

Chunk objects and profiles are content-addressed: the key ends in the sha256
of the bytes, so a key can never hold two different byte strings, and anyone
can check bytes against their key without trusting where they came from.

Document names are Unicode: letters and digits of any script, and ``.``,
``_``, ``-``, in NFC, at most 128 characters and 200 UTF-8 bytes (a name is
one folder name on a local store), starting with a letter or digit.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from .errors import InputError

NAME_MAX_CHARS = 128
NAME_MAX_BYTES = 200
#: A document name inside a larger pattern (checked further by :func:`check_name`).
NAME_PATTERN = r"[^\W_][\w.-]{0,127}"
_NAME = re.compile(rf"^{NAME_PATTERN}$")
_UNSAFE_RUN = re.compile(r"[^\w.-]+")
#: A level id: the level's name, then 12 hex digits of its codec and parameters.
LEVEL_ID_PATTERN = r"[a-z0-9][a-z0-9_]{0,31}-[0-9a-f]{12}"
_LEVEL_ID = re.compile(rf"^{LEVEL_ID_PATTERN}$")
_HEX64 = "[0-9a-f]{64}"
_HEX16 = "[0-9a-f]{16}"
MAX_KEY_LENGTH = 1024
#: Version numbers have 6 to 12 digits in their keys.
MAX_VERSION = 999_999_999_999

DOCS_PREFIX = "docs/"
#: Where :meth:`kvcdn.store.Store.now` writes (and at once deletes) its clock keys.
CLOCK_PREFIX = "tmp/clock/"
OBJECTS_PREFIX = "objects/"
PROFILES_PREFIX = "profiles/"


# ---- document names ------------------------------------------------------------


def check_name(name: str) -> str:
    """``name`` if it is a valid document name (:class:`InputError` otherwise).

    Names are compared in Unicode NFC: a name typed in another normal form is
    returned normalised, so one document has one key.
    """
    if not isinstance(name, str):
        raise InputError(f"a document name must be a string, not {type(name).__name__}")
    normal = unicodedata.normalize("NFC", name)
    reason = _name_problem(normal)
    if reason:
        raise InputError(f"invalid document name {name!r}: {reason}")
    return normal


def _name_problem(name: str) -> str | None:
    if not name:
        return "it is empty"
    if len(name) > NAME_MAX_CHARS or len(name.encode("utf-8")) > NAME_MAX_BYTES:
        return f"it is longer than {NAME_MAX_CHARS} characters or {NAME_MAX_BYTES} UTF-8 bytes"
    if not _NAME.match(name):
        return (
            "use letters and digits (any script), '.', '_' and '-', starting with a letter or digit"
        )
    return None


def name_from_filename(stem: str) -> str:
    """A document name from a file name: runs of other characters become one '-'.

    Letters of every script are kept (``my file ünï`` is ``my-file-ünï``); a
    file name that leaves no valid name is refused with the reason, never cut.
    """
    normal = unicodedata.normalize("NFC", stem)
    name = _UNSAFE_RUN.sub("-", normal).strip("-._")
    reason = _name_problem(name)
    if reason:
        raise InputError(
            f"cannot make a document name from the file name {stem!r} ({reason}); "
            "give one with --name"
        )
    return name


# ---- building keys ----------------------------------------------------------------


def object_key(chunk_hash: str, level_id: str, sha256: str) -> str:
    """A chunk object's key: its chunk, its level and the sha256 of its bytes."""
    return f"objects/{chunk_hash[:2]}/{chunk_hash}/{level_id}.{sha256}.kvc"


def tiered_object_id(level_id: str) -> str:
    """The id in the keys of a nested ladder's objects (one per chunk, shared by every
    tier): the level id's hash of codec and parameters, which its tiers share."""
    return f"nested-{level_id.rsplit('-', 1)[1]}"  # kvcdn.codecs.nested.OBJECT_LEVEL


def chunk_prefix(chunk_hash: str) -> str:
    """The folder-like prefix of every object of one chunk."""
    return f"objects/{chunk_hash[:2]}/{chunk_hash}/"


def manifest_key(name: str, version: int) -> str:
    return f"docs/{name}/versions/{version:06d}.json"


def versions_prefix(name: str) -> str:
    return f"docs/{name}/versions/"


def latest_key(name: str) -> str:
    return f"docs/{name}/latest.json"


def removed_key(name: str) -> str:
    """Where ``kvcdn rm`` records the highest version it removed: never numbered again."""
    return f"docs/{name}/removed.json"


def source_index_key(fingerprint: str, source_sha256: str) -> str:
    return f"index/sources/{fingerprint[:16]}/{source_sha256}.json"


def prefix_index_key(fingerprint: str, first_chunk_hash: str) -> str:
    """Where a serving engine finds the document whose first chunk a prompt starts with."""
    return f"index/prefixes/{fingerprint[:16]}/{first_chunk_hash}.json"


def profile_key(fingerprint: str, sha256: str) -> str:
    return f"profiles/{fingerprint[:16]}/{sha256}.safetensors"


def profile_pointer_key(fingerprint: str) -> str:
    """The store's pointer to the current codec profile of a model."""
    return f"profiles/{fingerprint[:16]}/current.json"


# ---- recognising keys -------------------------------------------------------------


@dataclass(frozen=True)
class KeyInfo:
    """What a key names. Fields a kind does not have are empty."""

    kind: str  # object, profile, manifest, pointer, removed, profile-pointer, index, prefix-index
    name: str = ""  # manifest, pointer
    version: int = 0  # manifest
    chunk_hash: str = ""  # object, prefix-index (the first chunk's)
    level_id: str = ""  # object
    sha256: str = ""  # object, profile, index (the source's digest)
    fingerprint16: str = ""  # profile, profile-pointer, index, prefix-index

    @property
    def mutable(self) -> bool:
        """Pointers change; everything else is written once."""
        return self.kind in ("pointer", "removed", "profile-pointer", "index", "prefix-index")


_OBJECT = re.compile(rf"^objects/([0-9a-f]{{2}})/({_HEX64})/({LEVEL_ID_PATTERN})\.({_HEX64})\.kvc$")
_PROFILE = re.compile(rf"^profiles/({_HEX16})/({_HEX64})\.safetensors$")
_PROFILE_POINTER = re.compile(rf"^profiles/({_HEX16})/current\.json$")
_INDEX = re.compile(rf"^index/sources/({_HEX16})/({_HEX64})\.json$")
_PREFIX_INDEX = re.compile(rf"^index/prefixes/({_HEX16})/({_HEX64})\.json$")
_MANIFEST = re.compile(r"^docs/([^/]+)/versions/([0-9]{6,12})\.json$")
_POINTER = re.compile(r"^docs/([^/]+)/latest\.json$")
_REMOVED = re.compile(r"^docs/([^/]+)/removed\.json$")


def parse_key(key: str) -> KeyInfo | None:
    """What ``key`` names, or None unless it is the canonical spelling of a kvcdn key."""
    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH:
        return None
    if m := _OBJECT.match(key):
        if m.group(1) != m.group(2)[:2]:
            return None
        return KeyInfo("object", chunk_hash=m.group(2), level_id=m.group(3), sha256=m.group(4))
    if m := _PROFILE.match(key):
        return KeyInfo("profile", fingerprint16=m.group(1), sha256=m.group(2))
    if m := _PROFILE_POINTER.match(key):
        return KeyInfo("profile-pointer", fingerprint16=m.group(1))
    if m := _INDEX.match(key):
        return KeyInfo("index", fingerprint16=m.group(1), sha256=m.group(2))
    if m := _PREFIX_INDEX.match(key):
        return KeyInfo("prefix-index", fingerprint16=m.group(1), chunk_hash=m.group(2))
    if m := _MANIFEST.match(key):
        name, version = m.group(1), int(m.group(2))
        if _name_problem(name) or unicodedata.normalize("NFC", name) != name:
            return None
        if not 1 <= version <= MAX_VERSION or manifest_key(name, version) != key:
            return None
        return KeyInfo("manifest", name=name, version=version)
    if m := _POINTER.match(key) or _REMOVED.match(key):
        name = m.group(1)
        if _name_problem(name) or unicodedata.normalize("NFC", name) != name:
            return None
        return KeyInfo("pointer" if key.endswith("/latest.json") else "removed", name=name)
    return None


def is_level_id(value: str) -> bool:
    return bool(_LEVEL_ID.match(value))
