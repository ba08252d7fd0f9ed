"""FLA's entry points: FLA's checks in FLA's order and exception types, then ours, into one KdaOptions; numpy
arrays run on the CPU backend here, torch tensors go to kda._torch (imported on first use)."""

from __future__ import annotations

import math
import operator
import sys
import warnings

from . import _lib
from ._errors import (ARGUMENT_OF_FIELD, KDAAssertionError, KDAError, KDAInvalidValueError, KDANotSupportedError,
                      KDATypeError, in_callers_terms)
from ._lib import FLOAT16, FLOAT32, INT32, INT64, KdaOptions, build_args, build_backward_args

try:  # numpy is needed for numpy inputs only
    import numpy as np
    _ndarray, _f32, _i32, _i64 = np.ndarray, np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64)
    _NP_CODES = {_f32: FLOAT32, np.dtype(np.float16): FLOAT16, _i32: INT32, _i64: INT64}
except ImportError:  # pragma: no cover
    np, _ndarray, _NP_CODES = None, (), {}
_torch_chunk_cached = None  # kda._torch.chunk_kda_cached once kda._torch is imported: chunk_kda's fast path
_np_ptr = operator.attrgetter("ctypes.data")
# float32 rounds to infinity from (2 - 2**-24) * 2**127 up, and to 0 up to 2**-150 (half its smallest subnormal)
_F32_INF, _F32_ZERO = 2.0 ** 128 * (1 - 2.0 ** -25), 2.0 ** -150
# Keywords: what each entry point reads from **kwargs (as FLA does), with their defaults; any other keyword is a
# TypeError, as a Python function without **kwargs would raise (FLA would ignore it: a typo changes the result).
_KWARGS = {
    "chunk_kda": dict(A_log=None, dt_bias=None, chunk_size=64, transpose_state_layout=None, cp_piece_len=None),
    "fused_recurrent_kda": dict(transpose_state_layout=None, ssm_state_indices=None, inplace_final_state=False,
                                out=None, safe_gate=False, cu_seqlens_cpu=None, num_accepted_tokens=None),
}


def _shape(s) -> str:
    return "[" + ", ".join(str(int(d)) for d in s) + "]"


def _bad(fn: str, name: str, what: str, cls=KDAInvalidValueError):
    return cls(f"{fn}: argument '{name}': {what}")


def _is_torch(x) -> bool:
    t = sys.modules.get("torch")  # torch, if the caller has imported it (we never import it for them)
    return t is not None and isinstance(x, t.Tensor)


def _kind(fn: str, q) -> str:
    if not (isinstance(q, _ndarray) or _is_torch(q)):
        raise _bad(fn, "q", f"expected a torch.Tensor or a numpy.ndarray, got {type(q).__name__}", KDATypeError)
    return "numpy" if isinstance(q, _ndarray) else "torch"


def _check_ndim(fn: str, q, k, v, g, beta, fused: bool) -> None:
    for name, x, want in (("q", q, "[B, T, H, K]"), ("k", k, "[B, T, H, K]"), ("v", v, "[B, T, HV, V]"),
                          ("g", g, "[B, T, HV, K]"), ("beta", beta, "")):
        if getattr(x, "ndim", None) is None:
            raise _bad(fn, name, f"expected an array like q, got {type(x).__name__}", KDATypeError)
        if x.ndim != 4 and want:
            raise _bad(fn, name, f"expected shape {want}, got {_shape(x.shape)}")
    if fused and beta.ndim == 4 and tuple(beta.shape) != tuple(v.shape):  # headwise: one beta per value channel
        raise _bad(fn, "beta", f"a headwise beta must have v's shape {_shape(v.shape)}, got {_shape(beta.shape)}")
    elif beta.ndim not in (3, 4):  # chunk_kda's 4-D beta: FLA's own assert (_check_shapes) names its shape
        raise _bad(fn, "beta", f"expected shape [B, T, HV], got {_shape(beta.shape)}")


