"""libkda through ctypes: finding and loading the library, the kda_args_t mirror, contexts, and the calls.

Nothing here runs when ``kda`` is imported: the library is loaded by the first call that needs it, so that
``import kda`` works on a machine without it (the call then raises :class:`KDALibraryNotFoundError` listing the
places searched).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_void_p

from ._errors import KDALibraryNotFoundError, error_from_status

__all__ = ["KdaArgs", "KdaBackwardArgs", "library", "library_path", "get_context", "run", "BACKEND_AUTO", "BACKEND_CPU",
           "BACKEND_REFERENCE", "BACKEND_CUDA"]

# The header this package mirrors (include/kda.h)
HEADER_VERSION_MAJOR = 0
HEADER_VERSION_MINOR = 1

# kda_backend_t
BACKEND_AUTO = 0
BACKEND_CPU = 1
BACKEND_REFERENCE = 2
BACKEND_CUDA = 3
BACKEND_NAMES = {BACKEND_AUTO: "auto", BACKEND_CPU: "cpu", BACKEND_REFERENCE: "reference", BACKEND_CUDA: "cuda"}

# kda_dtype_t
FLOAT32 = 0
FLOAT16 = 1
BFLOAT16 = 2
INT32 = 3
INT64 = 4

_enum = c_int  # C enums of this header are int-sized

# kda_cp_mode_t and the piece length's bounds (include/kda.h)
CP_AUTO = 0
CP_OFF = 1
CP_ON = 2
CP_PIECE_MULTIPLE = 64
CP_MAX_PIECE_LEN = 1 << 24


class KdaArgs(ctypes.Structure):
    """The ctypes mirror of ``kda_args_t``, field for field (tests/python/test_binding.py checks the layout)."""

    _fields_ = [
        ("struct_size", c_size_t),
        # problem size
        ("batch", c_int64),
        ("seq_len", c_int64),
        ("num_qk_heads", c_int32),
        ("num_v_heads", c_int32),
        ("head_dim_k", c_int32),
        ("head_dim_v", c_int32),
        # variable-length sequences
        ("cu_seqlens", c_void_p),
        ("cu_seqlens_dtype", _enum),
        ("num_seqs", c_int64),
        ("cu_seqlens_host", c_void_p),
        # inputs
        ("dtype", _enum),
        ("q", c_void_p),
        ("k", c_void_p),
        ("v", c_void_p),
        ("g", c_void_p),
        ("g_dtype", _enum),
        ("beta", c_void_p),
        ("beta_dtype", _enum),
        # output
        ("o", c_void_p),
        ("o_dtype", _enum),
        # states
        ("initial_state", c_void_p),
        ("initial_state_dtype", _enum),
        ("final_state", c_void_p),
        ("final_state_dtype", _enum),
        ("state_v_first", c_int),
        ("state_indices", c_void_p),
        ("num_state_slots", c_int64),
        # options
        ("scale", c_float),
        ("use_qk_l2norm", c_int),
        ("use_gate_in_kernel", c_int),
        ("A_log", c_void_p),
        ("dt_bias", c_void_p),
        ("lower_bound", c_float),
        ("safe_gate", c_int),
        ("use_beta_sigmoid", c_int),
        ("allow_neg_eigval", c_int),
        # speculative decoding and headwise beta (appended)
        ("state_indices_cols", c_int64),
        ("state_indices_row_stride", c_int64),
        ("num_accepted_tokens", c_void_p),
        ("beta_headwise", c_int),
        # intra-card context parallelism (appended)
        ("cp_mode", _enum),
        ("cp_piece_len", c_int64),
        # chunk-start states (appended)
        ("chunk_states", c_void_p),
        ("chunk_states_dtype", _enum),
        # what the forward keeps for the backward (appended)
        ("saved", c_void_p),
        ("saved_bytes", c_size_t),
    ]


def set_cp(a: "KdaArgs", cp: int) -> None:
    """kda_args_t's cp_mode and cp_piece_len from the bindings' one number: < 0 auto (the template's default), 0 off,
    > 0 on with pieces of that many tokens (checked by the caller)."""
    if cp == 0:
        a.cp_mode = CP_OFF
    elif cp > 0:
        a.cp_mode, a.cp_piece_len = CP_ON, cp


class KdaBackwardArgs(ctypes.Structure):
    """The ctypes mirror of ``kda_backward_args_t``, field for field."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("problem", c_void_p),  # const kda_args_t *
        # incoming gradients
        ("d_o", c_void_p),
        ("d_o_dtype", _enum),
        ("d_final_state", c_void_p),
        ("d_final_state_dtype", _enum),
        # gradient outputs
        ("dq", c_void_p),
        ("dq_dtype", _enum),
        ("dk", c_void_p),
        ("dk_dtype", _enum),
        ("dv", c_void_p),
        ("dv_dtype", _enum),
        ("dg", c_void_p),
        ("dg_dtype", _enum),
        ("dbeta", c_void_p),
        ("dbeta_dtype", _enum),
        ("d_initial_state", c_void_p),
        ("d_initial_state_dtype", _enum),
        ("dA_log", c_void_p),
        ("ddt_bias", c_void_p),
    ]


