"""Publisher keys, signed envelopes and the readers' trust policy.

A publisher signs what readers must be able to trust: each manifest (which
names every object's sha256, the codec profile's sha256, the tokens and the
source's digest) and each ``latest.json`` pointer. Signatures are ed25519
(through the ``cryptography`` library) inside a DSSE envelope, the signing
envelope of in-toto and Sigstore (``docs/trust.md``)::

    {"payloadType": "application/vnd.kvcdn.manifest+json",
     "payload": base64(the manifest's JSON bytes),
     "signatures": [{"keyid": "ed25519:<base64 public key>", "sig": base64(sig)}]}

The signature covers DSSE's pre-authentication encoding of the type and the
payload, so a signed pointer can never pass for a signed manifest. A reader
with a :class:`TrustPolicy` accepts a document only when one of its
signatures verifies under a trusted key; a reader without one still checks
that any signature present verifies under the key it names (integrity, not
authenticity) and reads unsigned documents as before.

Public keys are written ``ed25519:<base64 of the 32 raw bytes>``; a key's id
is the first 16 hex digits of the sha256 of those bytes. A trust file holds
one key per line, optionally followed by a comment (its name), like SSH's
``authorized_keys``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import FormatError, InputError, IntegrityError, RollbackError, TrustError
from .jsonfmt import loads

log = logging.getLogger(__name__)

KEY_PREFIX = "ed25519:"
MANIFEST_TYPE = "application/vnd.kvcdn.manifest+json"
POINTER_TYPE = "application/vnd.kvcdn.pointer+json"
PROFILE_POINTER_TYPE = "application/vnd.kvcdn.codec_profile-pointer+json"
MAX_SIGNATURES = 16
MAX_TRUST_FILE_BYTES = 1 << 20
MAX_KEY_FILE_BYTES = 64 << 10
MAX_STATE_BYTES = 64 << 20  # a reader's record of the versions it has seen
#: How far past its signed expiry a latest pointer is still believed: the publisher's
#: clock and the reader's may disagree by this much (NTP keeps them far closer; a VM
#: resumed from a snapshot may not be). Small against any useful validity window.
CLOCK_SKEW_S = 300.0


# ---- keys ------------------------------------------------------------------------


@dataclass(frozen=True)
class PublicKey:
    raw: bytes
    comment: str = ""

    @property
    def text(self) -> str:
        return KEY_PREFIX + base64.b64encode(self.raw).decode()

    @property
    def id(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()[:16]

    def describe(self) -> str:
        return f"{self.id} ({self.comment})" if self.comment else self.id

    def verifies(self, signature: bytes, message: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except InvalidSignature:
            return False
        return True


def parse_public_key(text: str, comment: str = "") -> PublicKey:
    """``ed25519:<base64>`` -> a :class:`PublicKey`; :class:`FormatError` otherwise."""
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise FormatError(f"{str(text)[:80]!r} is not an ed25519 public key (ed25519:<base64>)")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise FormatError(f"{text[:80]!r} is not valid base64") from None
    if len(raw) != 32:
        raise FormatError(f"{text[:80]!r} is not a 32-byte ed25519 public key")
    return PublicKey(raw, comment)


class SigningKey:
    """A publisher's private key."""

    def __init__(self, private: Any, comment: str = "") -> None:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._private = private
        raw = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public = PublicKey(raw, comment)

    def private_raw(self) -> bytes:
        """The key's 32 raw private bytes, for a process of this publisher's that signs
        (a Ray actor): keep them as secret as the key file."""
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
        )

        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @classmethod
    def from_raw(cls, raw: bytes, comment: str = "") -> SigningKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.from_private_bytes(raw), comment)

    @classmethod
    def generate(cls, comment: str = "") -> SigningKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate(), comment)

    @classmethod
    def load(cls, path: str | Path, password: bytes | None = None) -> SigningKey:
        """Read a PEM (PKCS#8) ed25519 private key, as :meth:`save` writes it."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        path = Path(path)
        data = read_bounded(path, MAX_KEY_FILE_BYTES, "signing key")
        try:
            private = load_pem_private_key(data, password=password)
        except TypeError:
            raise InputError(
                f"{path} is encrypted: give its passphrase (KVCDN_SIGN_KEY_PASSPHRASE)"
                if password is None
                else f"{path} is not encrypted: give no passphrase"
            ) from None
        except ValueError:
            raise InputError(
                f"{path} is not a PEM private key (or the passphrase is wrong)"
            ) from None
        if not isinstance(private, Ed25519PrivateKey):
            raise InputError(f"{path} is not an ed25519 key (kvcdn signs with ed25519)")
        key = cls(private, path.stem)
        # its name is in the .pub file save() wrote beside it, when that holds this key
        pub = path.with_name(path.name + ".pub")
        try:
            named = [k for k in read_public_keys(pub) if k.raw == key.public.raw]
        except (InputError, OSError):
            named = []
        if named and named[0].comment:
            key = cls(private, named[0].comment)
        return key

    def save(self, path: str | Path) -> None:
        """Write the key (PEM, PKCS#8, readable by its owner only) and ``path.pub``.

        Refuses to overwrite either file: a lost key cannot be recovered.
        """
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
        )

        path = Path(path)
        pub = path.with_name(path.name + ".pub")
        pem = self._private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        line = f"{self.public.text} {self.public.comment or path.stem}\n".encode()
        for target, data, mode in ((path, pem, 0o600), (pub, line, 0o644)):
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                raise InputError(
                    f"{target} already exists; kvcdn does not overwrite keys"
                ) from None
            except OSError as exc:
                raise InputError(f"cannot write {target}: {exc.strerror}") from None
            with os.fdopen(fd, "wb") as f:
                f.write(data)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)


def read_public_keys(path: str | Path) -> list[PublicKey]:
    """The keys of a trust file (or of one ``.pub`` file): ``ed25519:<base64> [comment]``
    per line; blank lines and lines starting with ``#`` are skipped."""
    path = Path(path)
    try:
        text = read_bounded(path, MAX_TRUST_FILE_BYTES, "trust file").decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"cannot read the trust file {path}: not UTF-8 text") from None
    keys: list[PublicKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key_text, _, comment = line.partition(" ")
        try:
            keys.append(parse_public_key(key_text, comment.strip()))
        except FormatError as exc:
            raise InputError(f"{path}, line {number}: {exc}") from None
    if not keys:
        raise InputError(f"the trust file {path} names no key")
    return keys


# ---- envelopes ---------------------------------------------------------------------


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what a signature covers."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def seal(payload: bytes, payload_type: str, keys: Iterable[SigningKey]) -> bytes:
    """``payload`` in a DSSE envelope signed by every key in ``keys``."""
    message = pae(payload_type, payload)
    signatures = [
        {"keyid": key.public.text, "sig": base64.b64encode(key.sign(message)).decode()}
        for key in keys
    ]
    if not signatures:
        raise ValueError("sealing needs at least one key")
    envelope = {
        "payloadType": payload_type,
        "payload": base64.b64encode(payload).decode(),
        "signatures": signatures,
    }
    return json.dumps(envelope, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Signer:
    """Who signed a document: the key, and whether the reader trusts it."""

    key: PublicKey
    trusted: bool

    def describe(self) -> str:
        return f"{self.key.describe()}{'' if self.trusted else ', not in the trust file'}"

    def to_json(self) -> dict[str, Any]:
        return {
            "key_id": self.key.id,
            "public_key": self.key.text,
            "name": self.key.comment,
            "trusted": self.trusted,
        }


def is_envelope(raw: Any) -> bool:
    return isinstance(raw, dict) and "payloadType" in raw


def open_document(
    data: bytes,
    payload_type: str,
    *,
    what: str,
    trust: TrustPolicy | None,
    max_bytes: int,
) -> tuple[Any, Signer | None]:
    """The JSON document in ``data`` (signed or plain) and who signed it.

    With ``trust``, only an envelope of ``payload_type`` with a valid signature
    by a trusted key is accepted (:class:`TrustError` otherwise). Without,
    plain JSON is accepted as is, and an envelope's signatures must verify
    under the keys they name (:class:`IntegrityError` otherwise).
    """
    raw = loads(data, what=what, max_bytes=max_bytes)
    if not is_envelope(raw):
        if trust is not None:
            raise TrustError(
                f"{what} is not signed; this reader accepts only documents signed by "
                f"{trust.describe()}"
            )
        return raw, None
    kind, payload, signatures = _parse_envelope(raw, what)
    if kind != payload_type:
        raise FormatError(f"{what} is a signed {kind!r}, not a {payload_type!r}")
    message = pae(kind, payload)
    if trust is not None:
        signer = trust.signer_of(signatures, message)
        if signer is None:
            _why_untrusted(what, signatures, message, trust)
    else:
        valid = [k for k, sig in signatures if k.verifies(sig, message)]
        if not valid:
            raise IntegrityError(f"{what}: its signature does not verify (altered after signing)")
        signer = Signer(valid[0], trusted=False)
    return loads(payload, what=what, max_bytes=max_bytes), signer


def _why_untrusted(
    what: str, signatures: list[tuple[PublicKey, bytes]], message: bytes, trust: TrustPolicy
) -> None:
    """Raise the reason no signature of a document verifies under a trusted key:
    one by a trusted key that does not cover these bytes (they were altered), one
    by a key that is not trusted, or none that verifies at all."""
    ids = ", ".join(k.id for k, _ in signatures) or "no key"
    trusted = [k for k, _ in signatures if k.raw in trust.keys]
    if trusted:
        raise IntegrityError(
            f"{what}: its signature by the trusted key {trusted[0].describe()} does not "
            "verify: it was altered after signing"
        )
    if not any(k.verifies(sig, message) for k, sig in signatures):
        raise IntegrityError(
            f"{what}: its signature does not verify (altered after signing), and its key "
            f"({ids}) is not trusted either"
        )
    raise TrustError(
        f"{what} is not signed by a trusted key (signed by {ids}; trusted: {trust.describe()})"
    )


def _parse_envelope(raw: dict[str, Any], what: str) -> tuple[str, bytes, list]:
    kind, payload, sigs = raw.get("payloadType"), raw.get("payload"), raw.get("signatures")
    if set(raw) != {"payloadType", "payload", "signatures"}:
        raise FormatError(f"{what} is not a DSSE envelope (fields {sorted(raw)[:8]})")
    if not isinstance(kind, str) or not isinstance(payload, str) or not isinstance(sigs, list):
        raise FormatError(f"{what} is a malformed DSSE envelope")
    if not 1 <= len(sigs) <= MAX_SIGNATURES:
        raise FormatError(f"{what} has {len(sigs)} signatures (1 to {MAX_SIGNATURES} allowed)")
    try:
        body = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise FormatError(f"{what}: its payload is not valid base64") from None
    signatures = []
    for entry in sigs:
        if not isinstance(entry, dict) or not isinstance(entry.get("sig"), str):
            raise FormatError(f"{what} has a malformed signature entry")
        try:
            key = parse_public_key(entry.get("keyid", ""))
            sig = base64.b64decode(entry["sig"], validate=True)
        except FormatError as exc:
            raise FormatError(f"{what}: {exc}") from None
        except (binascii.Error, ValueError):
            raise FormatError(f"{what}: a signature is not valid base64") from None
        if len(sig) != 64:
            raise FormatError(f"{what}: a signature is {len(sig)} bytes, not 64")
        signatures.append((key, sig))
    return kind, body, signatures


# ---- the readers' trust ---------------------------------------------------------------


class TrustPolicy:
    """The publisher keys a reader accepts, and the newest version it has seen of each
    document (so that it never goes back to an older one: rollback protection).

    A document is its name: whichever store, edge or path it is read through,
    a reader never accepts an older latest version than one it has verified.
    (One key signing one name in two stores with different histories is then
    one history to this reader: give each environment its own key or names.)
    The seen versions live in memory, and in ``state_path`` (a small JSON file)
    when one is given, so that they outlast the process.

    Freshness (``docs/trust.md``): a signed latest pointer past its ``expires``
    (give or take ``clock_skew_s``) is refused. One without an expiry (signed
    before publishers wrote one) is believed unless ``require_expiry``; with it,
    the latest version is taken only from an unexpired pointer a trusted key
    signed with an expiry, so a store cannot replay an old one (or hide the
    pointer) to a reader that has never seen the document.
    """

    def __init__(
        self,
        keys: Iterable[PublicKey],
        *,
        state_path: str | Path | None = None,
        source: str = "",
        require_expiry: bool = False,
        clock_skew_s: float = CLOCK_SKEW_S,
    ) -> None:
        self.keys = {k.raw: k for k in keys}
        if not self.keys:
            raise InputError("a trust policy needs at least one key")
        if type(clock_skew_s) not in (int, float) or not 0 <= clock_skew_s <= 86400:
            raise InputError(f"clock_skew_s must be from 0 to 86400 seconds, not {clock_skew_s!r}")
        self.source = source  # where the keys came from, for messages
        self.state_path = Path(state_path) if state_path else None
        self.require_expiry = bool(require_expiry)
        self.clock_skew_s = float(clock_skew_s)
        self._seen: dict[str, int] = {}

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        state_path: str | Path | None = None,
        require_expiry: bool = False,
        clock_skew_s: float = CLOCK_SKEW_S,
    ) -> TrustPolicy:
        return cls(
            read_public_keys(path),
            state_path=state_path,
            source=str(path),
            require_expiry=require_expiry,
            clock_skew_s=clock_skew_s,
        )

    def describe(self) -> str:
        names = ", ".join(k.describe() for k in self.keys.values())
        return f"{names}{f' from {self.source}' if self.source else ''}"

    def with_keys(self, extra: Iterable[PublicKey]) -> TrustPolicy:
        """The same policy (sharing its seen versions) trusting ``extra`` as well."""
        other = TrustPolicy(
            [*self.keys.values(), *extra],
            source=self.source,
            require_expiry=self.require_expiry,
            clock_skew_s=self.clock_skew_s,
        )
        other.state_path, other._seen = self.state_path, self._seen
        return other

    def signer_of(self, signatures: list[tuple[PublicKey, bytes]], message: bytes) -> Signer | None:
        for key, sig in signatures:
            trusted = self.keys.get(key.raw)
            if trusted is not None and trusted.verifies(sig, message):
                return Signer(trusted, trusted=True)
        return None

    # ---- rollback -----------------------------------------------------------------
    def newest_seen(self, name: str) -> int:
        self._load_state()
        return self._seen.get(name, 0)

    def saw(self, name: str, version: int) -> None:
        """Record that ``name@version`` was read and verified."""
        if version <= self.newest_seen(name):
            return
        self._seen[name] = version
        self._save_state(name, version)

    def check_state(self) -> None:
        """Read the record of seen versions now, and write it back as it is
        (:class:`TrustError` if it is damaged, or its folder, lock or replacement fails:
        a file bind-mounted in its place cannot be replaced), so that a long-running
        reader names such a record at start: a record that cannot be written would
        otherwise leave each save a warning and the next start without the versions
        seen."""
        if self.state_path is None:
            return
        try:
            self._write_record()  # reads the record first, under its lock
        except OSError as exc:
            raise TrustError(f"the record of the versions this reader has seen, "
                             f"{self.state_path}, cannot be written: {exc.strerror or exc}"
                             ) from None  # fmt: skip

    def check_not_older(self, name: str, version: int, where: str) -> None:
        seen = self.newest_seen(name)
        if version < seen:
            raise RollbackError(
                f"{where} offers {name}@{version} as the latest version, but this reader has "
                f"already seen {name}@{seen}: the store was rolled back or is replaying an old "
                "pointer"
            )

    def _load_state(self) -> None:
        """Merge the state file's records into this process's. A damaged file is
        refused (:class:`TrustError`), never ignored: ignoring it would reset
        rollback protection without anyone deciding to."""
        # lexists: a dangling or looping link in the record's place is a damaged record,
        # not a missing one
        if self.state_path is None or not os.path.lexists(self.state_path):
            return
        try:
            # a regular file only: kvcdn writes it, and a FIFO in its place would hang
            # the reader's start in open()
            data = read_bounded(self.state_path, MAX_STATE_BYTES, "rollback state",
                                regular=True)  # fmt: skip
            raw = loads(data, what=str(self.state_path), max_bytes=MAX_STATE_BYTES)
            if not isinstance(raw, dict) or not all(
                isinstance(name, str) and type(v) is int and v > 0 for name, v in raw.items()
            ):
                raise FormatError("not a map of document names to versions")
        except (InputError, FormatError) as exc:
            raise TrustError(
                f"the record of the versions this reader has seen, {self.state_path}, is "
                f"damaged ({exc}); rollback protection cannot hold without it. Restore it, "
                "or delete it to start a new record (this reader then accepts any version "
                "it has not seen since)"
            ) from None
        for name, version in raw.items():
            if version > self._seen.get(name, 0):
                self._seen[name] = version

    def _save_state(self, name: str, version: int) -> None:
        """Merge one record into the state file (:meth:`_write_record`)."""
        if self.state_path is None:
            return
        try:
            self._write_record(name, version)
        except OSError as exc:  # the check still holds for this process
            log.warning("cannot record seen versions in %s: %s", self.state_path, exc)

    def _write_record(self, name: str | None = None, version: int = 0) -> None:
        """The state file merged with this process's records (and ``name@version``),
        under a lock (other processes write too), atomically and durably: a crash
        leaves the old record or the new, whole. Written where a link leads:
        replacing the link itself would leave its target (a mounted volume's file,
        say) behind with the older record."""
        assert self.state_path is not None
        record = Path(os.path.realpath(self.state_path))
        record.parent.mkdir(parents=True, exist_ok=True)
        lock = _open_lock(record)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._load_state()
            if name is not None:
                self._seen[name] = max(self._seen.get(name, 0), version)
            tmp = record.with_name(f".{record.name}.{os.getpid()}")
            try:
                with open(tmp, "w") as f:
                    f.write(json.dumps(self._seen, sort_keys=True))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, record)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        finally:
            os.close(lock)


def _open_lock(record: Path) -> int:
    """The lock file beside ``record``, opened without emptying it and without
    blocking (a FIFO in its place would block ``open()``); OSError unless it is a
    regular file."""
    path = record.with_name(record.name + ".lock")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise OSError(errno.EINVAL, f"{path} is not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return fd


def read_bounded(path: str | Path, max_bytes: int, what: str, *, regular: bool = False
                 ) -> bytes:  # fmt: skip
    """A small file's bytes (a key, a trust file, a token): refused past ``max_bytes``,
    whatever the file is (a device, a pipe, a huge file). With ``regular``, anything
    but a regular file is refused, and a FIFO without a writer does not block."""
    path = Path(path)
    try:
        if regular:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise InputError(f"the {what} {path} is not a regular file")
                data = f.read(max_bytes + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
    except OSError as exc:
        raise InputError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise InputError(f"{path} is larger than a {what} can be ({max_bytes} bytes)")
    return data
