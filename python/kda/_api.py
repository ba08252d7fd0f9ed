"""``chunk_kda`` and ``fused_recurrent_kda``: FLA 0.6.0's entry points, computed by libkda.

Argument handling follows FLA: the same signature and defaults, the same checks in the same order with the same
exception types (where FLA uses ``assert``, :class:`KDAAssertionError`, which is both a ValueError and an
AssertionError). What FLA accepts but libkda cannot do yet raises :class:`KDANotSupportedError` naming the
argument; nothing is silently ignored.

numpy arrays run on the CPU backend here; torch tensors go through the custom ops of ``kda._torch`` (imported
only when a torch tensor is passed, so the numpy path never imports torch).
"""

from __future__ import annotations

import ctypes
import operator
import sys
import warnings

from . import _lib
from ._errors import (KDAAssertionError, KDAError, KDAInvalidValueError, KDANotSupportedError, KDATypeError,
                      in_callers_terms)
from ._lib import FLOAT16, FLOAT32, INT32, INT64, KdaArgs, KdaBackwardArgs

try:  # numpy is needed for numpy inputs only
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = ["chunk_kda", "chunk_kda_backward", "fused_recurrent_kda"]

if np is not None:
    _NP_FLOAT = {np.dtype(np.float32): FLOAT32, np.dtype(np.float16): FLOAT16}
    _NP_INT = {np.dtype(np.int32): INT32, np.dtype(np.int64): INT64}
    _ndarray = np.ndarray
    _f32 = np.dtype(np.float32)
    _i32 = np.dtype(np.int32)
else:  # pragma: no cover
    _NP_FLOAT, _NP_INT, _ndarray = {}, {}, ()


def _pick_data_ptr():
    """A function giving an ndarray's data address. ``a.ctypes.data`` costs ~0.7 us (it builds an object); the
    address is also the first field after the object header of numpy's PyArrayObject (the ABI every compiled
    numpy extension reads through PyArray_DATA), ~0.1 us to read. Use that when it agrees with ``a.ctypes.data``
    on a few probes (it would not on an interpreter whose id() is not an address), else the public spelling."""
    slow = lambda a: a.ctypes.data  # noqa: E731
    if np is None:
        return slow
    offset = object.__basicsize__
    from_address = ctypes.c_void_p.from_address

    def fast(a):
        return from_address(id(a) + offset).value

    try:
        base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        probes = (base, base[1:], base[:, 1:].T, np.zeros(5, np.float16)[2:], np.ascontiguousarray(base[::2]))
        if all(fast(a) == a.ctypes.data for a in probes):
            return fast
    except Exception:  # pragma: no cover
        pass
    return slow  # pragma: no cover


_data_ptr = _pick_data_ptr()
_CPU_KEY = (_lib.BACKEND_CPU, 0)  # the context numpy inputs run on


def _shape(s) -> str:
    return "[" + ", ".join(str(int(d)) for d in s) + "]"


def _torch_module():
    """torch, if the caller has imported it (we never import it for them)."""
    return sys.modules.get("torch")


def _is_torch(x) -> bool:
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


# kda._torch.chunk_kda_cached, set when kda._torch is imported (the first torch call): chunk_kda's fast path for
# a call whose signature has passed all its checks before
_torch_chunk_cached = None


def _kind(fn: str, q) -> str:
    if isinstance(q, _ndarray):
        return "numpy"
    if _is_torch(q):
        return "torch"
    raise KDATypeError(f"{fn}: argument 'q': expected a torch.Tensor or a numpy.ndarray, got {type(q).__name__}")


# ---------------------------------------------------------------------------------------------------------
# Checks shared by both entry points and both array kinds
# ---------------------------------------------------------------------------------------------------------
def _check_ndim(fn: str, q, k, v, g, beta, fused: bool) -> None:
    for name, x, want in (("q", q, "[B, T, H, K]"), ("k", k, "[B, T, H, K]"), ("v", v, "[B, T, HV, V]"),
                          ("g", g, "[B, T, HV, K]"), ("beta", beta, "")):
        nd = getattr(x, "ndim", None)
        if nd is None:
            raise KDATypeError(f"{fn}: argument '{name}': expected an array like q, got {type(x).__name__}")
        if nd != 4 and want:
            raise KDAInvalidValueError(f"{fn}: argument '{name}': expected shape {want}, got {_shape(x.shape)}")
    nd = beta.ndim
    if nd == 4 and fused:  # headwise beta [B, T, HV, V]: one beta per value channel (FLA's fused_recurrent_kda)
        if tuple(beta.shape) != tuple(v.shape):
            raise KDAInvalidValueError(f"{fn}: argument 'beta': a headwise beta must have v's shape "
                                       f"{_shape(v.shape)}, got {_shape(beta.shape)}")
        return
    if nd != 3 and not (nd == 4 and not fused):  # chunk_kda: FLA's own assert below names the shape
        raise KDAInvalidValueError(f"{fn}: argument 'beta': expected shape [B, T, HV], got {_shape(beta.shape)}")


