"""kda: Kimi Delta Attention over libkda with FLA's Python interface (``from kda import chunk_kda`` for ``from
fla.ops.kda import chunk_kda``) on torch tensors or numpy arrays; torch is never imported by kda. See docs/API.md."""

from ._api import chunk_kda, chunk_kda_backward, fused_recurrent_kda
from ._errors import (KDAAllocError, KDAAssertionError, KDABackendError, KDAError, KDAInsufficientWorkspaceError,
                      KDAInternalError, KDAInvalidValueError, KDALibraryNotFoundError, KDANotSupportedError,
                      KDARuntimeError, KDATypeError)
from . import _lib
from ._lib import library_path

__version__ = "0.1.0"


def __getattr__(name: str):  # context parallelism across ranks needs torch: imported on first use
    if name in ("build_cp_context", "CPContext"):
        from . import _cp
        return getattr(_cp, name)
    raise AttributeError(f"module 'kda' has no attribute '{name}'")


__all__ = ["chunk_kda", "chunk_kda_backward", "fused_recurrent_kda", "library_path", "library_version",
           "set_num_threads", "get_num_threads", "KDAError", "KDAInvalidValueError", "KDAAssertionError",
           "KDATypeError", "KDANotSupportedError", "KDARuntimeError", "KDAInsufficientWorkspaceError",
           "KDAAllocError", "KDABackendError", "KDAInternalError", "KDALibraryNotFoundError"]


def library_version() -> str:
    """The version of the loaded libkda, e.g. "0.1.0" (loads it)."""
    return _lib.library().version_string


def set_num_threads(num_threads: int) -> None:
    """Use `num_threads` threads for the CPU backend from now on (default: $KDA_NUM_THREADS, else one per core)."""
    _lib.get_context(_lib.BACKEND_CPU, 0).set_num_threads(num_threads)


def get_num_threads() -> int:
    """The number of threads of the CPU backend."""
    return _lib.get_context(_lib.BACKEND_CPU, 0).num_threads()