_ARGS_P = POINTER(KdaArgs)
_BWD_P = POINTER(KdaBackwardArgs)
_CTX_PP = POINTER(c_void_p)


def _candidates() -> list[tuple[str, str | None]]:
    """(description, path) of each place libkda is looked for, in order."""
    env = os.environ.get("KDA_LIBRARY")
    if env:
        # An explicit choice is the only one tried: falling back elsewhere would hide a mistake.
        return [("$KDA_LIBRARY", env)]
    here = os.path.dirname(os.path.abspath(__file__))
    found = ctypes.util.find_library("kda")
    return [
        ("bundled with the package", os.path.join(here, "libkda.so")),
        ("the repository's build tree", os.path.normpath(os.path.join(here, "..", "..", "build", "libkda.so"))),
        ("ctypes.util.find_library('kda')", found),
    ]


class _Library:
    """The loaded libkda with its function objects, prototyped once."""

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self.cdll = cdll
        self.path = path
        L = cdll

        def fn(name, restype, *argtypes):
            f = getattr(L, name)
            f.restype = restype
            f.argtypes = list(argtypes)
            return f

        self.version = fn("kda_version", c_int)
        self.status_string = fn("kda_status_string", c_char_p, c_int)
        self.last_error = fn("kda_last_error", c_char_p)
        self.dtype_size = fn("kda_dtype_size", c_size_t, c_int)
        self.create = fn("kda_create", c_int, _CTX_PP, c_int, c_int)
        self.destroy = fn("kda_destroy", c_int, c_void_p)
        self.get_backend = fn("kda_get_backend", c_int, c_void_p, POINTER(c_int))
        self.backend_name = fn("kda_backend_name", c_char_p, c_int)
        self.set_num_threads = fn("kda_set_num_threads", c_int, c_void_p, c_int)
        self.get_num_threads = fn("kda_get_num_threads", c_int, c_void_p, POINTER(c_int))
        self.args_init = fn("kda_args_init", None, c_void_p)
        self.forward_workspace_size = fn("kda_forward_workspace_size", c_int, c_void_p, _ARGS_P, POINTER(c_size_t))
        self.forward_saved_size = fn("kda_forward_saved_size", c_int, c_void_p, _ARGS_P, POINTER(c_size_t))
        self.forward = fn("kda_forward", c_int, c_void_p, _ARGS_P, c_void_p, c_size_t, c_void_p)
        self.decode_workspace_size = fn("kda_decode_workspace_size", c_int, c_void_p, _ARGS_P, POINTER(c_size_t))
        self.decode = fn("kda_decode", c_int, c_void_p, _ARGS_P, c_void_p, c_size_t, c_void_p)
        self.backward_args_init = fn("kda_backward_args_init", None, c_void_p)
        self.backward_workspace_size = fn("kda_backward_workspace_size", c_int, c_void_p, _BWD_P,
                                          POINTER(c_size_t))
        self.backward = fn("kda_backward", c_int, c_void_p, _BWD_P, c_void_p, c_size_t, c_void_p)

        v = self.version()
        major, minor = v // 10000, (v // 100) % 100
        if major != HEADER_VERSION_MAJOR:
            raise KDALibraryNotFoundError(
                f"libkda at {path} is version {major}.{minor}.{v % 100}; this kda package needs "
                f"{HEADER_VERSION_MAJOR}.x (set KDA_LIBRARY to a matching build)")

        # The defaults, from the library itself. kda_args_init writes sizeof(its kda_args_t) bytes: give it a
        # buffer large enough for a newer library's longer struct, then keep the part this mirror knows.
        probe = ctypes.create_string_buffer(4096)
        self.args_init(probe)
        lib_size = c_size_t.from_buffer(probe).value
        ours = ctypes.sizeof(KdaArgs)
        if lib_size < ours:
            raise KDALibraryNotFoundError(
                f"libkda at {path} has sizeof(kda_args_t) = {lib_size}, smaller than this package's {ours}: "
                f"the library is older than the package")
        self.library_args_size = lib_size
        self.template = KdaArgs.from_buffer_copy(probe.raw[:ours])
        self.template.struct_size = ours
        probe = ctypes.create_string_buffer(4096)
        self.backward_args_init(probe)
        ours = ctypes.sizeof(KdaBackwardArgs)
        if c_size_t.from_buffer(probe).value < ours:
            raise KDALibraryNotFoundError(f"libkda at {path} has a smaller kda_backward_args_t than this package's "
                                          f"{ours} bytes: the library is older than the package")
        self.backward_template = KdaBackwardArgs.from_buffer_copy(probe.raw[:ours])
        self.backward_template.struct_size = ours

    def error(self, status: int):
        """The exception for `status`, with the calling thread's kda_last_error() message."""
        msg = self.last_error()
        return error_from_status(status, msg.decode("utf-8", "replace") if msg else "")


