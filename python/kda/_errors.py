"""Exceptions of the kda package.

Every error the package raises derives from :class:`KDAError` and from the built-in exception a Python user
would catch for that kind of problem:

====================================  ======================================  ================================
class                                 also a                                  raised for
====================================  ======================================  ================================
``KDAInvalidValueError``              ``ValueError``                          a wrong argument (libkda's
                                                                              ``KDA_STATUS_INVALID_VALUE``, or
                                                                              a check made in Python)
``KDAAssertionError``                 ``ValueError`` and ``AssertionError``   a wrong argument that FLA
                                                                              rejects with ``assert``
``KDATypeError``                      ``TypeError``                           an argument of the wrong kind
                                                                              (numpy where torch is expected)
``KDANotSupportedError``              ``NotImplementedError``                 valid, but not available here
                                                                              (``KDA_STATUS_NOT_SUPPORTED``, or
                                                                              an FLA option not implemented)
``KDARuntimeError``                   ``RuntimeError``                        the other statuses, below
``KDAInsufficientWorkspaceError``     ``RuntimeError``                        ``KDA_STATUS_INSUFFICIENT_WORKSPACE``
``KDAAllocError``                     ``RuntimeError``                        ``KDA_STATUS_ALLOC_FAILED``
``KDABackendError``                   ``RuntimeError``                        ``KDA_STATUS_BACKEND_ERROR``
``KDAInternalError``                  ``RuntimeError``                        ``KDA_STATUS_INTERNAL_ERROR``
``KDALibraryNotFoundError``           ``OSError``                             libkda could not be loaded
====================================  ======================================  ================================

Each carries ``status`` (the ``kda_status_t`` value, or ``None`` for an error found in Python) and ``message``
(libkda's ``kda_last_error()`` text for a C status).
"""

from __future__ import annotations

__all__ = [
    "KDAError",
    "KDAInvalidValueError",
    "KDAAssertionError",
    "KDATypeError",
    "KDANotSupportedError",
    "KDARuntimeError",
    "KDAInsufficientWorkspaceError",
    "KDAAllocError",
    "KDABackendError",
    "KDAInternalError",
    "KDALibraryNotFoundError",
    "STATUS_NAMES",
]

# kda_status_t, as in include/kda.h
SUCCESS = 0
INVALID_VALUE = 1
NOT_SUPPORTED = 2
INSUFFICIENT_WORKSPACE = 3
ALLOC_FAILED = 4
BACKEND_ERROR = 5
INTERNAL_ERROR = 6

STATUS_NAMES = {
    SUCCESS: "KDA_STATUS_SUCCESS",
    INVALID_VALUE: "KDA_STATUS_INVALID_VALUE",
    NOT_SUPPORTED: "KDA_STATUS_NOT_SUPPORTED",
    INSUFFICIENT_WORKSPACE: "KDA_STATUS_INSUFFICIENT_WORKSPACE",
    ALLOC_FAILED: "KDA_STATUS_ALLOC_FAILED",
    BACKEND_ERROR: "KDA_STATUS_BACKEND_ERROR",
    INTERNAL_ERROR: "KDA_STATUS_INTERNAL_ERROR",
}


class KDAError(Exception):
    """Base class of every error raised by kda. ``status`` is the libkda status (None: found in Python)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status

    @property
    def status_name(self) -> str | None:
        return None if self.status is None else STATUS_NAMES.get(self.status, f"KDA_STATUS_{self.status}")


class KDAInvalidValueError(KDAError, ValueError):
    """An argument is wrong (``KDA_STATUS_INVALID_VALUE``); the message names it."""


class KDAAssertionError(KDAInvalidValueError, AssertionError):
    """An argument is wrong where FLA checks it with ``assert``: catchable as ValueError or AssertionError."""


class KDATypeError(KDAError, TypeError):
    """An argument is of the wrong kind (e.g. a numpy array mixed with torch tensors)."""


class KDANotSupportedError(KDAError, NotImplementedError):
    """Valid, but not available on this backend, build or device, or an FLA option not implemented yet."""


class KDARuntimeError(KDAError, RuntimeError):
    """A failure that is not the caller's argument: see the subclasses."""


class KDAInsufficientWorkspaceError(KDARuntimeError):
    """``KDA_STATUS_INSUFFICIENT_WORKSPACE`` (a bug in this package if it ever reaches you)."""


class KDAAllocError(KDARuntimeError):
    """``KDA_STATUS_ALLOC_FAILED``: a context could not be created."""


class KDABackendError(KDARuntimeError):
    """``KDA_STATUS_BACKEND_ERROR``: the CUDA runtime reported an error (its text is in the message)."""


class KDAInternalError(KDARuntimeError):
    """``KDA_STATUS_INTERNAL_ERROR``: a bug in libkda; please report it with the message."""


class KDALibraryNotFoundError(KDAError, OSError):
    """libkda could not be found or loaded; the message lists every place that was tried."""


_BY_STATUS = {
    INVALID_VALUE: KDAInvalidValueError,
    NOT_SUPPORTED: KDANotSupportedError,
    INSUFFICIENT_WORKSPACE: KDAInsufficientWorkspaceError,
    ALLOC_FAILED: KDAAllocError,
    BACKEND_ERROR: KDABackendError,
    INTERNAL_ERROR: KDAInternalError,
}


def error_from_status(status: int, message: str) -> KDAError:
    """The exception for a failing libkda status, carrying libkda's message."""
    cls = _BY_STATUS.get(status, KDARuntimeError)
    if not message:
        message = STATUS_NAMES.get(status, f"libkda status {status}")
    return cls(message, status)
