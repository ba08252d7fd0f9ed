"""libkda through ctypes: loading it on first use, the structs' mirrors and their builder, contexts, the calls."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_void_p
from typing import NamedTuple

from ._errors import KDALibraryNotFoundError, error_from_status

HEADER_VERSION_MAJOR, HEADER_VERSION_MINOR = 0, 1  # the header this package mirrors (include/kda.h)
BACKEND_AUTO, BACKEND_CPU, BACKEND_REFERENCE, BACKEND_CUDA = 0, 1, 2, 3  # kda_backend_t
FLOAT32, FLOAT16, BFLOAT16, INT32, INT64 = 0, 1, 2, 3, 4  # kda_dtype_t
CP_AUTO, CP_OFF, CP_ON = 0, 1, 2  # kda_cp_mode_t
CP_PIECE_MULTIPLE, CP_MAX_PIECE_LEN = 64, 1 << 24  # cp_piece_len's multiple and largest value
CPU_CONTEXT = (BACKEND_CPU, 0)  # (backend, device) that host arrays and CPU tensors run on
_lib: _Library | None = None
_lib_lock = threading.Lock()
_contexts: dict[tuple[int, int], Context] = {}
_contexts_lock = threading.Lock()

_CTYPES = {"size": c_size_t, "i64": c_int64, "i32": c_int32, "int": c_int, "enum": c_int, "ptr": c_void_p,
           "float": c_float}  # C enums of this header are int-sized


def _layout(spec: str) -> list:
    return [(n, _CTYPES[t]) for n, t in (f.split() for f in spec.replace("\n", ",").split(",") if f.strip())]


class KdaArgs(ctypes.Structure):
    """The ctypes mirror of ``kda_args_t``, field for field (tests/python/test_binding.py checks the layout)."""
    _fields_ = _layout("""
        struct_size size, batch i64, seq_len i64, num_qk_heads i32, num_v_heads i32, head_dim_k i32, head_dim_v i32
        cu_seqlens ptr, cu_seqlens_dtype enum, num_seqs i64, cu_seqlens_host ptr
        dtype enum, q ptr, k ptr, v ptr, g ptr, g_dtype enum, beta ptr, beta_dtype enum, o ptr, o_dtype enum
        initial_state ptr, initial_state_dtype enum, final_state ptr, final_state_dtype enum, state_v_first int
        state_indices ptr, num_state_slots i64
        scale float, use_qk_l2norm int, use_gate_in_kernel int, A_log ptr, dt_bias ptr, lower_bound float
        safe_gate int, use_beta_sigmoid int, allow_neg_eigval int
        state_indices_cols i64, state_indices_row_stride i64, num_accepted_tokens ptr, beta_headwise int
        cp_mode enum, cp_piece_len i64, chunk_states ptr, chunk_states_dtype enum, saved ptr, saved_bytes size
        cp_num_ranks i32, cp_rank i32, cp_pre_ranks i32, cp_post_ranks i32, cp_summary_dtype enum, cp_summaries ptr
        cp_summaries_bytes size, cp_primed i32""")


class KdaBackwardArgs(ctypes.Structure):
    _fields_ = _layout("""
        struct_size size, problem ptr
        d_o ptr, d_o_dtype enum, d_final_state ptr, d_final_state_dtype enum
        dq ptr, dq_dtype enum, dk ptr, dk_dtype enum, dv ptr, dv_dtype enum, dg ptr, dg_dtype enum
        dbeta ptr, dbeta_dtype enum, d_initial_state ptr, d_initial_state_dtype enum
        dA_log ptr, ddt_bias ptr, cp_summaries ptr, cp_summaries_bytes size""")


# kda_args_t's pointers that have a dtype field beside them (name + "_dtype")
_TYPED = frozenset(("cu_seqlens", "g", "beta", "o", "initial_state", "final_state", "chunk_states"))
_GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias")  # kda_backward_args_t
_A, _B, _N, _P = POINTER(KdaArgs), POINTER(KdaBackwardArgs), POINTER(c_size_t), c_void_p
_FUNCTIONS = [  # C function (an attribute of _Library without "kda_"), result, argument types
    ("kda_version", c_int), ("kda_last_error", c_char_p), ("kda_create", c_int, POINTER(_P), c_int, c_int),
    ("kda_destroy", c_int, _P), ("kda_get_backend", c_int, _P, POINTER(c_int)),
    ("kda_set_num_threads", c_int, _P, c_int), ("kda_get_num_threads", c_int, _P, POINTER(c_int)),
    ("kda_args_init", None, _P), ("kda_backward_args_init", None, _P),
    ("kda_forward_workspace_size", c_int, _P, _A, _N), ("kda_forward_saved_size", c_int, _P, _A, _N),
    ("kda_forward", c_int, _P, _A, _P, c_size_t, _P), ("kda_decode_workspace_size", c_int, _P, _A, _N),
    ("kda_decode", c_int, _P, _A, _P, c_size_t, _P), ("kda_backward_workspace_size", c_int, _P, _B, _N),
    ("kda_backward", c_int, _P, _B, _P, c_size_t, _P), ("kda_cp_forward_summary_workspace_size", c_int, _P, _A, _N),
    ("kda_cp_forward_summary", c_int, _P, _A, _P, c_size_t, _P, c_size_t, _P),
    ("kda_cp_backward_summary_workspace_size", c_int, _P, _B, _N),
    ("kda_cp_backward_summary", c_int, _P, _B, _P, c_size_t, _P, c_size_t, _P),
]


class KdaOptions(NamedTuple):
    """The settings of one call, as kda_args_t reads them: built once by kda._api, passed down unchanged."""
    scale: float                  # the output scale, resolved (K ** -0.5 for None); 0.0: o = 0 (FLA's product)
    use_qk_l2norm: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid: bool = False
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    lower_bound: float = 0.0      # the sigmoid gate's bound; 0.0: unset (softplus gate)
    state_v_first: bool = False
    cp: int = -1                  # context parallelism: -1 auto, 0 off, > 0 on with pieces of that many tokens


def set_cp(a: KdaArgs, cp: int) -> None:
    if cp == 0:
        a.cp_mode = CP_OFF
    elif cp > 0:
        a.cp_mode, a.cp_piece_len = CP_ON, cp


def build_args(opts: KdaOptions, fn: str, ptr, code, q, k, v, g, beta, o, **optional) -> KdaArgs:
    """The kda_args_t of one call, numpy or torch: `ptr(x)` is x's address, `code(fn, field, x)` its kda_dtype_t;
    `optional`: more pointer fields by name (None: unset). Sizes come from the shapes, checks from the caller."""
    a = KdaArgs.from_buffer_copy(library().template)
    a.batch, a.seq_len, a.num_qk_heads, a.head_dim_k = q.shape
    a.num_v_heads, a.head_dim_v = v.shape[2], v.shape[3]
    a.dtype, a.q, a.k, a.v = code(fn, "q", q), ptr(q), ptr(k), ptr(v)
    for field, x in dict(g=g, beta=beta, o=o, **optional).items():
        if x is not None:
            setattr(a, field, ptr(x))
            if field in _TYPED:
                setattr(a, field + "_dtype", code(fn, field, x))
    cu, idx = optional.get("cu_seqlens"), optional.get("state_indices")
    if cu is not None:
        a.num_seqs = cu.shape[0] - 1
    if idx is not None:
        pool = optional.get("initial_state")
        a.num_state_slots = (pool if pool is not None else optional["final_state"]).shape[0]
        if idx.ndim == 2:  # speculative decoding: [N, T_max] per-token slots, rows contiguous
            a.state_indices_cols = idx.shape[1]
    a.beta_headwise = beta.ndim == 4
    # libkda reads scale 0 as "K^-1/2": a scale of 0 runs with 1 and its caller zeroes o
    a.scale = opts.scale if opts.scale != 0.0 else 1.0
    for name in opts._fields[1:8]:  # kda_args_t's fields of the same names
        setattr(a, name, getattr(opts, name))
    set_cp(a, opts.cp)
    return a


def build_backward_args(a: KdaArgs, fn: str, ptr, code, do, dht, grads) -> KdaBackwardArgs:
    """The kda_backward_args_t of problem `a` for `do`, `dht` (None: zero), writing `grads` (None: not computed)."""
    b = KdaBackwardArgs.from_buffer_copy(library().backward_template)
    b.problem = ctypes.addressof(a)
    b.d_o, b.d_o_dtype = ptr(do), code(fn, "do", do)
    if dht is not None:
        b.d_final_state, b.d_final_state_dtype = ptr(dht), code(fn, "dht", dht)
    for field, x in zip(_GRADIENTS, grads):
        if x is not None:
            setattr(b, field, ptr(x))
            if field not in ("dA_log", "ddt_bias"):  # float32 only: no dtype field
                setattr(b, field + "_dtype", code(fn, field, x))
    return b


class _Library:

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self.cdll, self.path = cdll, path
        for name, restype, *argtypes in _FUNCTIONS:
            f = getattr(cdll, name)
            f.restype, f.argtypes = restype, argtypes
            setattr(self, name[4:], f)
        v = self.version()
        self.version_string = f"{v // 10000}.{(v // 100) % 100}.{v % 100}"
        if v // 10000 != HEADER_VERSION_MAJOR:
            raise KDALibraryNotFoundError(f"libkda at {path} is version {self.version_string}; this kda package needs "
                                          f"{HEADER_VERSION_MAJOR}.x (set KDA_LIBRARY to a matching build)")
        self.library_args_size, self.template = self._defaults(self.args_init, KdaArgs, "kda_args_t")
        _, self.backward_template = self._defaults(self.backward_args_init, KdaBackwardArgs, "kda_backward_args_t")

    def _defaults(self, init, cls, c_name: str):
        """(the library's sizeof(c_name), its defaults as a `cls`), from a buffer large enough for a newer struct."""
        probe = ctypes.create_string_buffer(4096)
        init(probe)
        lib_size, ours = c_size_t.from_buffer(probe).value, ctypes.sizeof(cls)
        if lib_size < ours:
            raise KDALibraryNotFoundError(f"libkda at {self.path} has sizeof({c_name}) = {lib_size}, smaller than "
                                          f"this package's {ours}: the library is older than the package")
        t = cls.from_buffer_copy(probe.raw[:ours])
        t.struct_size = ours
        return lib_size, t

    def error(self, status: int):
        msg = self.last_error()
        return error_from_status(status, msg.decode("utf-8", "replace") if msg else "")


def library() -> _Library:  # loaded on first use
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        env, here = os.environ.get("KDA_LIBRARY"), os.path.dirname(os.path.abspath(__file__))
        # an explicit choice is the only one tried: falling back elsewhere would hide a mistake
        candidates = [("$KDA_LIBRARY", env)] if env else [
            ("bundled with the package", os.path.join(here, "libkda.so")),
            ("the repository's build tree", os.path.normpath(os.path.join(here, "..", "..", "build", "libkda.so"))),
            ("ctypes.util.find_library('kda')", ctypes.util.find_library("kda"))]
        tried = []
        for where, path in candidates:
            if not path or (os.sep in path and not os.path.exists(path)):
                tried.append(f"  {where}: {path} (no such file)" if path else f"  {where}: not found")
                continue
            try:
                cdll = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"  {where}: {path} ({e})")
                continue
            _lib = _Library(cdll, path)  # a library of another version raises here: not a place to go past
            return _lib
        raise KDALibraryNotFoundError(
            "kda: could not load libkda. Searched, in order:\n" + "\n".join(tried) +
            "\nBuild it (make build, or pip install ./python) or set KDA_LIBRARY to the path of libkda.so.")