def _check_shapes(fn: str, q, k, v, g, beta, err, headwise_ok: bool = False) -> tuple:
    """FLA's shape checks (raising `err`, KDAAssertionError where FLA asserts), then ours. Returns the sizes."""
    (B, T, H, K), (HV, V) = q.shape, v.shape[2:]
    if k.shape != q.shape:
        raise err(f"{fn}: q and k must have the same shape, got q={_shape(q.shape)} and k={_shape(k.shape)} "
                  f"(argument 'k')")
    if K > 256:
        raise _bad(fn, "q", f"key head size K = {K} is above 256, the largest supported", err)
    if H < 1:
        raise _bad(fn, "q", f"H = {H}: there must be at least one query/key head")
    if HV % H != 0:
        raise _bad(fn, "v", f"for GVA the number of value heads HV = {HV} must be a multiple of the number of "
                            f"query/key heads H = {H}", err)
    if g.shape != (B, T, HV, K):
        raise _bad(fn, "g", f"expected shape [B, T, HV, K] = {_shape((B, T, HV, K))}, got {_shape(g.shape)}", err)
    if beta.shape != (B, T, HV) and not (headwise_ok and tuple(beta.shape) == (B, T, HV, V)):
        raise _bad(fn, "beta", f"expected shape [B, T, HV] = {_shape((B, T, HV))}, got {_shape(beta.shape)}", err)
    if v.shape[0] != B or v.shape[1] != T:
        raise _bad(fn, "v", f"expected shape [B, T, HV, V] with B, T = {B}, {T} (from q), got {_shape(v.shape)}")
    if K < 1 or V < 1 or HV < 1:
        raise _bad(fn, "q' / 'v", f"head sizes must be at least 1, got K = {K}, V = {V}, HV = {HV}")
    if V > 256:
        raise _bad(fn, "v", f"value head size V = {V} is above 256, the largest libkda implements",
                   KDANotSupportedError)
    return B, T, H, K, HV, V


def _num_seqs(fn: str, q, cu_seqlens, h0, pool: bool = False) -> int:
    """N, after FLA's checks of cu_seqlens: B = 1, and one initial state per sequence (a pool: any number)."""
    if cu_seqlens is None:
        return q.shape[0]
    if q.shape[0] != 1:
        raise KDAInvalidValueError(f"{fn}: the batch size is expected to be 1 rather than {q.shape[0]} when using "
                                   f"`cu_seqlens`; flatten variable-length inputs first (argument 'q')")
    shape = getattr(cu_seqlens, "shape", None)
    if shape is None:
        if not hasattr(cu_seqlens, "__len__"):
            raise _bad(fn, "cu_seqlens", f"expected N + 1 offsets, got {type(cu_seqlens).__name__}", KDATypeError)
        shape = (len(cu_seqlens),)
    if len(shape) != 1:
        raise _bad(fn, "cu_seqlens", f"expected a 1-D array of N + 1 offsets, got shape {_shape(shape)}")
    if shape[0] == 0:
        raise _bad(fn, "cu_seqlens", "is empty; expected the N + 1 offsets 0, ..., T of N sequences (2 or more "
                                     "entries for T > 0)")
    N, s = shape[0] - 1, getattr(h0, "shape", None)
    if h0 is not None and not pool and not s:
        raise _bad(fn, "initial_state", f"expected a 4-D array, got {type(h0).__name__ if s is None else 'a scalar'}")
    if h0 is not None and not pool and s[0] != N:
        raise KDAInvalidValueError(f"{fn}: the number of initial states is expected to equal the number of input "
                                   f"sequences, i.e. {N} rather than {s[0]} (argument 'initial_state')")
    return N


def _check_state(fn: str, name: str, h, N: int, HV: int, K: int, V: int, state_v_first: bool, pool: bool = False):
    if getattr(h, "ndim", None) != 4:
        raise _bad(fn, name, f"expected a 4-D state, got "
                             f"{_shape(h.shape) if hasattr(h, 'shape') else type(h).__name__}")
    s, tail = h.shape, ((HV, V, K) if state_v_first else (HV, K, V))
    if tuple(s[1:]) != tail or (not pool and s[0] != N):
        names = "[%s, HV, %s]" % ("num_slots" if pool else "N", "V, K" if state_v_first else "K, V")
        raise _bad(fn, name, f"expected shape {names} = {_shape(((s[0] if pool else N),) + tail)}, got {_shape(s)}")
    if pool and s[0] < 1:
        raise _bad(fn, name, "a state pool needs at least one slot")


