"""The kvcdn error family.

Library code raises these; the CLI turns them into one-line messages and exit
codes. Every message is written for the person who caused it: it says what is
wrong and, where there is one, what to do about it.
"""

from __future__ import annotations


class KvcdnError(Exception):
    """Base of every error kvcdn raises on purpose."""

    exit_code = 1


class InputError(KvcdnError):
    """The user's input (a document, an argument) cannot be used."""

    exit_code = 2


class DocumentTooLong(InputError):
    """The document does not fit the model's context window."""


class ModelError(KvcdnError):
    """The model cannot be resolved or loaded."""

    exit_code = 3


class FingerprintMismatch(ModelError):
    """KV computed by one model was offered to another."""


class BlendUnsupported(ModelError):
    """The model's KV cannot be moved to other positions (it fails the position self-check)."""


class StoreError(KvcdnError):
    """The object store cannot be reached or refused a request."""

    exit_code = 4


class NotFound(StoreError):
    """A document, version or object does not exist in the store."""


class AccessDenied(StoreError):
    """A store or edge refused the credentials or token given (or needs one)."""


class DeadlineExceeded(StoreError):
    """The store or an edge did not answer in the time a load had left."""


class ConcurrentPublish(StoreError):
    """Another publisher wrote the same version first."""


class FormatError(KvcdnError):
    """A stored object or manifest is malformed, corrupted or of an unknown version."""

    exit_code = 5


class OldSchema(FormatError):
    """A manifest written by an older kvcdn, in a schema this one no longer reads."""


class IntegrityError(FormatError):
    """An object's bytes do not match their checksum."""


class TrustError(KvcdnError):
    """Something is not signed by a key the reader trusts, or its signature is broken."""

    exit_code = 6


class RollbackError(TrustError):
    """The store offers an older version than one this reader has already seen."""


class FreshnessError(TrustError):
    """A document's latest pointer cannot show that it is current: it has expired, or
    the reader requires a signed expiry and the pointer has none (``docs/trust.md``)."""


class PointerExpired(FreshnessError):
    """A signed latest pointer is past the expiry its publisher signed: a replayed old
    pointer, or a publisher that has stopped refreshing it (``kvcdn refresh``)."""


class ArgumentError(InputError, TypeError):
    """A library function was called with an argument of the wrong type or value.

    A :class:`TypeError` for Python callers, and a kvcdn error the CLI reports
    in one line; the message names the argument.
    """