def library_path() -> str:
    """The path of the libkda that is (or would now be) loaded."""
    return library().path


class Context:  # one per (backend, device), made on first use; a lock (one thread at a time), a host workspace
    __slots__ = ("handle", "backend", "device", "lock", "ws_buf", "ws_ptr", "ws_size", "__weakref__")

    def __init__(self, handle: int, backend: int, device: int):
        self.handle, self.backend, self.device = handle, backend, device
        self.lock, self.ws_buf, self.ws_ptr, self.ws_size = threading.Lock(), None, None, 0

    def host_workspace(self, nbytes: int):
        if nbytes > self.ws_size:  # call with the lock held
            self.ws_buf = ctypes.create_string_buffer(max(nbytes, 2 * self.ws_size))
            self.ws_ptr, self.ws_size = ctypes.addressof(self.ws_buf), len(self.ws_buf)
        return self.ws_ptr

    def num_threads(self) -> int:
        return _out(library().get_num_threads, self.handle, ctype=c_int)

    def set_num_threads(self, n: int) -> None:
        with self.lock:
            _check(library().set_num_threads(self.handle, int(n)))

    def saved_size(self, args: KdaArgs) -> int:
        with self.lock:
            return _out(_lib.forward_saved_size, self.handle, byref(args))

    def run(self, entry: str, args, workspace=None, stream=None, nbytes: int | None = None, out=()) -> int:
        """`entry` of `args` with the workspace its size query asks for (`workspace(n)`: (pointer, keep-alive); None:
        the host's); `nbytes`: a size to try first, the query's on failure; `out`: a CP summary's pointer and bytes."""
        L, pa = _lib, byref(args)
        call, size_fn = getattr(L, entry), getattr(L, entry + "_workspace_size")
        with self.lock:
            if nbytes is not None:
                st = self._call(call, pa, nbytes, workspace, stream, out)
                if not st:
                    return nbytes
                err = L.error(st)  # now: the size query below may overwrite the thread's last error
            n = _out(size_fn, self.handle, pa)
            if nbytes is not None and n <= nbytes:
                raise err
            _check(self._call(call, pa, n, workspace, stream, out))
            return n

    def _call(self, entry, pa, n: int, workspace, stream, out) -> int:
        # `keep`: the allocator's block, valid for the stream it was allocated on while referenced
        ptr, keep = (None, None) if n == 0 else (self.host_workspace(n), None) if workspace is None else workspace(n)
        return entry(self.handle, pa, *out, ptr, n, stream)


def get_context(backend: int, device: int = 0) -> Context:
    ctx = _contexts.get((backend, device))
    if ctx is not None:
        return ctx
    L = library()  # loaded outside the contexts' lock
    with _contexts_lock:
        ctx = _contexts.get((backend, device))
        if ctx is None:
            h = c_void_p()
            _check(L.create(byref(h), backend, device))
            ctx = _contexts[(backend, device)] = Context(h.value, backend, device)
        return ctx


def _forget_contexts_in_child() -> None:
    """A CPU context's worker threads do not exist in a forked child: it drops (leaks) every cached context."""
    global _contexts_lock, _lib_lock
    _contexts.clear()
    _contexts_lock, _lib_lock = threading.Lock(), threading.Lock()


def _check(status: int) -> None:
    if status:
        raise _lib.error(status)


def _out(f, *args, ctype=c_size_t):
    value = ctype()
    _check(f(*args, byref(value)))
    return value.value


os.register_at_fork(after_in_child=_forget_contexts_in_child)