_lib: _Library | None = None
_lib_lock = threading.Lock()


def _load() -> _Library:
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        for where, path in _candidates():
            if not path:
                tried.append(f"  {where}: not found")
                continue
            if os.sep in path and not os.path.exists(path):
                tried.append(f"  {where}: {path} (no such file)")
                continue
            try:
                cdll = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"  {where}: {path} ({e})")
                continue
            _lib = _Library(cdll, path)
            return _lib
        raise KDALibraryNotFoundError(
            "kda: could not load libkda. Searched, in order:\n" + "\n".join(tried) +
            "\nBuild it (make build, or pip install ./python) or set KDA_LIBRARY to the path of libkda.so.")


def library() -> _Library:
    """The loaded library (loading it on first use)."""
    return _lib if _lib is not None else _load()


def library_path() -> str:
    """The path of the libkda that is (or would now be) loaded."""
    return library().path


# ---------------------------------------------------------------------------------------------------------
# Contexts: one per (backend, device), created on first use, each with a lock (a context serves one thread
# at a time) and, for the CPU backends, a reusable host workspace.
# ---------------------------------------------------------------------------------------------------------
class Context:
    __slots__ = ("handle", "backend", "device", "lock", "ws_buf", "ws_ptr", "ws_size", "__weakref__")

    def __init__(self, handle: int, backend: int, device: int):
        self.handle = handle
        self.backend = backend
        self.device = device
        self.lock = threading.Lock()
        self.ws_buf = None
        self.ws_ptr = None
        self.ws_size = 0

    def host_workspace(self, nbytes: int):
        """A host buffer of at least nbytes, kept between calls (call with the lock held)."""
        if nbytes > self.ws_size:
            size = max(nbytes, 2 * self.ws_size)
            buf = ctypes.create_string_buffer(size)
            self.ws_buf, self.ws_ptr, self.ws_size = buf, ctypes.addressof(buf), size
        return self.ws_ptr

    def num_threads(self) -> int:
        L = library()
        n = c_int()
        st = L.get_num_threads(self.handle, byref(n))
        if st:
            raise L.error(st)
        return n.value

    def set_num_threads(self, n: int) -> None:
        L = library()
        with self.lock:
            st = L.set_num_threads(self.handle, int(n))
            if st:
                raise L.error(st)


_contexts: dict[tuple[int, int], Context] = {}
_contexts_lock = threading.Lock()