def _is_state_dtype(fn: str, name: str, h, kind: str) -> bool:
    if not (isinstance(h, _ndarray) if kind == "numpy" else _is_torch(h)):
        raise _bad(fn, name, f"expected a {'numpy.ndarray' if kind == 'numpy' else 'torch.Tensor'} like q, "
                             f"got {type(h).__name__}", KDATypeError)
    return str(h.dtype) in (("float32",) if kind == "numpy" else ("torch.float32", "torch.bfloat16"))


def _check_slots(fn: str, idx, nat, N: int) -> None:
    nd = getattr(idx, "ndim", None)
    if idx is not None:
        if nd not in (1, 2):
            raise _bad(fn, "ssm_state_indices", "expected a 1-D array of N slots or a 2-D array [N, T_max] of "
                                                "per-token slots")
        if idx.shape[0] != N:
            raise _bad(fn, "ssm_state_indices", f"expected N = {N} rows (one per sequence), got {idx.shape[0]}")
        if nd == 2 and idx.shape[1] < 1:
            raise _bad(fn, "ssm_state_indices", "a 2-D array needs T_max >= 1 columns")
    if nat is not None:
        if nd != 2:
            raise _bad(fn, "num_accepted_tokens", "needs a 2-D ssm_state_indices [N, T_max]")
        if getattr(nat, "ndim", None) != 1 or nat.shape[0] != N:
            raise _bad(fn, "num_accepted_tokens", f"expected shape [N] = [{N}], got "
                                                  f"{_shape(getattr(nat, 'shape', ()))}")


def _check_neg(fn: str, allow_neg_eigval, use_beta_sigmoid_in_kernel) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise KDAInvalidValueError(f"{fn}: `allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")