def _check_shapes(fn: str, q, k, v, g, beta, err, headwise_ok: bool = False) -> tuple:
    """FLA's shape checks (raising `err`, KDAAssertionError where FLA asserts), then ours. Returns the sizes."""
    B, T, H, K = q.shape
    vs = v.shape
    HV, V = vs[2], vs[3]
    if k.shape != q.shape:
        raise err(f"{fn}: q and k must have the same shape, got q={_shape(q.shape)} and k={_shape(k.shape)} "
                  f"(argument 'k')")
    if K > 256:
        raise err(f"{fn}: argument 'q': key head size K = {K} is above 256, the largest supported")
    if H < 1:
        raise KDAInvalidValueError(f"{fn}: argument 'q': H = {H}: there must be at least one query/key head")
    if HV % H != 0:
        raise err(f"{fn}: argument 'v': for GVA the number of value heads HV = {HV} must be a multiple of the "
                  f"number of query/key heads H = {H}")
    if g.shape != (B, T, HV, K):
        raise err(f"{fn}: argument 'g': expected shape [B, T, HV, K] = {_shape((B, T, HV, K))}, "
                  f"got {_shape(g.shape)}")
    if beta.shape != (B, T, HV) and not (headwise_ok and tuple(beta.shape) == (B, T, HV, V)):
        raise err(f"{fn}: argument 'beta': expected shape [B, T, HV] = {_shape((B, T, HV))}, "
                  f"got {_shape(beta.shape)}")
    if vs[0] != B or vs[1] != T:
        raise KDAInvalidValueError(f"{fn}: argument 'v': expected shape [B, T, HV, V] with B, T = {B}, {T} "
                                   f"(from q), got {_shape(vs)}")
    if K < 1 or V < 1 or HV < 1:
        raise KDAInvalidValueError(f"{fn}: argument 'q' / 'v': head sizes must be at least 1, got K = {K}, "
                                   f"V = {V}, HV = {HV}")
    if V > 256:
        raise KDANotSupportedError(f"{fn}: argument 'v': value head size V = {V} is above 256, the largest "
                                   f"libkda implements")
    return B, T, H, K, HV, V


def _check_state(fn: str, name: str, h, N: int, HV: int, K: int, V: int, state_v_first: bool, pool: bool):
    if getattr(h, "ndim", None) != 4:
        raise KDAInvalidValueError(f"{fn}: argument '{name}': expected a 4-D state, got "
                                   f"{_shape(h.shape) if hasattr(h, 'shape') else type(h).__name__}")
    s = h.shape
    tail = (HV, V, K) if state_v_first else (HV, K, V)
    if tuple(s[1:]) != tail or (not pool and s[0] != N):
        lead = "num_slots" if pool else "N"
        names = "[%s, HV, V, K]" % lead if state_v_first else "[%s, HV, K, V]" % lead
        want = _shape(((s[0] if pool else N),) + tail)
        raise KDAInvalidValueError(f"{fn}: argument '{name}': expected shape {names} = {want}, got {_shape(s)}")
    if pool and s[0] < 1:
        raise KDAInvalidValueError(f"{fn}: argument '{name}': a state pool needs at least one slot")


def _check_gate_params(fn: str, A_log, dt_bias, HV: int, K: int) -> None:
    if A_log is not None and _numel(A_log) != HV:
        raise KDAInvalidValueError(f"{fn}: argument 'A_log': expected {HV} values (shape [HV]), got shape "
                                   f"{_shape(A_log.shape)}")
    if dt_bias is not None and _numel(dt_bias) != HV * K:
        raise KDAInvalidValueError(f"{fn}: argument 'dt_bias': expected HV * K = {HV * K} values (shape "
                                   f"[HV * K]), got shape {_shape(dt_bias.shape)}")


def _numel(x) -> int:
    n = 1
    for d in x.shape:
        n *= int(d)
    return n


def _seq_count(fn: str, cu_seqlens) -> int:
    shape = getattr(cu_seqlens, "shape", None)
    if shape is None:
        return len(cu_seqlens) - 1
    if len(shape) != 1 or shape[0] < 1:
        raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens': expected a 1-D array of N + 1 offsets, got "
                                   f"shape {_shape(shape)}")
    return shape[0] - 1


# ---------------------------------------------------------------------------------------------------------
# Keywords: what each entry point reads from **kwargs (as FLA does); any other keyword is a TypeError, as a
# Python function without **kwargs would raise (FLA would ignore it silently; a typo then changes the result).
# FLA's keywords that kda does not implement raise NotImplementedError where they are read.
# ---------------------------------------------------------------------------------------------------------
_KWARGS = {
    "chunk_kda": ("A_log", "dt_bias", "chunk_size", "transpose_state_layout", "cp_piece_len"),
    "fused_recurrent_kda": ("transpose_state_layout", "ssm_state_indices", "inplace_final_state", "out",
                            "safe_gate", "cu_seqlens_cpu", "num_accepted_tokens"),
}


def _unexpected_kwargs(fn: str, kwargs: dict) -> KDATypeError:
    """The TypeError for keywords `fn` does not take, worded as Python's own, with a likely intended name."""
    import difflib
    import inspect
    entry = globals()[fn]
    known = [p for p in inspect.signature(entry).parameters if p != "kwargs"] + list(_KWARGS[fn])
    other = "fused_recurrent_kda" if fn == "chunk_kda" else "chunk_kda"
    notes = []
    for name in kwargs:
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            notes.append(f"'{name}': did you mean '{close[0]}'?")
        elif name in _KWARGS[other] or name in inspect.signature(globals()[other]).parameters:
            notes.append(f"'{name}' is a keyword of {other}")
    names = ", ".join(repr(n) for n in kwargs)
    plural = "s" if len(kwargs) > 1 else ""
    return KDATypeError(f"{fn}() got {'unexpected keyword arguments' if plural else 'an unexpected keyword argument'}"
                        f" {names}" + (f" ({'; '.join(notes)})" if notes else ""))


