"""What fetching from an origin raises: one place for the origins and their readers."""

from __future__ import annotations


class OriginMissing(Exception):
    """The origin says the key does not exist."""


class OriginFailed(Exception):
    """The origin could not be reached or answered with an error."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class Unexpected(OriginFailed):
    """An answer other than 200 or 404 (or a 200 that cannot be read as one): the
    ``status`` says which."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