def get_context(backend: int, device: int = 0) -> Context:
    """The cached context of (backend, device), created on first use. Failures are not cached."""
    ctx = _contexts.get((backend, device))
    if ctx is not None:
        return ctx
    L = library()
    with _contexts_lock:
        ctx = _contexts.get((backend, device))
        if ctx is None:
            h = c_void_p()
            st = L.create(byref(h), backend, device)
            if st:
                raise L.error(st)
            ctx = Context(h.value, backend, device)
            _contexts[(backend, device)] = ctx
        return ctx


def _forget_contexts_in_child() -> None:
    """After fork(), a CPU context's worker threads do not exist in the child: using it there would wait for them
    forever. The child drops every cached context (leaking the handles: destroying would join those threads) and
    creates new ones on first use."""
    global _contexts_lock, _lib_lock
    _contexts.clear()
    _contexts_lock = threading.Lock()
    _lib_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_contexts_in_child)


def run(ctx: Context, args: KdaArgs, decode: bool, workspace=None, stream=None, nbytes: int | None = None) -> int:
    """Query the workspace, get it, and run kda_forward (decode=False) or kda_decode on `ctx`; returns the
    workspace size used.

    `workspace(nbytes)` returns (pointer, keep-alive object) for device contexts; None means the context's
    host workspace. Raises the KDAError of a failing status.

    `nbytes`: the size this returned for an earlier call of the same signature (kda._torch remembers it): the
    size query (a second ctypes call) is skipped. Should the call fail, the size query settles what the plain
    order would have done: its own error if it fails; else, if it asks for more than `nbytes` (a CPU context
    given more threads since), the call again with that much; else the call's own error.
    """
    L = _lib
    return _settle(ctx, byref(args), L.decode_workspace_size if decode else L.forward_workspace_size,
                   L.decode if decode else L.forward, workspace, stream, nbytes)


def _settle(ctx: Context, pa, size_fn, entry, workspace, stream, nbytes: int | None) -> int:
    """run's order for one entry point and its size query (kda_forward, kda_decode, kda_backward): the call with
    `nbytes` when given, else or on failure the size query, then the call with the size it asks for."""
    L = _lib
    with ctx.lock:
        if nbytes is not None:
            st = _call(ctx, pa, entry, nbytes, workspace, stream)
            if not st:
                return nbytes
            err = L.error(st)  # now: the size query below may overwrite the thread's last error
        size = c_size_t()
        st = size_fn(ctx.handle, pa, byref(size))
        if st:
            raise L.error(st)
        n = size.value
        if nbytes is not None and n <= nbytes:
            raise err
        st = _call(ctx, pa, entry, n, workspace, stream)
        if st:
            raise L.error(st)
        return n


def _call(ctx: Context, pa, entry, n: int, workspace, stream) -> int:
    """An entry point (kda_forward, kda_decode, kda_backward) with a workspace of n bytes (ctx.lock held); returns
    the status."""
    keep = None
    if n == 0:
        ptr = None
    elif workspace is None:
        ptr = ctx.host_workspace(n)
    else:
        ptr, keep = workspace(n)
    st = entry(ctx.handle, pa, ptr, n, stream)
    del keep  # the allocator's block stays valid for the stream it was allocated on
    return st


def saved_size(ctx: Context, args: KdaArgs) -> int:
    """kda_forward_saved_size: the bytes kda_forward keeps for kda_backward at args.saved (0: nothing)."""
    L = _lib
    size = c_size_t()
    with ctx.lock:
        st = L.forward_saved_size(ctx.handle, byref(args), byref(size))
        if st:
            raise L.error(st)
    return size.value


def run_backward(ctx: Context, args: KdaBackwardArgs, workspace=None, stream=None, nbytes: int | None = None) -> int:
    """Query the workspace, get it, and run kda_backward on `ctx` (as run); returns the workspace size used.
    `nbytes`: the size this returned for an earlier call of the same signature: the size query is skipped, and a
    failing call is settled as run settles it (kda._torch's backward fast path)."""
    L = _lib
    return _settle(ctx, byref(args), L.backward_workspace_size, L.backward, workspace, stream, nbytes)