def _cp_piece_len(fn: str, x) -> int:
    """chunk_kda's cp_piece_len as the bindings pass it on (_lib.set_cp): -1 auto (None), 0 off, else the tokens per
    piece, checked here so that the error speaks of the keyword."""
    if x is None:
        return -1
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise KDATypeError(f"{fn}: `cp_piece_len` must be None, 0 or a whole number of tokens, got "
                           f"{type(x).__name__} {x!r}")
    n = operator.index(x)
    if n < 0:
        raise KDAInvalidValueError(f"{fn}: `cp_piece_len` must be None (libkda decides), 0 (no split) or a positive "
                                   f"multiple of {_lib.CP_PIECE_MULTIPLE}, got {n}")
    if n % _lib.CP_PIECE_MULTIPLE != 0:
        raise KDAInvalidValueError(f"{fn}: `cp_piece_len` must be a multiple of the chunk, {_lib.CP_PIECE_MULTIPLE} "
                                   f"tokens, got {n}")
    if n > _lib.CP_MAX_PIECE_LEN:
        raise KDAInvalidValueError(f"{fn}: `cp_piece_len` must be at most {_lib.CP_MAX_PIECE_LEN} tokens, got {n}")
    return n


def _transpose_alias(kwargs: dict, state_v_first: bool) -> bool:
    if state_v_first:
        raise KDAInvalidValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated; use `state_v_first`.", DeprecationWarning, stacklevel=3)
    return kwargs.pop("transpose_state_layout")