def _check_a_log(fn: str, gate, A_log, lower_bound) -> None:
    if gate and A_log is None and lower_bound is None:
        # FLA would use exp(1) in place of exp(A_log) here, an accident rather than a gate: refuse.
        raise KDAInvalidValueError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True` and "
                                   f"`lower_bound` is not set.")


def _float32(fn: str, name: str, x) -> float:
    """x as kda_args_t's float: its float32 rounding finite, and nonzero unless x is 0 (libkda reads 0 as unset)."""
    if isinstance(x, (str, bytes)) or not hasattr(type(x), "__float__"):
        raise _bad(fn, name, f"expected a real number, got {type(x).__name__} {x!r}", KDATypeError)
    try:
        f = float(x)
    except (TypeError, ValueError) as e:
        raise _bad(fn, name, f"expected a real number, got {type(x).__name__} ({e})", KDATypeError) from None
    if not abs(f) < _F32_INF:
        raise _bad(fn, name, f"{f!r} is not a finite float32")
    if 0.0 < abs(f) <= _F32_ZERO:
        raise _bad(fn, name, f"{f!r} rounds to 0 in float32, which libkda reads as unset; pass 0 itself or a value "
                             f"of at least 1.4e-45 in magnitude")
    return f


def _options(fn: str, g, A_log, dt_bias, HV: int, K: int, scale, gate, lower_bound, safe_gate, l2, bsig, neg, v_first,
             cp: int = -1):
    """The call's KdaOptions after the gate's checks: (g, A_log, dt_bias, options); no gate: no A_log, dt_bias."""
    lb = 0.0
    if gate:
        _check_a_log(fn, gate, A_log, lower_bound)
        for name, x, n, what in (("A_log", A_log, HV, "[HV]"), ("dt_bias", dt_bias, HV * K, "[HV * K]")):
            if x is not None and math.prod(x.shape) != n:
                raise _bad(fn, name, f"expected {what} = {n} values, got shape {_shape(x.shape)}")
        if lower_bound is not None:
            lb = _float32(fn, "lower_bound", lower_bound)
            if lb == 0.0 and not safe_gate:
                # FLA's gate is then 0 * sigmoid(...) = 0 for every token: no decay (and no gradient to g, A_log,
                # dt_bias). libkda reads 0 as "unset", so that gate is computed here.
                zeros_like = np.zeros_like if isinstance(g, _ndarray) else sys.modules["torch"].zeros_like
                g, A_log, dt_bias, gate = zeros_like(g), None, None, False
    if not gate:
        A_log = dt_bias = None
    s = K ** -0.5 if scale is None else _float32(fn, "scale", scale)
    return g, A_log, dt_bias, KdaOptions(s, *map(bool, (l2, gate, bsig, neg, safe_gate)), lb, bool(v_first), cp)


def _keywords(fn: str, kwargs: dict, state_v_first: bool):
    unknown = [name for name in kwargs if name not in _KWARGS[fn]]
    if unknown:  # worded as Python's own TypeError, with a likely intended name
        import difflib
        import inspect
        known = [p for p in inspect.signature(globals()[fn]).parameters if p != "kwargs"] + list(_KWARGS[fn])
        other = "fused_recurrent_kda" if fn == "chunk_kda" else "chunk_kda"
        notes = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            if close:
                notes.append(f"'{name}': did you mean '{close[0]}'?")
            elif name in _KWARGS[other] or name in inspect.signature(globals()[other]).parameters:
                notes.append(f"'{name}' is a keyword of {other}")
        what = "unexpected keyword arguments" if len(unknown) > 1 else "an unexpected keyword argument"
        raise KDATypeError(f"{fn}() got {what} {', '.join(map(repr, unknown))}" +
                           (f" ({'; '.join(notes)})" if notes else ""))
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise KDAInvalidValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated; use `state_v_first`.", DeprecationWarning, stacklevel=3)
        state_v_first = kwargs["transpose_state_layout"]
    return {**_KWARGS[fn], **kwargs}, state_v_first


def _cp_piece_len(fn: str, x) -> int:
    if x is None:
        return -1
    if isinstance(x, bool) or not hasattr(x, "__index__"):
        raise KDATypeError(f"{fn}: `cp_piece_len` must be None, 0 or a whole number of tokens, got "
                           f"{type(x).__name__} {x!r}")
    n, m, top = operator.index(x), _lib.CP_PIECE_MULTIPLE, _lib.CP_MAX_PIECE_LEN
    why = (f"None (libkda decides), 0 (no split) or a positive multiple of {m}" if n < 0 else
           f"a multiple of the chunk, {m} tokens" if n % m else f"at most {top} tokens" if n > top else None)
    if why is None:
        return n
    raise KDAInvalidValueError(f"{fn}: `cp_piece_len` must be {why}, got {n}")


def chunk_kda(q, k, v, g, beta, scale: float | None = None, initial_state=None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, safe_gate: bool = False,
              lower_bound: float | None = None, disable_recompute: bool = False,
              return_intermediate_states: bool = False, state_v_first: bool = False, cu_seqlens=None,
              cu_seqlens_cpu=None, cp_context=None, use_graph: bool = False, max_num_seqs: int | None = None,
              **kwargs):
    """A drop-in for ``fla.ops.kda.chunk_kda`` on torch tensors or numpy arrays (docs/API.md, "Python")."""
    remember = None
    if _torch_chunk_cached is not None:
        r, remember = _torch_chunk_cached(
            (q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu), kwargs,
            (scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, safe_gate, lower_bound, return_intermediate_states, state_v_first, cp_context,
             use_graph, max_num_seqs))
        if r is not None:
            return r
    fn = "chunk_kda"
    kw, state_v_first = _keywords(fn, kwargs, state_v_first)
    A_log, dt_bias, chunk_size, cp = kw["A_log"], kw["dt_bias"], kw["chunk_size"], _cp_piece_len(fn, kw["cp_piece_len"])
    kind = _kind(fn, q)
    if cp_context is not None:  # context parallelism across ranks: the call runs with the context's offsets
        if kind == "numpy":
            raise _bad(fn, "cp_context", "needs torch tensors (torch.distributed)", KDANotSupportedError)
        from . import _cp
        cu_seqlens, cu_seqlens_cpu = _cp.local_offsets(fn, cp_context, cu_seqlens, cu_seqlens_cpu, q)
    if return_intermediate_states:  # FLA's two conditions, in FLA's words
        if kind == "numpy":
            raise KDANotSupportedError(f"{fn}: return_intermediate_states=True needs torch tensors (inference mode)")
        if not sys.modules["torch"].is_inference_mode_enabled():
            raise KDAAssertionError(f"{fn}: return_intermediate_states is only allowed in inference mode")
        if disable_recompute:
            raise KDAAssertionError(f"{fn}: return_intermediate_states must be used with disable_recompute=False")
    _check_ndim(fn, q, k, v, g, beta, fused=False)
    # FLA's checks, in FLA's order
    N = _num_seqs(fn, q, cu_seqlens, initial_state)
    if initial_state is not None and not _is_state_dtype(fn, "initial_state", initial_state, kind):
        raise _bad(fn, "initial_state", f"must be float32 (or bfloat16), got {initial_state.dtype}", KDAAssertionError)
    _check_a_log(fn, use_gate_in_kernel, A_log, lower_bound)
    if chunk_size not in (32, 64):
        raise KDAInvalidValueError(f"{fn}: `chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise KDAInvalidValueError(f"{fn}: `lower_bound` must be set when `safe_gate=True` and "
                                       f"`use_gate_in_kernel=True`.")
        if not (-5 <= _float32(fn, "lower_bound", lower_bound) < 0):
            raise KDAInvalidValueError(f"{fn}: `lower_bound` must lie in the safe range [-5, 0), got {lower_bound}.")
    _check_neg(fn, allow_neg_eigval, use_beta_sigmoid_in_kernel)
    B, T, H, K, HV, V = _check_shapes(fn, q, k, v, g, beta, KDAAssertionError)
    if use_graph and cu_seqlens is not None and max_num_seqs is not None and N != max_num_seqs:
        raise KDAAssertionError(f"{fn}: with use_graph, cu_seqlens must be padded with empty tail sequences to "
                                f"exactly max_num_seqs + 1 entries, got {N} sequences with max_num_seqs={max_num_seqs}")
    # ours
    if initial_state is not None:
        _check_state(fn, "initial_state", initial_state, N, HV, K, V, state_v_first)
    g, A_log, dt_bias, opts = _options(fn, g, A_log, dt_bias, HV, K, scale, use_gate_in_kernel, lower_bound, safe_gate,
                                       use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                       state_v_first, cp=cp)
    if kind == "numpy":
        return _np_forward(fn, "forward", opts, q, k, v, g, beta, N, ht_mode=int(bool(output_final_state)),
                           initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
    from . import _torch
    xcp = None if cp_context is None else _cp.split(fn, cp_context)
    return _torch.chunk_kda(fn, opts, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                            bool(output_final_state), remember, bool(return_intermediate_states), xcp)


def chunk_kda_backward(q, k, v, g, beta, do, dht=None, *, scale: float | None = None, initial_state=None,
                       use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                       use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                       safe_gate: bool = False, lower_bound: float | None = None, state_v_first: bool = False,
                       cu_seqlens=None, A_log=None, dt_bias=None):
    """chunk_kda's gradients on numpy arrays (docs/API.md, "Python")."""
    fn = "chunk_kda_backward"
    if _kind(fn, q) != "numpy":
        raise _bad(fn, "q", "numpy arrays only; with torch tensors chunk_kda is differentiable (call .backward() on "
                            "its outputs)", KDATypeError)
    _check_ndim(fn, q, k, v, g, beta, fused=False)
    B, T, H, K, HV, V = _check_shapes(fn, q, k, v, g, beta, KDAAssertionError)
    N = _num_seqs(fn, q, cu_seqlens, None)
    for name, h in (("initial_state", initial_state), ("dht", dht)):
        if h is not None:
            if not _is_state_dtype(fn, name, h, "numpy"):
                raise _bad(fn, name, f"must be float32, got {h.dtype}", KDAAssertionError)
            _check_state(fn, name, h, N, HV, K, V, state_v_first)
    if not isinstance(do, _ndarray) or tuple(do.shape) != tuple(v.shape):
        got = list(do.shape) if isinstance(do, _ndarray) else type(do).__name__
        raise _bad(fn, "do", f"expected a numpy array of v's shape {list(v.shape)}, got {got}")
    _check_neg(fn, allow_neg_eigval, use_beta_sigmoid_in_kernel)
    g, A_log, dt_bias, opts = _options(fn, g, A_log, dt_bias, HV, K, scale, use_gate_in_kernel, lower_bound, safe_gate,
                                       use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                       state_v_first)
    x = _np_convert(fn, q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, A_log=A_log,
                    dt_bias=dt_bias)
    do = np.zeros_like(do) if opts.scale == 0.0 else np.ascontiguousarray(do)  # FLA: o = 0 * S^T q
    dht = None if dht is None else np.ascontiguousarray(dht)
    a = build_args(opts, fn, _np_ptr, _np_code, o=do, **x)  # `do` stands in for o, which is not read
    grads = [None if x.get(name) is None else np.empty_like(x[name])  # float32 for the last three
             for name in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")]
    _np_run(fn, "backward", build_backward_args(a, fn, _np_ptr, _np_code, do, dht, grads))
    return tuple(grads)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale: float | None = None, initial_state=None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, lower_bound: float | None = None,
                        state_v_first: bool = False, cu_seqlens=None, **kwargs):
    """A drop-in for ``fla.ops.kda.fused_recurrent_kda``, vLLM's state pools included (docs/API.md, "Python")."""
    fn = "fused_recurrent_kda"
    kw, state_v_first = _keywords(fn, kwargs, state_v_first)
    idx, nat, out = kw["ssm_state_indices"], kw["num_accepted_tokens"], kw["out"]
    inplace, safe_gate = bool(kw["inplace_final_state"]), bool(kw["safe_gate"])
    kind = _kind(fn, q)
    _check_ndim(fn, q, k, v, g, beta, fused=True)
    pool = idx is not None
    # FLA's checks, in FLA's order
    N = _num_seqs(fn, q, cu_seqlens, initial_state, pool)
    _check_neg(fn, allow_neg_eigval, use_beta_sigmoid_in_kernel)
    if out is not None and tuple(getattr(out, "shape", ())) != tuple(v.shape):
        raise _bad(fn, "out", f"expected v's shape {_shape(v.shape)}, got "
                   f"{_shape(out.shape) if hasattr(out, 'shape') else type(out).__name__}", KDAAssertionError)
    if inplace and initial_state is None:
        raise KDAAssertionError(f"{fn}: inplace_final_state=True requires initial_state (argument 'initial_state')")
    # ours
    B, T, H, K, HV, V = _check_shapes(fn, q, k, v, g, beta, KDAInvalidValueError, headwise_ok=True)
    _check_slots(fn, idx, nat, N)
    if pool and initial_state is None:
        raise KDAInvalidValueError(f"{fn}: argument 'ssm_state_indices' needs initial_state, the state pool")
    if pool and output_final_state and not inplace:
        raise KDANotSupportedError(f"{fn}: output_final_state=True with ssm_state_indices but without "
                                   f"inplace_final_state=True is not implemented by kda (pass "
                                   f"inplace_final_state=True to update the pool)")
    if initial_state is not None:
        if not _is_state_dtype(fn, "initial_state", initial_state, kind):
            raise _bad(fn, "initial_state", f"dtype {initial_state.dtype} is not implemented; use float32 (or "
                                            f"bfloat16)", KDANotSupportedError)
        _check_state(fn, "initial_state", initial_state, N, HV, K, V, state_v_first, pool=pool)
    g, A_log, dt_bias, opts = _options(fn, g, A_log, dt_bias, HV, K, scale, use_gate_in_kernel, lower_bound, safe_gate,
                                       use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                       state_v_first)
    ht_mode = 2 if inplace else (1 if output_final_state else 0)
    if kind == "numpy":
        return _np_forward(fn, "decode", opts, q, k, v, g, beta, N, out, ht_mode, initial_state=initial_state,
                           cu_seqlens=cu_seqlens, state_indices=idx, num_accepted_tokens=nat, A_log=A_log,
                           dt_bias=dt_bias)
    from . import _torch
    return _torch.fused_recurrent_kda(fn, opts, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                      kw["cu_seqlens_cpu"], idx, nat, out, ht_mode)


# numpy: the CPU backend, synchronously
def host_ints(fn: str, name: str, x, dtypes: tuple):
    """x as a C-contiguous numpy array of one of `dtypes` (another integer dtype: the last, if every value fits)."""
    if _is_torch(x):
        if x.device.type != "cpu":
            raise _bad(fn, name, f"on {x.device} while the inputs are numpy arrays (host memory)")
        x = x.numpy()
    elif not isinstance(x, _ndarray):
        x = np.asarray(x)
    if x.dtype not in dtypes:
        if x.dtype.kind not in "iu":
            raise _bad(fn, name, f"expected integers ({' or '.join(map(str, dtypes))}), got {x.dtype}")
        info = np.iinfo(dtypes[-1])
        lo, hi = (int(x.min()), int(x.max())) if x.size else (0, 0)  # Python ints: exact for every dtype
        if hi > info.max or lo < info.min:
            raise _bad(fn, name, f"the value {hi if hi > info.max else lo} does not fit in {dtypes[-1]}")
        x = x.astype(dtypes[-1])
    return np.ascontiguousarray(x)


def _np_code(fn: str, field: str, x) -> int:
    code = _NP_CODES.get(x.dtype)
    if code is None or (code in (INT32, INT64)) != (field == "cu_seqlens"):
        raise _bad(fn, ARGUMENT_OF_FIELD.get(field, field), f"numpy dtype {x.dtype} is not supported; use float32 or "
                   f"float16 (bfloat16 through torch tensors)", KDANotSupportedError)
    return code


def _np_array(fn: str, name: str, x, like=None, writable: bool = False, dtype=None):
    if _is_torch(x) and dtype is not None:  # A_log, dt_bias: a parameter of a torch model
        x = x.detach().cpu().numpy()
    elif not isinstance(x, _ndarray):
        raise _bad(fn, name, f"expected a numpy.ndarray like q, got {type(x).__name__}", KDATypeError)
    if like is not None and x.dtype != like.dtype:
        raise _bad(fn, name, f"dtype {x.dtype} differs from q's {like.dtype}; q, k and v must share one dtype",
                   KDANotSupportedError)
    if writable and not (x.flags.c_contiguous and x.flags.writeable):
        raise _bad(fn, name, "written in place, so it must be a C-contiguous, writable array")
    return np.ascontiguousarray(x, dtype=dtype)


def _np_convert(fn: str, q, k, v, g, beta, **optional) -> dict:
    q = _np_array(fn, "q", q)
    x = dict(q=q, k=_np_array(fn, "k", k, q), v=_np_array(fn, "v", v, q), g=_np_array(fn, "g", g),
             beta=_np_array(fn, "beta", beta))
    for field, a in optional.items():
        name = ARGUMENT_OF_FIELD.get(field, field)  # as the caller knows it
        if field in ("initial_state", "A_log", "dt_bias") and a is not None:
            x[field] = _np_array(fn, name, a, dtype=None if field == "initial_state" else _f32)
        elif a is not None:  # cu_seqlens, state_indices, num_accepted_tokens
            x[field] = host_ints(fn, name, a, (_i32, _i64) if field == "cu_seqlens" else (_i32,))
    return x


def _np_run(fn: str, entry: str, args) -> None:
    try:
        _lib.get_context(*_lib.CPU_CONTEXT).run(entry, args)
    except KDAError as e:
        raise in_callers_terms(e, fn) from None


def _np_forward(fn: str, entry: str, opts: KdaOptions, q, k, v, g, beta, N: int, out=None, ht_mode: int = 0,
                **optional):
    """kda_forward or kda_decode of numpy arrays: (o, ht). ht_mode: 0 none, 1 a new one, 2 initial_state in place."""
    if out is not None:
        _np_array(fn, "out", out, writable=True)
    if ht_mode == 2:
        _np_array(fn, "initial_state", optional["initial_state"], writable=True)
    x = _np_convert(fn, q, k, v, g, beta, **optional)
    o = np.empty(x["v"].shape, x["q"].dtype) if out is None else out
    ht = optional["initial_state"] if ht_mode == 2 else None  # the caller's array, checked C-contiguous
    if ht_mode == 1:
        K, HV, V = q.shape[3], v.shape[2], v.shape[3]
        ht = np.empty((N, HV, V, K) if opts.state_v_first else (N, HV, K, V), _f32)
    _np_run(fn, entry, build_args(opts, fn, _np_ptr, _np_code, o=o, final_state=ht, **x))
    if opts.scale == 0.0:  # FLA: o = 0 * S^T q (build_args runs it with scale 1)
        o[...] = 0
    return o, ht
