"""kda's exceptions (docs/API.md, "Python"), and libkda's messages in the caller's terms."""

from __future__ import annotations

import re

# kda_status_t, as in include/kda.h. CONTEXT_IN_USE: a context entered by a second thread while in use, where the
# library reports it. A status missing here still maps to KDARuntimeError, named by its number.
(SUCCESS, INVALID_VALUE, NOT_SUPPORTED, INSUFFICIENT_WORKSPACE, ALLOC_FAILED, BACKEND_ERROR, INTERNAL_ERROR,
 CONTEXT_IN_USE) = range(8)
STATUS_NAMES = {code: "KDA_STATUS_" + name for code, name in enumerate(("SUCCESS", "INVALID_VALUE", "NOT_SUPPORTED",
    "INSUFFICIENT_WORKSPACE", "ALLOC_FAILED", "BACKEND_ERROR", "INTERNAL_ERROR", "CONTEXT_IN_USE"))}


class KDAError(Exception):
    """Base class of every error raised by kda. ``status`` is the libkda status (None: found in Python)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message, self.status = message, status

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


_BY_STATUS = {INVALID_VALUE: KDAInvalidValueError, NOT_SUPPORTED: KDANotSupportedError,
              INSUFFICIENT_WORKSPACE: KDAInsufficientWorkspaceError, ALLOC_FAILED: KDAAllocError,
              BACKEND_ERROR: KDABackendError, INTERNAL_ERROR: KDAInternalError}
# libkda's messages in the caller's terms: kda_args_t field (as libkda's messages name it) -> the Python argument;
# o and final_state are outputs the caller can pass (fused_recurrent_kda's `out`, initial_state updated in place)
ARGUMENT_OF_FIELD = {field: arg for arg, fields in (
    ("q", "batch seq_len num_qk_heads head_dim_k dtype"), ("v", "num_v_heads head_dim_v"), ("g", "g_dtype"),
    ("beta", "beta_dtype"), ("cu_seqlens", "num_seqs cu_seqlens_dtype"), ("cu_seqlens_cpu", "cu_seqlens_host"),
    ("initial_state", "initial_state_dtype num_state_slots final_state final_state_dtype"), ("out", "o o_dtype"),
    ("ssm_state_indices", "state_indices"), ("use_qk_l2norm_in_kernel", "use_qk_l2norm"), ("dht", "d_final_state"),
    ("use_beta_sigmoid_in_kernel", "use_beta_sigmoid"), ("do", "d_o d_o_dtype"),
    ("return_intermediate_states", "chunk_states chunk_states_dtype"),
    ("cp_context", "cp_num_ranks cp_rank cp_pre_ranks cp_post_ranks")) for field in fields.split()}
# C names inside a message's detail, and what the caller knows them as
_DETAIL_WORDS = [(re.compile(r"(?<![\w.])" + c + r"\b"), py) for c, py in (
    ("state_indices", "ssm_state_indices"), ("num_state_slots", "the number of slots of initial_state"),
    ("seq_len", "T"), ("num_seqs", "the number of sequences"))]
_C_ENTRY_POINTS = tuple(f"kda_{e}{s}" for e in ("forward", "decode", "backward", "cp_forward_summary",
                                                  "cp_backward_summary") for s in ("", "_workspace_size"))


def error_from_status(status: int, message: str) -> KDAError:
    """The exception of libkda's `status`; an empty message names the status."""
    return _BY_STATUS.get(status, KDARuntimeError)(message or STATUS_NAMES.get(status, f"libkda status {status}"),
                                                   status)


def in_callers_terms(err: KDAError, fn: str) -> KDAError:
    """`err` in the terms of the call `fn`: "kda_decode: argument 'state_indices': ..." becomes
    "fused_recurrent_kda: argument 'ssm_state_indices': ... (libkda's field 'state_indices')"."""
    c_fn, sep, rest = err.message.partition(": ")
    if not sep or c_fn not in _C_ENTRY_POINTS:
        new = err.message if err.message.startswith(fn + ":") else f"{fn}: {err.message}"
    elif not rest.startswith("argument '") or "'" not in rest[len("argument '"):]:
        new = f"{fn}: {rest}"
    else:
        field, _, tail = rest[len("argument '"):].partition("'")
        arg = ARGUMENT_OF_FIELD.get(field, field)
        for c_name, py_name in _DETAIL_WORDS:
            tail = c_name.sub(py_name, tail)
        new = f"{fn}: argument '{arg}'{tail}" + (f" (libkda's field '{field}')" if arg != field else "")
    return type(err)(new, err.status)