# ---------------------------------------------------------------------------------------------------------
# chunk_kda
# ---------------------------------------------------------------------------------------------------------
def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """Kimi Delta Attention, chunked (prefill) form: a drop-in for ``fla.ops.kda.chunk_kda`` (FLA 0.6.0).

    Per sequence and value head, with a K×V state S (natural-log gates):
    ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T`` and ``o_t = scale * S_t^T q_t``.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (float32, float16 or bfloat16; K <= 256).
        v: ``[B, T, HV, V]`` values, HV a multiple of H (GVA); same dtype as q.
        g: ``[B, T, HV, K]`` log decay, or with ``use_gate_in_kernel`` the raw gate input.
        beta: ``[B, T, HV]`` write strength, or its logit with ``use_beta_sigmoid_in_kernel``.
        scale: output scale; None means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), float32 (or bfloat16,
            an extension of FLA's float32-only contract).
        output_final_state: return the state after each sequence (float32, same layout).
        use_qk_l2norm_in_kernel: divide q and k by ``sqrt(sum(x**2) + 1e-6)`` over K first.
        use_gate_in_kernel: the log decay is ``-exp(A_log[h]) * softplus(g + dt_bias[h])``, or with
            ``lower_bound`` ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (A_log None:
            ``lower_bound * sigmoid(g + dt_bias[h])``). ``A_log`` ([HV]) and ``dt_bias`` ([HV * K]) come as
            keyword arguments; both are ignored without ``use_gate_in_kernel``, as is ``lower_bound``.
        use_beta_sigmoid_in_kernel: beta is a logit: ``beta = sigmoid(beta)`` (``2 * sigmoid`` with
            ``allow_neg_eigval``, which requires it).
        safe_gate: the caller's promise of bounded gates; with ``use_gate_in_kernel`` it requires
            ``lower_bound`` in [-5, 0). No effect on the result.
        disable_recompute, use_graph, max_num_seqs: accepted; they change nothing in a forward pass (FLA's
            ``max_num_seqs`` padding check is made).
        return_intermediate_states: inference mode only (torch.inference_mode()): also return h, the state
            before every chunk of 64 tokens of every sequence, ``[B, ceil(T / 64), HV, K, V]`` (varlen: ``[1,
            Σ ceil(len / 64), HV, K, V]``; ``[.., V, K]`` with ``state_v_first``) in q's dtype (kda_args_t's
            chunk_states). The CUDA backend writes it for K <= 128.
        cp_context: not implemented (NotImplementedError).
        state_v_first: states stored ``[V, K]`` per head. ``transpose_state_layout`` is its deprecated alias.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N packed sequences (B must be 1).
        cu_seqlens_cpu: optional host copy of ``cu_seqlens``; with CUDA tensors libkda validates it.
        chunk_size: 32 or 64 (keyword); the result does not depend on it.
        cp_piece_len: libkda's keyword (not FLA's): intra-card context parallelism of the CUDA forward, which
            may split a long sequence into pieces that run in parallel. None (default): libkda decides per call;
            0: never split; a positive multiple of 64 up to 2**24: always split, into pieces of that many tokens
            (for tests and benchmarks). The result does not depend on it beyond rounding; the CPU ignores it.

    Inputs may be torch tensors (CUDA: the CUDA backend on the tensors' device and current stream; CPU: the
    CPU backend) or numpy arrays (float32/float16, CPU backend; the outputs are numpy arrays then).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state float32, or None unless
        ``output_final_state``. With ``return_intermediate_states``: ``(o, final_state, h)``.

    With torch tensors the call is differentiable: ``.backward()`` gives q, k, v, g, beta, A_log, dt_bias and
    initial_state their gradients (libkda's kda_backward; CPU tensors for now, the CUDA backward is to come).
    numpy users call :func:`chunk_kda_backward`.
    """
    fast = _torch_chunk_cached
    remember = None
    if fast is not None:
        r, remember = fast(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, kwargs, scale,
                           output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                           use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                           return_intermediate_states, state_v_first, cp_context, use_graph, max_num_seqs)
        if r is not None:
            return r
    fn = "chunk_kda"
    A_log = dt_bias = None
    chunk_size = 64
    cp = -1
    if kwargs:
        kwargs = dict(kwargs)
        if "transpose_state_layout" in kwargs:
            state_v_first = _transpose_alias(kwargs, state_v_first)
        A_log = kwargs.pop("A_log", None)
        dt_bias = kwargs.pop("dt_bias", None)
        chunk_size = kwargs.pop("chunk_size", 64)
        cp = _cp_piece_len(fn, kwargs.pop("cp_piece_len", None))
        if kwargs:
            raise _unexpected_kwargs(fn, kwargs)
    if cp_context is not None:
        raise KDANotSupportedError(f"{fn}: cp_context (context parallelism) is not implemented by kda")

    kind = _kind(fn, q)
    if return_intermediate_states:  # FLA's two conditions, in FLA's words
        if kind == "numpy":
            raise KDANotSupportedError(f"{fn}: return_intermediate_states=True needs torch tensors (inference mode)")
        if not _torch_module().is_inference_mode_enabled():
            raise KDAAssertionError(f"{fn}: return_intermediate_states is only allowed in inference mode")
        if disable_recompute:
            raise KDAAssertionError(f"{fn}: return_intermediate_states must be used with disable_recompute=False")
    _check_ndim(fn, q, k, v, g, beta, fused=False)

    # FLA's checks, in FLA's order
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise KDAInvalidValueError(
                f"{fn}: the batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`; "
                f"flatten variable-length inputs first (argument 'q')")
        N = _seq_count(fn, cu_seqlens)
        if initial_state is not None and _state_rows(initial_state) != N:
            raise KDAInvalidValueError(
                f"{fn}: the number of initial states is expected to equal the number of input sequences, i.e. "
                f"{N} rather than {_state_rows(initial_state)} (argument 'initial_state')")
    else:
        N = q.shape[0]
    if initial_state is not None and not _is_state_dtype(initial_state, kind):
        raise KDAAssertionError(f"{fn}: argument 'initial_state': must be float32 (or bfloat16), got "
                                f"{initial_state.dtype}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise KDAInvalidValueError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True` and "
                                       f"`lower_bound` is not set.")
    else:
        A_log = dt_bias = None
    if chunk_size not in (32, 64):
        raise KDAInvalidValueError(f"{fn}: `chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise KDAInvalidValueError(f"{fn}: `lower_bound` must be set when `safe_gate=True` and "
                                       f"`use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise KDAInvalidValueError(f"{fn}: `lower_bound` must lie in the safe range [-5, 0), got "
                                       f"{lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise KDAInvalidValueError(f"{fn}: `allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    B, T, H, K, HV, V = _check_shapes(fn, q, k, v, g, beta, KDAAssertionError)
    if use_graph and cu_seqlens is not None:
        if max_num_seqs is None:
            max_num_seqs = N
        if N != max_num_seqs:
            raise KDAAssertionError(
                f"{fn}: with use_graph, cu_seqlens must be padded with empty tail sequences to exactly "
                f"max_num_seqs + 1 entries, got {N} sequences with max_num_seqs={max_num_seqs}")

    # ours
    if initial_state is not None:
        _check_state(fn, "initial_state", initial_state, N, HV, K, V, state_v_first, pool=False)
    if use_gate_in_kernel:
        _check_gate_params(fn, A_log, dt_bias, HV, K)
        if lower_bound is not None:
            lower_bound = float(lower_bound)
            if lower_bound == 0.0:
                # FLA's gate is then 0 * sigmoid(...) = 0 for every token: no decay. libkda reads 0 as "unset",
                # so compute that gate here.
                g, A_log, dt_bias, lower_bound, use_gate_in_kernel = _zeros_like(g), None, None, None, False
    else:
        lower_bound = None
    scale = K ** -0.5 if scale is None else float(scale)

    if kind == "numpy":
        return _np_call(fn, False, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, None, None,
                        1 if output_final_state else 0, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
                        B, T, H, K, HV, V, N, cp=cp)
    from . import _torch
    return _torch.chunk_kda(fn, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                            scale, bool(output_final_state), bool(use_qk_l2norm_in_kernel),
                            bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
                            bool(safe_gate), lower_bound, bool(state_v_first), N, remember, cp=cp,
                            states=bool(return_intermediate_states))


# ---------------------------------------------------------------------------------------------------------
# chunk_kda_backward: the gradients for numpy users (torch tensors: chunk_kda is differentiable)
# ---------------------------------------------------------------------------------------------------------
def chunk_kda_backward(q, k, v, g, beta, do, dht=None, *, scale: float | None = None, initial_state=None,
                       use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                       use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                       safe_gate: bool = False, lower_bound: float | None = None, state_v_first: bool = False,
                       cu_seqlens=None, A_log=None, dt_bias=None):
    """The gradients of ``chunk_kda`` (numpy arrays, CPU backend) for the loss weights ``do`` (``[B, T, HV, V]``,
    the gradient of o) and ``dht`` (the gradient of the final state, shaped as it; None: zero). The other
    arguments are the forward's, with the same meaning and checks.

    Returns ``(dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias)``: the first five in their inputs'
    dtypes and shapes; d_initial_state float32 (None without initial_state); dA_log, ddt_bias float32 shaped as
    given (None without use_gate_in_kernel or without them). With torch tensors, call ``.backward()`` on
    chunk_kda's outputs instead.
    """
    fn = "chunk_kda_backward"
    kind = _kind(fn, q)
    if kind != "numpy":
        raise KDATypeError(f"{fn}: argument 'q': numpy arrays only; with torch tensors chunk_kda is differentiable "
                           f"(call .backward() on its outputs)")
    _check_ndim(fn, q, k, v, g, beta, fused=False)
    B, T, H, K, HV, V = _check_shapes(fn, q, k, v, g, beta, KDAAssertionError)
    if cu_seqlens is not None:
        if B != 1:
            raise KDAInvalidValueError(f"{fn}: argument 'q': the batch size must be 1 with cu_seqlens, got {B}")
        N = _seq_count(fn, cu_seqlens)
    else:
        N = B
    if initial_state is not None:
        if not _is_state_dtype(initial_state, kind):
            raise KDAAssertionError(f"{fn}: argument 'initial_state': must be float32, got {initial_state.dtype}")
        _check_state(fn, "initial_state", initial_state, N, HV, K, V, state_v_first, pool=False)
    if dht is not None:
        if not _is_state_dtype(dht, kind):
            raise KDAAssertionError(f"{fn}: argument 'dht': must be float32, got {dht.dtype}")
        _check_state(fn, "dht", dht, N, HV, K, V, state_v_first, pool=False)
    if not isinstance(do, _ndarray) or tuple(do.shape) != tuple(v.shape):
        got = list(do.shape) if isinstance(do, _ndarray) else type(do).__name__
        raise KDAInvalidValueError(f"{fn}: argument 'do': expected a numpy array of v's shape {list(v.shape)}, got "
                                   f"{got}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise KDAInvalidValueError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True` and "
                                       f"`lower_bound` is not set.")
        _check_gate_params(fn, A_log, dt_bias, HV, K)
        if lower_bound is not None:
            lower_bound = float(lower_bound)
            if lower_bound == 0.0:  # FLA's gate is then 0: no decay, and no gradient to g, A_log, dt_bias
                g, A_log, dt_bias, lower_bound, use_gate_in_kernel = _zeros_like(g), None, None, None, False
    else:
        A_log = dt_bias = lower_bound = None
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise KDAInvalidValueError(f"{fn}: `allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    scale = K ** -0.5 if scale is None else float(scale)

    a, _, _, keep = _np_args(fn, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, None, None, 0, scale,
                             use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                             allow_neg_eigval, safe_gate, lower_bound, state_v_first, B, T, H, K, HV, V, N)
    q, k, v, g, beta, h0, _, _, A_log, dt_bias, _ = keep
    ptr = _data_ptr
    L = _lib._lib or _lib.library()
    b = KdaBackwardArgs.from_buffer_copy(L.backward_template)
    b.problem = ctypes.addressof(a)
    do = np.zeros_like(do) if scale == 0.0 else np.ascontiguousarray(do)  # FLA: o = 0 * S^T q
    b.d_o, b.d_o_dtype = ptr(do), _np_float(fn, "do", do)
    if dht is not None:
        dht = np.ascontiguousarray(dht)
        b.d_final_state = ptr(dht)  # float32 (checked), the default dtype
    grads = [np.empty_like(x) for x in (q, k, v, g, beta)]
    for name, x, gx in zip(("dq", "dk", "dv", "dg", "dbeta"), (q, k, v, g, beta), grads):
        setattr(b, name, ptr(gx))
        setattr(b, name + "_dtype", _np_float(fn, name, x))
    dh0 = dA = ddt = None
    if h0 is not None:
        dh0 = np.empty(h0.shape, _f32)
        b.d_initial_state = ptr(dh0)
    if A_log is not None:
        dA = np.empty(A_log.shape, _f32)
        b.dA_log = ptr(dA)
    if dt_bias is not None:
        ddt = np.empty(dt_bias.shape, _f32)
        b.ddt_bias = ptr(ddt)
    try:
        ctx = _lib._contexts.get(_CPU_KEY) or _lib.get_context(_lib.BACKEND_CPU, 0)
        _lib.run_backward(ctx, b)
    except KDAError as e:
        raise in_callers_terms(e, fn) from None
    return (*grads, dh0, dA, ddt)


# ---------------------------------------------------------------------------------------------------------
# fused_recurrent_kda
# ---------------------------------------------------------------------------------------------------------
def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens=None,
    **kwargs,
):
    """Kimi Delta Attention, token-by-token (decode) form: a drop-in for ``fla.ops.kda.fused_recurrent_kda``.

    Same operation, arguments and results as :func:`chunk_kda` (A_log ``[HV]`` and dt_bias ``[HV * K]`` are
    positional here, as in FLA), computed by libkda's recurrent decode; best for a few tokens per sequence.

    vLLM's decode keywords are supported as well:
        ssm_state_indices: 1-D int ``[N]``: ``initial_state`` is then a pool ``[num_slots, HV, K, V]`` and
            sequence n starts from slot ``ssm_state_indices[n]`` (negative: from zeros, nothing written).
            2-D int ``[N, T_max]`` (speculative decoding, as FLA's fused_recurrent_kda_fwd): sequence n starts
            from slot ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without
            num_accepted_tokens) and, with inplace_final_state, the state after its token t is written to slot
            ``ssm_state_indices[n, t]`` (negative: nothing written).
        num_accepted_tokens: int ``[N]`` in [1, T_max], with a 2-D ``ssm_state_indices``.
        inplace_final_state: write each sequence's final state back into ``initial_state`` (at its slot with
            ``ssm_state_indices``) and return ``initial_state`` as the final state.
        out: a preallocated ``[B, T, HV, V]`` output (returned as o).
    beta may be headwise, ``[B, T, HV, V]`` (one beta per value channel), as in FLA.
    Further keywords: ``safe_gate`` (as in chunk_kda), ``cu_seqlens_cpu`` (a host copy of cu_seqlens),
    ``transpose_state_layout`` (deprecated alias of ``state_v_first``).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state float32 ``[N, HV, K, V]`` if
        ``output_final_state``, ``initial_state`` itself with ``inplace_final_state``, else None.
    """
    fn = "fused_recurrent_kda"
    ssm_state_indices = out = cu_seqlens_cpu = num_accepted_tokens = None
    inplace_final_state = safe_gate = False
    if kwargs:
        kwargs = dict(kwargs)
        if "transpose_state_layout" in kwargs:
            state_v_first = _transpose_alias(kwargs, state_v_first)
        ssm_state_indices = kwargs.pop("ssm_state_indices", None)
        inplace_final_state = bool(kwargs.pop("inplace_final_state", False))
        out = kwargs.pop("out", None)
        safe_gate = bool(kwargs.pop("safe_gate", False))
        cu_seqlens_cpu = kwargs.pop("cu_seqlens_cpu", None)
        num_accepted_tokens = kwargs.pop("num_accepted_tokens", None)
        if kwargs:
            raise _unexpected_kwargs(fn, kwargs)

    kind = _kind(fn, q)
    _check_ndim(fn, q, k, v, g, beta, fused=True)
    pool = ssm_state_indices is not None

    # FLA's checks, in FLA's order
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise KDAInvalidValueError(
                f"{fn}: the batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`; "
                f"flatten variable-length inputs first (argument 'q')")
        N = _seq_count(fn, cu_seqlens)
        if initial_state is not None and not pool and _state_rows(initial_state) != N:
            raise KDAInvalidValueError(
                f"{fn}: the number of initial states is expected to equal the number of input sequences, i.e. "
                f"{N} rather than {_state_rows(initial_state)} (argument 'initial_state')")
    else:
        N = q.shape[0]
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise KDAInvalidValueError(f"{fn}: `allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if out is not None and tuple(out.shape) != tuple(v.shape):
        raise KDAAssertionError(f"{fn}: argument 'out': expected v's shape {_shape(v.shape)}, got "
                                f"{_shape(out.shape)}")
    if inplace_final_state and initial_state is None:
        raise KDAAssertionError(f"{fn}: inplace_final_state=True requires initial_state (argument "
                                f"'initial_state')")

    # ours
    B, T, H, K, HV, V = _check_shapes(fn, q, k, v, g, beta, KDAInvalidValueError, headwise_ok=True)
    if pool:
        nd = getattr(ssm_state_indices, "ndim", None)
        if nd not in (1, 2):
            raise KDAInvalidValueError(f"{fn}: argument 'ssm_state_indices': expected a 1-D array of N slots or "
                                       f"a 2-D array [N, T_max] of per-token slots")
        if ssm_state_indices.shape[0] != N:
            raise KDAInvalidValueError(f"{fn}: argument 'ssm_state_indices': expected N = {N} rows (one per "
                                       f"sequence), got {ssm_state_indices.shape[0]}")
        if nd == 2 and ssm_state_indices.shape[1] < 1:
            raise KDAInvalidValueError(f"{fn}: argument 'ssm_state_indices': a 2-D array needs T_max >= 1 "
                                       f"columns")
        if initial_state is None:
            raise KDAInvalidValueError(f"{fn}: argument 'ssm_state_indices' needs initial_state, the state pool")
        if output_final_state and not inplace_final_state:
            raise KDANotSupportedError(f"{fn}: output_final_state=True with ssm_state_indices but without "
                                       f"inplace_final_state=True is not implemented by kda (pass "
                                       f"inplace_final_state=True to update the pool)")
    if num_accepted_tokens is not None:
        if not pool or getattr(ssm_state_indices, "ndim", None) != 2:
            raise KDAInvalidValueError(f"{fn}: argument 'num_accepted_tokens': needs a 2-D ssm_state_indices "
                                       f"[N, T_max]")
        if getattr(num_accepted_tokens, "ndim", None) != 1 or num_accepted_tokens.shape[0] != N:
            raise KDAInvalidValueError(f"{fn}: argument 'num_accepted_tokens': expected shape [N] = [{N}], got "
                                       f"{_shape(getattr(num_accepted_tokens, 'shape', ()))}")
    if initial_state is not None:
        if not _is_state_dtype(initial_state, kind):
            raise KDANotSupportedError(f"{fn}: argument 'initial_state': dtype {initial_state.dtype} is not "
                                       f"implemented; use float32 (or bfloat16)")
        _check_state(fn, "initial_state", initial_state, N, HV, K, V, state_v_first, pool=pool)
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            # FLA would use exp(1) in place of exp(A_log) here, an accident rather than a gate: refuse.
            raise KDAInvalidValueError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True` and "
                                       f"`lower_bound` is not set.")
        _check_gate_params(fn, A_log, dt_bias, HV, K)
        if lower_bound is not None:
            lower_bound = float(lower_bound)
            if lower_bound == 0.0 and not safe_gate:  # as in chunk_kda: FLA's gate is then 0 (no decay)
                g, A_log, dt_bias, lower_bound, use_gate_in_kernel = _zeros_like(g), None, None, None, False
    else:
        A_log = dt_bias = lower_bound = None
    scale = K ** -0.5 if scale is None else float(scale)
    ht_mode = 2 if inplace_final_state else (1 if output_final_state else 0)

    if kind == "numpy":
        return _np_call(fn, True, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ssm_state_indices,
                        out, ht_mode, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
                        B, T, H, K, HV, V, N, nat=num_accepted_tokens)
    from . import _torch
    return _torch.fused_recurrent_kda(fn, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                      cu_seqlens_cpu, ssm_state_indices, out, ht_mode, scale,
                                      bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel),
                                      bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), safe_gate,
                                      lower_bound, bool(state_v_first), N, nat=num_accepted_tokens)


# ---------------------------------------------------------------------------------------------------------
# helpers on either array kind
# ---------------------------------------------------------------------------------------------------------
def _state_rows(h) -> int:
    s = getattr(h, "shape", None)
    if not s:
        raise KDAInvalidValueError(f"argument 'initial_state': expected a 4-D array, got "
                                   f"{type(h).__name__ if s is None else 'a scalar'}")
    return s[0]


def _is_state_dtype(h, kind: str) -> bool:
    if kind == "numpy":
        if not isinstance(h, _ndarray):
            raise KDATypeError(f"argument 'initial_state': expected a numpy.ndarray like q, got {type(h).__name__}")
        return h.dtype == _f32
    if not _is_torch(h):
        raise KDATypeError(f"argument 'initial_state': expected a torch.Tensor like q, got {type(h).__name__}")
    t = _torch_module()
    return h.dtype == t.float32 or h.dtype == t.bfloat16


def _zeros_like(x):
    if isinstance(x, _ndarray):
        return np.zeros_like(x)
    return _torch_module().zeros_like(x)


# ---------------------------------------------------------------------------------------------------------
# numpy: the CPU backend, synchronously
# ---------------------------------------------------------------------------------------------------------
def _np_float(fn: str, name: str, x):
    code = _NP_FLOAT.get(x.dtype)
    if code is None:
        raise KDANotSupportedError(f"{fn}: argument '{name}': numpy dtype {x.dtype} is not supported; use float32 "
                                   f"or float16 (bfloat16 through torch tensors)")
    return code


def _np_same(fn: str, name: str, x, like):
    if not isinstance(x, _ndarray):
        raise KDATypeError(f"{fn}: argument '{name}': expected a numpy.ndarray like q, got {type(x).__name__}")
    if x.dtype != like.dtype:
        raise KDANotSupportedError(f"{fn}: argument '{name}': dtype {x.dtype} differs from q's {like.dtype}; "
                                   f"q, k and v must share one dtype")
    return np.ascontiguousarray(x)


def _np_input(fn: str, name: str, x):
    if not isinstance(x, _ndarray):
        raise KDATypeError(f"{fn}: argument '{name}': expected a numpy.ndarray like q, got {type(x).__name__}")
    return np.ascontiguousarray(x), _np_float(fn, name, x)


def _np_f32(fn: str, name: str, x):
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    elif not isinstance(x, _ndarray):
        raise KDATypeError(f"{fn}: argument '{name}': expected a numpy.ndarray like q, got {type(x).__name__}")
    return np.ascontiguousarray(x, dtype=_f32)


def _np_cu_seqlens(fn: str, cu):
    if _is_torch(cu):
        if cu.device.type != "cpu":
            raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens': on {cu.device} while the inputs are numpy "
                                       f"arrays (host memory)")
        cu = cu.numpy()
    elif not isinstance(cu, _ndarray):
        cu = np.asarray(cu)
    code = _NP_INT.get(cu.dtype)
    if code is None:
        if cu.dtype.kind not in "iu":
            raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens': expected int32 or int64 offsets, got "
                                       f"{cu.dtype}")
        cu, code = cu.astype(np.int64), INT64
    return np.ascontiguousarray(cu), code


def _np_indices(fn: str, idx, name: str = "ssm_state_indices"):
    if _is_torch(idx):
        if idx.device.type != "cpu":
            raise KDAInvalidValueError(f"{fn}: argument '{name}': on {idx.device} while the inputs "
                                       f"are numpy arrays (host memory)")
        idx = idx.numpy()
    elif not isinstance(idx, _ndarray):
        idx = np.asarray(idx)
    if idx.dtype != _i32:
        if idx.dtype.kind not in "iu":
            raise KDAInvalidValueError(f"{fn}: argument '{name}': expected integers, got {idx.dtype}")
        if idx.size and (idx.max() > 2**31 - 1 or idx.min() < -2**31):
            raise KDAInvalidValueError(f"{fn}: argument '{name}': a value does not fit in int32")
        idx = idx.astype(_i32)
    return np.ascontiguousarray(idx)


def _np_writable(fn: str, name: str, x):
    if not isinstance(x, _ndarray):
        raise KDATypeError(f"{fn}: argument '{name}': expected a numpy.ndarray like q, got {type(x).__name__}")
    if not (x.flags.c_contiguous and x.flags.writeable):
        raise KDAInvalidValueError(f"{fn}: argument '{name}': written in place, so it must be a C-contiguous, "
                                   f"writable array")


def _np_call(fn, decode, q, k, v, g, beta, A_log, dt_bias, h0, cu, idx, out, ht_mode, scale, l2, gate, bsig, neg,
             safe, lb, vfirst, B, T, H, K, HV, V, N, nat=None, cp=-1):
    a, o, ht, keep = _np_args(fn, q, k, v, g, beta, A_log, dt_bias, h0, cu, idx, out, ht_mode, scale, l2, gate,
                              bsig, neg, safe, lb, vfirst, B, T, H, K, HV, V, N, nat)
    _lib.set_cp(a, cp)
    try:
        ctx = _lib._contexts.get(_CPU_KEY) or _lib.get_context(_lib.BACKEND_CPU, 0)
        _lib.run(ctx, a, decode)
    except KDAError as e:
        raise in_callers_terms(e, fn) from None
    if scale == 0.0:  # FLA: o = 0 * S^T q; libkda reads scale 0 as "default"
        o[...] = 0
    return o, ht


def _np_args(fn, q, k, v, g, beta, A_log, dt_bias, h0, cu, idx, out, ht_mode, scale, l2, gate, bsig, neg, safe, lb,
             vfirst, B, T, H, K, HV, V, N, nat=None):
    """The kda_args_t of numpy arrays, the outputs it points to (o, ht), and the arrays it points into (keep them
    alive while it is used): (args, o, ht, (q, k, v, g, beta, h0, cu, idx, A_log, dt_bias, nat))."""
    L = _lib._lib or _lib.library()
    ptr = _data_ptr
    a = KdaArgs.from_buffer_copy(L.template)
    q, code = _np_input(fn, "q", q)
    k = _np_same(fn, "k", k, q)
    v = _np_same(fn, "v", v, q)
    g, a.g_dtype = _np_input(fn, "g", g)
    beta, a.beta_dtype = _np_input(fn, "beta", beta)
    a.batch = B
    a.seq_len = T
    a.num_qk_heads = H
    a.num_v_heads = HV
    a.head_dim_k = K
    a.head_dim_v = V
    a.dtype = code
    a.q = ptr(q)
    a.k = ptr(k)
    a.v = ptr(v)
    a.g = ptr(g)
    a.beta = ptr(beta)
    if out is None:
        o = np.empty(v.shape, q.dtype)
        a.o_dtype = code
    else:
        _np_writable(fn, "out", out)
        o = out
        a.o_dtype = _np_float(fn, "out", out)
    a.o = ptr(o)
    if cu is not None:
        cu, a.cu_seqlens_dtype = _np_cu_seqlens(fn, cu)
        a.cu_seqlens = ptr(cu)
        a.num_seqs = N
    ht = None
    if h0 is not None:
        if ht_mode == 2:
            _np_writable(fn, "initial_state", h0)
            ht = h0
            a.final_state = ptr(h0)
        else:
            h0 = np.ascontiguousarray(h0)
        a.initial_state = ptr(h0)  # float32 (checked); dtype fields default to FLOAT32
    if ht_mode == 1:
        ht = np.empty((N, HV, V, K) if vfirst else (N, HV, K, V), _f32)
        a.final_state = ptr(ht)
    if idx is not None:
        idx = _np_indices(fn, idx)
        a.state_indices = ptr(idx)
        a.num_state_slots = h0.shape[0]
        if idx.ndim == 2:
            a.state_indices_cols = idx.shape[1]
        if nat is not None:
            nat = _np_indices(fn, nat, "num_accepted_tokens")
            a.num_accepted_tokens = ptr(nat)
    if beta.ndim == 4:
        a.beta_headwise = 1
    if vfirst:
        a.state_v_first = 1
    if gate:
        a.use_gate_in_kernel = 1
        if A_log is not None:
            A_log = _np_f32(fn, "A_log", A_log)
            a.A_log = ptr(A_log)
        if dt_bias is not None:
            dt_bias = _np_f32(fn, "dt_bias", dt_bias)
            a.dt_bias = ptr(dt_bias)
        if lb is not None:
            a.lower_bound = lb
    a.scale = scale if scale != 0.0 else 1.0
    if l2:
        a.use_qk_l2norm = 1
    if safe:
        a.safe_gate = 1
    if bsig:
        a.use_beta_sigmoid = 1
    if neg:
        a.allow_neg_eigval = 1
    return a, o, ht, (q, k, v, g, beta, h0, cu, idx, A_log, dt_bias, nat)
