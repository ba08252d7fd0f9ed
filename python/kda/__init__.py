"""kda: Kimi Delta Attention over libkda, with FLA's Python interface.

    from kda import chunk_kda, fused_recurrent_kda

takes the place of ``from fla.ops.kda import chunk_kda, fused_recurrent_kda``: same signatures, defaults, shapes,
dtypes and errors (FLA 0.6.0). torch CUDA tensors run on libkda's CUDA backend (the tensors' device, the current
stream); torch CPU tensors and numpy arrays (float32/float16) run on its CPU backend.

libkda is found through ``$KDA_LIBRARY`` (a path), else the ``libkda.so`` bundled in this package, else the
repository's ``build/libkda.so``, else ``ctypes.util.find_library("kda")``. It is loaded on first use: importing
kda never fails for want of it. torch is optional and never imported by kda itself: torch tensors are recognised
only once the caller has imported torch.

Errors derive from :class:`KDAError` and from the matching built-in (``ValueError`` for a wrong argument,
``NotImplementedError`` for what is not available, ``RuntimeError`` otherwise); see ``kda._errors``.
"""

from ._api import chunk_kda, chunk_kda_backward, fused_recurrent_kda
from ._errors import (KDAAllocError, KDAAssertionError, KDABackendError, KDAError, KDAInsufficientWorkspaceError,
                      KDAInternalError, KDAInvalidValueError, KDALibraryNotFoundError, KDANotSupportedError,
                      KDARuntimeError, KDATypeError)
from ._lib import library_path

__version__ = "0.1.0"

__all__ = ["chunk_kda", "chunk_kda_backward", "fused_recurrent_kda", "library_path", "library_version",
           "set_num_threads", "get_num_threads", "KDAError", "KDAInvalidValueError", "KDAAssertionError",
           "KDATypeError", "KDANotSupportedError", "KDARuntimeError", "KDAInsufficientWorkspaceError",
           "KDAAllocError", "KDABackendError", "KDAInternalError", "KDALibraryNotFoundError"]


def library_version() -> str:
    """The version of the loaded libkda, e.g. "0.1.0" (loads it)."""
    from ._lib import library
    v = library().version()
    return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"


def set_num_threads(num_threads: int) -> None:
    """Use `num_threads` threads for the CPU backend from now on (default: $KDA_NUM_THREADS, else one per core)."""
    from ._lib import BACKEND_CPU, get_context
    get_context(BACKEND_CPU, 0).set_num_threads(num_threads)


def get_num_threads() -> int:
    """The number of threads of the CPU backend."""
    from ._lib import BACKEND_CPU, get_context
    return get_context(BACKEND_CPU, 0).num_threads()
