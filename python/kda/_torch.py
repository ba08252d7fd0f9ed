"""torch integration: the custom ops that run libkda on torch tensors.

Imported only when a torch tensor reaches chunk_kda / fused_recurrent_kda (``import kda`` never imports torch).

Ops (namespace ``kda``), each with a fake (meta) implementation so that torch.compile can trace them and CUDA
graph capture can record them (libkda never synchronises with the host; workspace comes from torch's caching
allocator on the current stream):

* ``kda::chunk_kda_fwd``            functional: (o, final_state); autograd registered: its backward runs
  ``kda::chunk_kda_bwd``.
* ``kda::chunk_kda_bwd``            libkda's kda_backward: (dq, dk, dv, dg, dbeta, d_initial_state, dA_log,
  ddt_bias), the last three empty when not requested.
* ``kda::fused_recurrent_kda_fwd``  functional: (o, final_state); autograd registered (backward raises).
* ``kda::fused_recurrent_kda_out``  mutates ``o`` and ``final_state`` (the preallocated output and, for vLLM's
  in-place decode, the state pool); returns nothing.
* ``kda::backward_not_implemented`` what the backward of fused_recurrent_kda_fwd calls: it raises
  KDANotSupportedError when it runs (its fake returns gradients' shapes, so that a compiled graph with a
  backward still builds and the error comes when the backward actually runs). Gradients are never made up.

A final state that was not requested is returned by the functional ops as an empty float32 tensor (custom ops
cannot return None) and mapped to None by the Python entry points.

Eager calls on plain tensors skip the ops' dispatch (its host time is more than a small call's GPU time):
without gradients the implementations are called directly; a chunk_kda that needs gradients runs through
_ChunkKDA, a torch.autograd.Function with the same forward and backward, whose CUDA forward also keeps its
chunk blocks for the backward (kda_args_t.saved: the backward then skips its preparation stage). torch.compile
and tensor subclasses go through the ops (the backward recomputes the blocks there).
"""

import ctypes
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _api, _lib
from ._errors import KDAError, KDAInvalidValueError, KDANotSupportedError, KDATypeError, in_callers_terms
from ._lib import BACKEND_CPU, BACKEND_CUDA, INT32, INT64, KdaArgs, KdaBackwardArgs

_FLOAT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_STATE = {torch.float32: 0, torch.bfloat16: 2}
_INT = {torch.int32: INT32, torch.int64: INT64}
_CPU_CONTEXT = (BACKEND_CPU, 0)

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):  # pragma: no cover
    raise KDANotSupportedError(f"kda: torch {torch.__version__} is too old; torch >= 2.4 (torch.library.custom_op) "
                               f"is required for torch tensors")

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # fast; the public spelling is the fallback
except AttributeError:  # pragma: no cover
    _raw_stream = None


# The current CUDA device: torch.cuda.current_device() without its lazy-initialisation check, for callers that hold
# CUDA tensors (torch's CUDA state is up; the workspace's allocation would start it anyway)
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


def _stream_of(index: int) -> int:
    """The current torch stream of CUDA device `index`, as a cudaStream_t value."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _code(fn: str, name: str, t: Tensor, table=_FLOAT) -> int:
    c = table.get(t.dtype)
    if c is None:
        kinds = "float32 or bfloat16" if table is _STATE else "float32, float16 or bfloat16"
        raise KDANotSupportedError(f"{fn}: argument '{name}': dtype {t.dtype} is not supported; use {kinds}")
    return c


def _check_launch(fn, q, k, v, g, beta, A_log, dt_bias, h0, ht, cu, cu_cpu, idx, o, vfirst, nat=None) -> None:
    """What libkda cannot check for itself: sizes, devices and layouts of the memory behind the pointers. The
    Python entry points have checked all this already; the ops are public too, so they check again."""
    def bad(name, what):
        raise KDAInvalidValueError(f"{fn}: argument '{name}': {what}")

    if q.dim() != 4:
        bad("q", f"expected shape [B, T, H, K], got {list(q.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[0] != B or v.shape[1] != T:
        bad("v", f"expected shape [B, T, HV, V] with B, T = {B}, {T}, got {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    N = B if cu is None else cu.shape[0] - 1
    bshape = (B, T, HV, V) if beta.dim() == 4 else (B, T, HV)  # headwise beta: one per value channel
    shapes = [("k", k, (B, T, H, K)), ("g", g, (B, T, HV, K)), ("beta", beta, bshape), ("o", o, (B, T, HV, V))]
    for name, t, want in shapes:
        if tuple(t.shape) != want:
            bad(name, f"expected shape {list(want)}, got {list(t.shape)}")
    tail = (HV, V, K) if vfirst else (HV, K, V)
    slots = None
    for name, t in (("initial_state", h0), ("final_state", ht)):
        if t is None or (name == "final_state" and t.numel() == 0):  # an empty final_state: not requested
            continue
        if t.dim() != 4 or tuple(t.shape[1:]) != tail or (idx is None and t.shape[0] != N):
            bad(name, f"expected shape {[N if idx is None else 'slots', *tail]}, got {list(t.shape)}")
        if idx is not None:
            if slots is not None and t.shape[0] != slots:
                bad(name, f"{t.shape[0]} slots, but initial_state has {slots}")
            slots = t.shape[0]
    if idx is not None and (idx.dim() not in (1, 2) or idx.shape[0] != N or idx.dtype != torch.int32 or
                            (idx.dim() == 2 and idx.shape[1] < 1)):
        bad("ssm_state_indices", f"expected int32 [{N}] or [{N}, T_max], got {idx.dtype} {list(idx.shape)}")
    if nat is not None and (idx is None or idx.dim() != 2 or nat.dim() != 1 or nat.shape[0] != N or
                            nat.dtype != torch.int32):
        bad("num_accepted_tokens", f"expected int32 [{N}] with a 2-D ssm_state_indices, got {nat.dtype} "
                                   f"{list(nat.shape)}")
    if cu is not None and (cu.dim() != 1 or cu.dtype not in _INT or B != 1):
        bad("cu_seqlens", f"expected int32/int64 [N + 1] with B = 1, got {cu.dtype} {list(cu.shape)}, B = {B}")
    if cu_cpu is not None and (cu_cpu.device.type != "cpu" or cu_cpu.shape != cu.shape or cu_cpu.dtype != cu.dtype):
        bad("cu_seqlens_cpu", "expected a host copy of cu_seqlens (same shape and dtype)")
    if A_log is not None and (A_log.numel() != HV or A_log.dtype != torch.float32):
        bad("A_log", f"expected float32 [{HV}], got {A_log.dtype} {list(A_log.shape)}")
    if dt_bias is not None and (dt_bias.numel() != HV * K or dt_bias.dtype != torch.float32):
        bad("dt_bias", f"expected float32 [{HV * K}], got {dt_bias.dtype} {list(dt_bias.shape)}")
    dev = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("o", o), ("initial_state", h0),
                    ("final_state", ht), ("cu_seqlens", cu), ("ssm_state_indices", idx), ("A_log", A_log),
                    ("dt_bias", dt_bias), ("num_accepted_tokens", nat), ("q", q)):
        if t is not None:
            if t.device != dev:
                bad(name, f"on {t.device}, but q is on {dev}")
            if not t.is_contiguous():
                bad(name, "must be contiguous")


def _launch(fn: str, decode: bool, q, k, v, g, beta, A_log, dt_bias, h0, ht, cu, cu_cpu, idx, o, scale: float,
            l2: bool, gate: bool, bsig: bool, neg: bool, safe: bool, lower_bound: float, vfirst: bool,
            checked: bool = False, nat=None, cp: int = -1, hs=None, keep: bool = False) -> Optional[Tensor]:
    """Fill a kda_args_t from tensors and run it on the tensors' device (h0 may be ht: in place). `checked`:
    the caller is an entry point that has made every check of _check_launch already (the eager fast path).
    `hs`: a contiguous float32 or bfloat16 tensor for kda_args_t.chunk_states (the states before each chunk).
    `keep`: the forward of a training step on CUDA keeps what the backward reuses (kda_args_t.saved) in a uint8
    tensor, returned (None where the library keeps nothing)."""
    if not checked:
        _check_launch(fn, q, k, v, g, beta, A_log, dt_bias, h0, ht, cu, cu_cpu, idx, o, vfirst, nat)
    a = _fill(fn, q, k, v, g, beta, A_log, dt_bias, h0, ht, cu, cu_cpu, idx, o, scale, l2, gate, bsig, neg, safe,
              lower_bound, vfirst, nat, cp)
    if hs is not None:
        a.chunk_states, a.chunk_states_dtype = hs.data_ptr(), _code(fn, "h", hs, _STATE)
    saved = _saved_tensor(fn, a, q.device) if keep else None
    _run(fn, a, decode, q.device)
    if scale == 0.0:  # FLA: o = 0 * S^T q; libkda reads scale 0 as "default"
        o.zero_()
    return saved


def _saved_tensor(fn: str, a: KdaArgs, dev: torch.device) -> Optional[Tensor]:
    """kda_args_t.saved for a forward on CUDA device `dev`: a uint8 tensor of kda_forward_saved_size bytes, set
    into `a` and returned; None when the library keeps nothing for this problem (or on the CPU)."""
    if dev.type != "cuda":
        return None
    _, ctx = _cuda_context(dev)
    try:
        n = _lib.saved_size(ctx, a)
    except KDAError as e:
        raise in_callers_terms(e, fn) from None
    if n == 0:
        return None
    t = torch.empty(n, dtype=torch.uint8, device=dev)
    a.saved, a.saved_bytes = t.data_ptr(), n
    return t


def _fill(fn: str, q, k, v, g, beta, A_log, dt_bias, h0, ht, cu, cu_cpu, idx, o, scale: float, l2: bool, gate: bool,
          bsig: bool, neg: bool, safe: bool, lower_bound: float, vfirst: bool, nat=None, cp: int = -1) -> KdaArgs:
    """The kda_args_t of a launch (an empty ht: no final state; cu_cpu is passed on for CUDA tensors only; cp: the
    context-parallel setting, as _lib.set_cp reads it)."""
    a = KdaArgs.from_buffer_copy(_lib.library().template)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    a.batch, a.seq_len, a.num_qk_heads, a.num_v_heads, a.head_dim_k, a.head_dim_v = B, T, H, HV, K, V
    a.dtype = _code(fn, "q", q)
    a.q, a.k, a.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    a.g, a.g_dtype = g.data_ptr(), _code(fn, "g", g)
    a.beta, a.beta_dtype = beta.data_ptr(), _code(fn, "beta", beta)
    a.o, a.o_dtype = o.data_ptr(), _code(fn, "out", o)
    if cu is not None:
        a.cu_seqlens, a.cu_seqlens_dtype, a.num_seqs = cu.data_ptr(), _INT[cu.dtype], cu.shape[0] - 1
    if h0 is not None:
        a.initial_state, a.initial_state_dtype = h0.data_ptr(), _code(fn, "initial_state", h0, _STATE)
    if ht is not None and ht.numel() > 0:
        a.final_state, a.final_state_dtype = ht.data_ptr(), _code(fn, "final_state", ht, _STATE)
    if idx is not None:
        a.state_indices, a.num_state_slots = idx.data_ptr(), (h0 if h0 is not None else ht).shape[0]
        if idx.dim() == 2:  # speculative decoding: [N, T_max] per-token slots
            a.state_indices_cols, a.state_indices_row_stride = idx.shape[1], idx.stride(0)
        if nat is not None:
            a.num_accepted_tokens = nat.data_ptr()
    if beta.dim() == 4:
        a.beta_headwise = 1
    a.state_v_first = int(vfirst)
    a.scale = scale if scale != 0.0 else 1.0
    a.use_qk_l2norm, a.use_gate_in_kernel, a.use_beta_sigmoid = int(l2), int(gate), int(bsig)
    a.allow_neg_eigval, a.safe_gate, a.lower_bound = int(neg), int(safe), lower_bound
    if A_log is not None:
        a.A_log = A_log.data_ptr()
    if dt_bias is not None:
        a.dt_bias = dt_bias.data_ptr()
    if cu_cpu is not None and q.is_cuda:
        a.cu_seqlens_host = cu_cpu.data_ptr()
    _lib.set_cp(a, cp)
    return a


def _run(fn: str, a: KdaArgs, decode: bool, dev: torch.device, nbytes: Optional[int] = None) -> int:
    """_run_on, with libkda's errors in the terms of the Python call `fn` (its name, the caller's argument names)."""
    try:
        return _run_on(fn, a, decode, dev, nbytes)
    except KDAError as e:
        raise in_callers_terms(e, fn) from None


def _cuda_context(dev: torch.device):
    """(device index, libkda's cached CUDA context of it) for CUDA device `dev`."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index, _lib._contexts.get((BACKEND_CUDA, index)) or _lib.get_context(BACKEND_CUDA, index)


def _run_on(fn: str, a: KdaArgs, decode: bool, dev: torch.device, nbytes: Optional[int] = None) -> int:
    """Run `a` on device `dev` (its current stream; workspace from torch's allocator), or on the CPU backend.
    Returns the workspace size (`nbytes`: one remembered from an earlier call of the signature, see _lib.run)."""
    if dev.type == "cuda":
        index, ctx = _cuda_context(dev)
        if _cuda_get_device() != index:
            with torch.cuda.device(index):
                return _lib.run(ctx, a, decode, _workspace(dev), _stream_of(index), nbytes)
        return _lib.run(ctx, a, decode, _workspace(dev), _stream_of(index), nbytes)
    if dev.type == "cpu":
        ctx = _lib._contexts.get(_CPU_CONTEXT) or _lib.get_context(*_CPU_CONTEXT)
        return _lib.run(ctx, a, decode, nbytes=nbytes)
    raise KDANotSupportedError(f"{fn}: tensors on {dev.type} are not supported (CUDA or CPU)")


def _workspace(dev: torch.device):
    """The workspace getter of _lib.run for CUDA device `dev`: a uint8 tensor from torch's caching allocator."""
    def workspace(n):
        t = torch.empty(n, dtype=torch.uint8, device=dev)
        return t.data_ptr(), t
    return workspace


def _state_shape(q: Tensor, v: Tensor, n: int, vfirst: bool):
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    return (n, HV, V, K) if vfirst else (n, HV, K, V)


def _num_seqs(q: Tensor, cu: Optional[Tensor]):
    return q.shape[0] if cu is None else cu.shape[0] - 1


# ---------------------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("kda::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                  dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                  cu_seqlens_cpu: Optional[Tensor], scale: float, output_final_state: bool,
                  use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                  allow_neg_eigval: bool, safe_gate: bool, lower_bound: float,
                  state_v_first: bool, cp_piece_len: int = -1) -> Tuple[Tensor, Tensor]:
    """libkda's chunked forward (kda_forward). lower_bound 0.0 means unset; cp_piece_len -1 auto, 0 off, else the
    forced piece length in tokens. Returns (o, final_state or [])."""
    return _chunk_kda_fwd_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                               output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                               use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first,
                               cp=cp_piece_len)


def _chunk_kda_fwd_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                        output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval, safe_gate, lower_bound, state_v_first, checked=False, cp=-1, hs=None,
                        keep=False):
    """(o, final_state or []); with `keep` (_ChunkKDA), (o, final_state, what the backward reuses or None)."""
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    n = _num_seqs(q, cu_seqlens) if output_final_state else 0
    ht = torch.empty(_state_shape(q, v, n, state_v_first) if output_final_state else (0,), dtype=torch.float32,
                     device=q.device)
    saved = _launch("chunk_kda", False, q, k, v, g, beta, A_log, dt_bias, initial_state, ht, cu_seqlens,
                    cu_seqlens_cpu, None, o, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, checked,
                    cp=cp, hs=hs, keep=keep)
    return (o, ht, saved) if keep else (o, ht)


def _chunk_states_tensor(q, v, cu, cu_cpu, vfirst):
    """FLA's h of return_intermediate_states: [B, NT, HV, K, V] ([.., V, K] V-first), NT = ceil(T / 64); varlen:
    [1, Σ ceil(len / 64), HV, K, V]; in q's dtype. Returns (h, the tensor libkda writes: h, or a float32 one when
    q is float16)."""
    B, T = q.shape[0], q.shape[1]
    if cu is None:
        nt = (T + 63) // 64
    else:
        lens = (cu_cpu if cu_cpu is not None else cu.cpu()).to(torch.int64)  # the host's lengths (FLA's too)
        nt = int(((lens[1:] - lens[:-1] + 63) // 64).sum())
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    shape = (B, nt, HV) + ((V, K) if vfirst else (K, V))
    h = torch.empty(shape, dtype=q.dtype, device=q.device)
    return h, (h if q.dtype != torch.float16 else torch.empty(shape, dtype=torch.float32, device=q.device))


@chunk_kda_fwd.register_fake
def _chunk_kda_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                        output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval, safe_gate, lower_bound, state_v_first, cp_piece_len=-1):
    o = q.new_empty(v.shape)
    if output_final_state:
        ht = q.new_empty(_state_shape(q, v, _num_seqs(q, cu_seqlens), state_v_first), dtype=torch.float32)
    else:
        ht = q.new_empty((0,), dtype=torch.float32)
    return o, ht


@torch.library.custom_op("kda::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                  dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                  cu_seqlens_cpu: Optional[Tensor], do: Tensor, dht: Optional[Tensor], scale: float,
                  use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                  allow_neg_eigval: bool, safe_gate: bool, lower_bound: float, state_v_first: bool, want_dh0: bool,
                  want_dA_log: bool, want_ddt_bias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                   Tensor, Tensor]:
    """libkda's backward (kda_backward) of chunk_kda_fwd for the loss weights do (and dht: the final state's,
    None or empty: zero). Returns (dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias) in the inputs'
    dtypes (FLA's); the last three are empty unless wanted (and their input given)."""
    return _chunk_kda_bwd_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, do,
                               dht, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                               allow_neg_eigval, safe_gate, lower_bound, state_v_first, want_dh0, want_dA_log,
                               want_ddt_bias)


def _bwd_outputs(q, k, v, g, beta, A_log, dt_bias, h0, want_dh0, want_dA_log, want_ddt_bias):
    def none():  # one empty tensor per absent output: outputs of a custom op may not alias each other
        return q.new_empty((0,), dtype=torch.float32)
    dh0 = torch.empty_like(h0) if want_dh0 and h0 is not None else none()
    dA = torch.empty_like(A_log) if want_dA_log and A_log is not None else none()
    ddt = torch.empty_like(dt_bias) if want_ddt_bias and dt_bias is not None else none()
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0, dA, ddt)


def _chunk_kda_bwd_impl(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, do, dht, scale, l2, gate, bsig, neg, safe,
                        lower_bound, vfirst, want_dh0, want_dA_log, want_ddt_bias, checked=False, saved=None,
                        record=None):
    """`checked`: the forward's tensors passed kda.chunk_kda's checks, and do and dht are autograd's gradients of
    its outputs (their shapes, dtypes and devices), made contiguous (_ChunkKDA.backward). `saved`: what the forward
    kept for this backward (_launch's `keep`), or None: the backward recomputes it. `record(a, b, outs, nbytes)`:
    called after a successful run with the kda_args_t and kda_backward_args_t it filled, the outputs and the
    workspace size (_ChunkKDACached's first backward of a signature, which _BwdCall then repeats)."""
    fn = "chunk_kda backward"
    if dht is not None and dht.numel() == 0:
        dht = None
    if not checked:
        _check_launch(fn, q, k, v, g, beta, A_log, dt_bias, h0, dht, cu, cu_cpu, None, do, vfirst)
    if dht is not None and dht.dim() == 4 and dht.shape[0] != _num_seqs(q, cu):
        raise KDAInvalidValueError(f"{fn}: argument 'dht': expected {_num_seqs(q, cu)} sequences, got "
                                   f"{dht.shape[0]}")
    if scale == 0.0:  # FLA: o = 0 * S^T q, so o passes no gradient
        do = torch.zeros_like(do)
    outs = _bwd_outputs(q, k, v, g, beta, A_log, dt_bias, h0, want_dh0, want_dA_log, want_ddt_bias)
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = outs
    # the forward's problem; `do` stands in for o, which the backward does not read
    a = _fill(fn, q, k, v, g, beta, A_log, dt_bias, h0, None, cu, cu_cpu, None, do, scale, l2, gate, bsig, neg, safe,
              lower_bound, vfirst)
    if saved is not None:
        a.saved, a.saved_bytes = saved.data_ptr(), saved.numel()
    b = KdaBackwardArgs.from_buffer_copy(_lib.library().backward_template)
    b.problem = ctypes.addressof(a)
    b.d_o, b.d_o_dtype = do.data_ptr(), _code(fn, "do", do)
    if dht is not None:
        b.d_final_state, b.d_final_state_dtype = dht.data_ptr(), _code(fn, "dht", dht, _STATE)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv), ("dg", dg), ("dbeta", dbeta)):
        setattr(b, name, t.data_ptr())
        setattr(b, name + "_dtype", _code(fn, name, t))
    if dh0.numel() > 0:
        b.d_initial_state, b.d_initial_state_dtype = dh0.data_ptr(), _code(fn, "initial_state", dh0, _STATE)
    if dA.numel() > 0:
        b.dA_log = dA.data_ptr()
    if ddt.numel() > 0:
        b.ddt_bias = ddt.data_ptr()
    nbytes = _run_backward(fn, b, q.device)
    if record is not None:
        record(a, b, outs, nbytes)
    return outs


def _run_backward(fn: str, b: KdaBackwardArgs, dev: torch.device, nbytes: Optional[int] = None,
                  workspace=None) -> int:
    """kda_backward of `b` on device `dev` (its current stream; workspace from torch's allocator, `workspace` a
    _workspace(dev) made before), or on the CPU backend; returns the workspace size. `nbytes`: see _lib.run."""
    if dev.type == "cuda":
        index, ctx = _cuda_context(dev)
        if _cuda_get_device() != index:
            with torch.cuda.device(index):
                return _lib.run_backward(ctx, b, workspace or _workspace(dev), _stream_of(index), nbytes)
        return _lib.run_backward(ctx, b, workspace or _workspace(dev), _stream_of(index), nbytes)
    if dev.type == "cpu":
        return _lib.run_backward(_lib._contexts.get(_CPU_CONTEXT) or _lib.get_context(*_CPU_CONTEXT), b, None, None,
                                 nbytes)
    raise KDANotSupportedError(f"{fn}: tensors on {dev.type} are not supported (CUDA or CPU)")


@chunk_kda_bwd.register_fake
def _chunk_kda_bwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, do, dht, scale,
                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                        safe_gate, lower_bound, state_v_first, want_dh0, want_dA_log, want_ddt_bias):
    return _bwd_outputs(q, k, v, g, beta, A_log, dt_bias, initial_state, want_dh0, want_dA_log, want_ddt_bias)


@torch.library.custom_op("kda::fused_recurrent_kda_fwd", mutates_args=())
def fused_recurrent_kda_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                            dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                            cu_seqlens_cpu: Optional[Tensor], ssm_state_indices: Optional[Tensor], scale: float,
                            output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                            use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, safe_gate: bool,
                            lower_bound: float, state_v_first: bool,
                            num_accepted_tokens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """libkda's recurrent decode (kda_decode) into new tensors. Returns (o, final_state or [])."""
    return _fused_recurrent_kda_fwd_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                                         ssm_state_indices, scale, output_final_state, use_qk_l2norm_in_kernel,
                                         use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                         lower_bound, state_v_first, nat=num_accepted_tokens)


def _fused_recurrent_kda_fwd_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                                  ssm_state_indices, scale, output_final_state, use_qk_l2norm_in_kernel,
                                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                  lower_bound, state_v_first, checked=False, nat=None):
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    n = _num_seqs(q, cu_seqlens) if output_final_state else 0
    ht = torch.empty(_state_shape(q, v, n, state_v_first) if output_final_state else (0,), dtype=torch.float32,
                     device=q.device)
    _launch("fused_recurrent_kda", True, q, k, v, g, beta, A_log, dt_bias, initial_state, ht, cu_seqlens,
            cu_seqlens_cpu, ssm_state_indices, o, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, checked, nat)
    return o, ht


@fused_recurrent_kda_fwd.register_fake
def _fused_recurrent_kda_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                                  ssm_state_indices, scale, output_final_state, use_qk_l2norm_in_kernel,
                                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                  lower_bound, state_v_first, num_accepted_tokens=None):
    o = v.new_empty(v.shape)
    if output_final_state:
        ht = q.new_empty(_state_shape(q, v, _num_seqs(q, cu_seqlens), state_v_first), dtype=torch.float32)
    else:
        ht = q.new_empty((0,), dtype=torch.float32)
    return o, ht


@torch.library.custom_op("kda::fused_recurrent_kda_out", mutates_args=("o", "final_state"))
def fused_recurrent_kda_out(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Optional[Tensor],
                            dt_bias: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
                            cu_seqlens_cpu: Optional[Tensor], ssm_state_indices: Optional[Tensor], o: Tensor,
                            final_state: Optional[Tensor], state_in_place: bool, scale: float,
                            use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                            allow_neg_eigval: bool, safe_gate: bool, lower_bound: float, state_v_first: bool,
                            num_accepted_tokens: Optional[Tensor] = None) -> None:
    """libkda's recurrent decode into given tensors: o, and final_state when given. With state_in_place,
    final_state is also the initial state (initial_state is then None): vLLM's in-place pool update."""
    _fused_recurrent_kda_out_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                                  ssm_state_indices, o, final_state, state_in_place, scale, use_qk_l2norm_in_kernel,
                                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                  lower_bound, state_v_first, nat=num_accepted_tokens)


def _fused_recurrent_kda_out_impl(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
                                  ssm_state_indices, o, final_state, state_in_place, scale, use_qk_l2norm_in_kernel,
                                  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                  lower_bound, state_v_first, checked=False, nat=None):
    h0 = final_state if state_in_place else initial_state
    _launch("fused_recurrent_kda", True, q, k, v, g, beta, A_log, dt_bias, h0, final_state, cu_seqlens,
            cu_seqlens_cpu, ssm_state_indices, o, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, state_v_first, checked, nat)


@fused_recurrent_kda_out.register_fake
def _fused_recurrent_kda_out_fake(*args):
    return None


@torch.library.custom_op("kda::backward_not_implemented", mutates_args=())
def backward_not_implemented(op: str, grad_outputs: List[Tensor], like: List[Tensor]) -> List[Tensor]:
    """Raises: the backward of `op` is not implemented. Its fake returns tensors shaped like `like`; it takes the
    incoming gradients so that a compiled graph cannot move it ahead of the backward pass."""
    raise KDANotSupportedError(
        f"kda.{op}: backward is not implemented yet (libkda has the forward pass only); run the forward under "
        f"torch.no_grad() / torch.inference_mode(), or use FLA for training")


@backward_not_implemented.register_fake
def _backward_not_implemented_fake(op, grad_outputs, like):
    return [torch.empty_like(t) for t in like]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])  # q, k, v, g, beta: only their shapes are used


def _make_backward(op: str, n_inputs: int):
    def backward(ctx, do, dht):
        q, k, v, g, beta = ctx.saved_tensors
        grads = torch.ops.kda.backward_not_implemented(op, [t for t in (do, dht) if t is not None],
                                                       [q, k, v, g, beta])
        return tuple(grads) + (None,) * (n_inputs - 5)
    return backward


# chunk_kda_fwd's inputs: q k v g beta A_log dt_bias initial_state cu_seqlens cu_seqlens_cpu (0-9), then scale,
# output_final_state, l2norm, gate, beta sigmoid, allow_neg_eigval, safe_gate, lower_bound, state_v_first (10-18),
# cp_piece_len (19)
def _chunk_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10])
    ctx.flags = (inputs[10],) + tuple(inputs[12:19])


def _chunk_grads(ctx, do, dht, bwd, need=None):
    """chunk_kda_fwd's gradients from what _chunk_setup_context saved, computed by `bwd`: the op chunk_kda_bwd or
    (_ChunkKDA) its implementation. `need`: whether A_log, dt_bias and initial_state need theirs at the op's input
    positions 5, 6, 7 (None: ctx.needs_input_grad, the op's inputs)."""
    q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu = ctx.saved_tensors
    scale, l2, gate, bsig, neg, safe, lb, vfirst = ctx.flags
    if need is None:
        need = ctx.needs_input_grad
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = bwd(
        q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, do.contiguous(),
        dht.contiguous() if dht is not None else None, scale, l2, gate, bsig, neg, safe, lb, vfirst,
        bool(need[7]) and h0 is not None, bool(need[5]) and A_log is not None and gate,
        bool(need[6]) and dt_bias is not None and gate)
    return (dq, dk, dv, dg, dbeta, dA if need[5] and dA.numel() else None,
            ddt if need[6] and ddt.numel() else None, dh0 if need[7] and dh0.numel() else None) + (None,) * 12


def _chunk_backward(ctx, do, dht):
    return _chunk_grads(ctx, do, dht, torch.ops.kda.chunk_kda_bwd)


chunk_kda_fwd.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


class _ChunkKDA(torch.autograd.Function):
    """chunk_kda_fwd and its autograd formula without the custom op's dispatch, for eager calls on plain tensors
    that need gradients: through the op and its registered backward a training step's host time was ~0.5 ms more
    in the forward (before its first kernel: a single step's time includes it) and ~0.3 ms more in the backward
    (bench/step_timeline.py, H100 host). torch.compile and tensor subclasses keep the op. The arguments were
    checked by kda.chunk_kda (and the backward's do and dht are autograd's gradients of the outputs)."""

    @staticmethod
    def forward(ctx, *inputs):  # chunk_kda_fwd's inputs, in its order
        *args, cp = inputs
        # the forward keeps its chunk blocks for the backward (kda_args_t.saved; CUDA), which then does not rerun
        # the preparation stage and needs as much less workspace
        o, ht, ctx.kda_saved = _chunk_kda_fwd_impl(*args, checked=True, cp=cp, keep=True)
        _chunk_setup_context(ctx, inputs, (o, ht))
        if not inputs[11]:  # output_final_state
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.kda_saved
        return _chunk_grads(ctx, do, dht, lambda *a: _chunk_kda_bwd_impl(*a, checked=True, saved=saved))


class _ChunkKDACached(torch.autograd.Function):
    """_ChunkKDA for a signature that kda.chunk_kda's fast path has cached (_ChunkCall with `train`): the forward
    was launched from the call's kda_args_t (_ChunkCall.launch, just before apply), without the checks, the
    kda_args_t's filling or the size queries; the Function records it for autograd. The signature's first backward
    is _ChunkKDA's, and it is remembered (_BwdCall): every later one launches from its kda_args_t and
    kda_backward_args_t the same way. Inputs: the call, the launch's (o, ht, saved) (a tuple: no input to
    autograd), then q k v g beta A_log dt_bias initial_state cu_seqlens cu_seqlens_cpu."""

    @staticmethod
    def forward(ctx, call, launched, *tensors):
        o, ht, ctx.kda_saved = launched
        ctx.save_for_backward(*tensors)
        ctx.kda_call = call
        if call.ht_shape is None:  # output_final_state False: an empty tensor, as _ChunkKDA's
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        call = ctx.kda_call
        bwd = call.bwd
        if bwd is not None:
            return bwd(ctx, do, dht)
        saved, need = ctx.kda_saved, ctx.needs_input_grad
        ctx.flags = call.flags

        def record(a, b, outs, nbytes):
            call.bwd = _BwdCall(call, a, b, outs, nbytes, saved)
        grads = _chunk_grads(ctx, do, dht,
                             lambda *a: _chunk_kda_bwd_impl(*a, checked=True, saved=saved, record=record), need[2:])
        return (None, None) + grads[:8] + (None, None)


def _cached_args(args: KdaArgs, sets: tuple, q, k, v, g, beta, o, h0, A_log, dt_bias, cu, cu_cpu) -> KdaArgs:
    """A copy of a cached signature's kda_args_t with this call's pointers: the tensors', and the optional ones
    that `sets` (initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_host) says the signature sets."""
    a = KdaArgs.from_buffer_copy(args)
    a.q, a.k, a.v, a.g, a.beta, a.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), \
        o.data_ptr()
    sh0, sa, sd, scu, shost = sets
    if sh0:
        a.initial_state = h0.data_ptr()
    if sa:
        a.A_log = A_log.data_ptr()
    if sd:
        a.dt_bias = dt_bias.data_ptr()
    if scu:
        a.cu_seqlens = cu.data_ptr()
    if shost:
        a.cu_seqlens_host = cu_cpu.data_ptr()
    return a


class _BwdCall:
    """The backward of one cached training signature (_ChunkCall with `train`): the kda_args_t and
    kda_backward_args_t that its first backward filled on the checked path (_chunk_kda_bwd_impl), with their
    pointers set anew by each call, exactly where the checked path sets them; which of d_initial_state, dA_log and
    ddt_bias it computes; and the workspace size its last call used. What the checked path reads per call is read
    per call here too: whether do and dht are given (and contiguous), and the forward's saved memory. Everything
    else it decides from the signature: the shapes, dtypes, devices and flags (autograd gives do and dht the
    outputs' shapes, dtypes and devices), and which inputs need gradients."""
    __slots__ = ("args", "bargs", "sets", "wants", "zero", "device", "workspace", "nbytes", "nbytes_saved")

    def __init__(self, call: "_ChunkCall", a: KdaArgs, b: KdaBackwardArgs, outs, nbytes: int, saved):
        # the per-call fields cleared (each call sets those it has): saved, the problem, d_final_state
        self.args = KdaArgs.from_buffer_copy(a)
        self.args.saved, self.args.saved_bytes = None, 0
        self.bargs = KdaBackwardArgs.from_buffer_copy(b)
        template = _lib.library().backward_template
        self.bargs.problem, self.bargs.d_final_state = None, None
        self.bargs.d_final_state_dtype = template.d_final_state_dtype
        self.sets = call.sets[1:]  # initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_host (no final_state)
        # the optional gradients whose pointers the checked path set (want_* and an output with elements)
        self.wants = tuple(t.numel() > 0 for t in outs[5:])  # d_initial_state, dA_log, ddt_bias
        self.zero = call.zero
        self.device = call.device
        self.workspace = _workspace(call.device) if call.device.type == "cuda" else None
        # the workspace size, and the saved bytes of the call that used it (the CUDA backward's workspace depends
        # on whether the forward kept its blocks: another saved size asks again)
        self.nbytes, self.nbytes_saved = nbytes, saved.numel() if saved is not None else 0

    def __call__(self, ctx, do, dht):
        """_ChunkKDACached.backward's gradients: what _chunk_grads and _chunk_kda_bwd_impl compute, in the same
        order, with the same allocations and calls."""
        q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu = ctx.saved_tensors
        if do is None:
            do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
        do = do.contiguous()
        if dht is not None:
            dht = dht.contiguous()
            if dht.numel() == 0:
                dht = None
        if self.zero:  # FLA: o = 0 * S^T q, so o passes no gradient
            do = torch.zeros_like(do)
        wh, wa, wd = self.wants
        dq, dk, dv, dg, dbeta = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
                                 torch.empty_like(beta))
        dh0 = torch.empty_like(h0) if wh else None
        dA = torch.empty_like(A_log) if wa else None
        ddt = torch.empty_like(dt_bias) if wd else None
        # `do` stands in for o, as on the checked path
        a = _cached_args(self.args, self.sets, q, k, v, g, beta, do, h0, A_log, dt_bias, cu, cu_cpu)
        saved = ctx.kda_saved
        n_saved = 0
        if saved is not None:
            n_saved = saved.numel()
            a.saved, a.saved_bytes = saved.data_ptr(), n_saved
        b = KdaBackwardArgs.from_buffer_copy(self.bargs)
        b.problem = ctypes.addressof(a)
        b.d_o = do.data_ptr()
        if dht is not None:
            b.d_final_state, b.d_final_state_dtype = dht.data_ptr(), _code("chunk_kda backward", "dht", dht, _STATE)
        b.dq, b.dk, b.dv, b.dg, b.dbeta = dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr()
        if wh:
            b.d_initial_state = dh0.data_ptr()
        if wa:
            b.dA_log = dA.data_ptr()
        if wd:
            b.ddt_bias = ddt.data_ptr()
        nbytes = self.nbytes if n_saved == self.nbytes_saved else None
        n = _run_backward("chunk_kda backward", b, self.device, nbytes, self.workspace)
        if n != nbytes:
            self.nbytes, self.nbytes_saved = n, n_saved
        # _chunk_grads' result, shifted by the call and the launch's outputs: None for them, then the 8 gradients,
        # None for cu_seqlens(_cpu)
        return None, None, dq, dk, dv, dg, dbeta, dA, ddt, dh0, None, None


fused_recurrent_kda_fwd.register_autograd(_make_backward("fused_recurrent_kda", 21), setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# The Python entry points' torch halves (arguments already checked by kda._api)
# ---------------------------------------------------------------------------------------------------------
def _tensor(fn: str, name: str, x, like: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise KDATypeError(f"{fn}: argument '{name}': expected a torch.Tensor like q, got {type(x).__name__}")
    if x.device != like.device:
        raise KDAInvalidValueError(f"{fn}: argument '{name}': on {x.device}, but q is on {like.device}")
    return x.contiguous()


def _same_dtype(fn: str, name: str, x: Tensor, q: Tensor) -> Tensor:
    x = _tensor(fn, name, x, q)
    if x.dtype != q.dtype:
        raise KDANotSupportedError(f"{fn}: argument '{name}': dtype {x.dtype} differs from q's {q.dtype}; q, k and "
                                   f"v must share one dtype")
    return x


def _f32(fn: str, name: str, x, q: Tensor) -> Optional[Tensor]:
    if x is None:
        return None
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x, dtype=torch.float32)
        x = x.to(q.device)
    elif x.device != q.device:
        raise KDAInvalidValueError(f"{fn}: argument '{name}': on {x.device}, but q is on {q.device}")
    if x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous():  # the usual case: three torch calls less
        return x
    return x.to(torch.float32).contiguous().view(-1)


def _offsets(fn: str, cu, q: Tensor):
    """cu_seqlens as an int32/int64 tensor on q's device, plus a host copy when one is at hand."""
    host = None
    if not isinstance(cu, Tensor):
        import numpy as np
        host = torch.from_numpy(np.ascontiguousarray(np.asarray(cu)))
        if host.dtype not in _INT:
            host = host.to(torch.int64)
        cu = host.to(q.device)
    elif cu.device != q.device:
        if cu.device.type == "cpu" and q.device.type == "cuda":
            raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens': on the CPU while q is on {q.device}; pass it "
                                       f"on {q.device} (and the host copy as cu_seqlens_cpu)")
        raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens': on {cu.device}, but q is on {q.device}")
    if cu.dtype not in _INT:
        if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens': expected int32 or int64 offsets, got "
                                       f"{cu.dtype}")
        cu = cu.to(torch.int64)
    return cu.contiguous(), host


def _host_offsets(fn: str, cu_cpu, cu: Tensor, host) -> Optional[Tensor]:
    if cu.device.type != "cuda":
        return None  # on the CPU, cu_seqlens itself is read
    if cu_cpu is None:
        return host
    if not isinstance(cu_cpu, Tensor):
        import numpy as np
        cu_cpu = torch.from_numpy(np.ascontiguousarray(np.asarray(cu_cpu)))
    if cu_cpu.device.type != "cpu":
        raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens_cpu': must be in host memory, got {cu_cpu.device}")
    if cu_cpu.shape != cu.shape:
        raise KDAInvalidValueError(f"{fn}: argument 'cu_seqlens_cpu': shape {list(cu_cpu.shape)} differs from "
                                   f"cu_seqlens' {list(cu.shape)}")
    return cu_cpu.to(cu.dtype).contiguous()


def _indices(fn: str, idx, q: Tensor, name: str = "ssm_state_indices") -> Tensor:
    if not isinstance(idx, Tensor):
        import numpy as np
        idx = torch.from_numpy(np.ascontiguousarray(np.asarray(idx))).to(q.device)
    elif idx.device != q.device:
        raise KDAInvalidValueError(f"{fn}: argument '{name}': on {idx.device}, but q is on {q.device}")
    if idx.dtype != torch.int32:
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise KDAInvalidValueError(f"{fn}: argument '{name}': expected integers, got {idx.dtype}")
        idx = idx.to(torch.int32)
    return idx.contiguous()


# nn.Parameter (A_log, dt_bias of a model) disables __torch_function__: to the ops it is a plain tensor
_PLAIN_TENSORS = frozenset((Tensor, torch.nn.Parameter))


def _eager(*ts) -> bool:
    """True when the ops' Python implementations may be called directly: plain tensors (or parameters), no
    autograd to record, not tracing for torch.compile. A call through torch.ops costs ~0.15 ms of host time (the
    custom op's dispatch), more than a whole small prefill on the GPU; the direct call computes the same thing."""
    if _is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in ts:
        if t is not None and (type(t) not in _PLAIN_TENSORS or (grad and t.requires_grad)):
            return False
    return True


def _is_compiling() -> bool:
    f = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(f()) if f is not None else False


def _inputs(fn: str, q, k, v, g, beta):
    q = q.contiguous()
    _code(fn, "q", q)
    k = _same_dtype(fn, "k", k, q)
    v = _same_dtype(fn, "v", v, q)
    g = _tensor(fn, "g", g, q)
    _code(fn, "g", g)
    beta = _tensor(fn, "beta", beta, q)
    _code(fn, "beta", beta)
    return q, k, v, g, beta


def chunk_kda(fn, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, scale, output_final_state, l2, gate, bsig, neg,
              safe, lower_bound, vfirst, N, remember=None, cp=-1, states=False):
    """`remember`: from chunk_kda_cached, (signature, the caller's tensors) of a call that may be cached. `cp`: the
    context-parallel setting (_lib.set_cp). `states`: return_intermediate_states (inference mode: no autograd),
    the result is then (o, final_state, h)."""
    q, k, v, g, beta = _inputs(fn, q, k, v, g, beta)
    A_log, dt_bias = _f32(fn, "A_log", A_log, q), _f32(fn, "dt_bias", dt_bias, q)
    if h0 is not None:
        h0 = _tensor(fn, "initial_state", h0, q)
    host = None
    if cu is not None:
        cu, host = _offsets(fn, cu, q)
        cu_cpu = _host_offsets(fn, cu_cpu, cu, host)
    else:
        cu_cpu = None
    lb = 0.0 if lower_bound is None else lower_bound
    if states:  # kda.chunk_kda checked torch.is_inference_mode_enabled()
        h, hs = _chunk_states_tensor(q, v, cu, cu_cpu, vfirst)
        o, ht = _chunk_kda_fwd_impl(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, scale, output_final_state, l2,
                                    gate, bsig, neg, safe, lb, vfirst, cp=cp, hs=hs)
        if hs is not h:
            h.copy_(hs)
        return o, (ht if output_final_state else None), h
    if _eager(q, k, v, g, beta, A_log, dt_bias, h0):  # every argument was checked above and by kda.chunk_kda
        o, ht = _chunk_kda_fwd_impl(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, scale, output_final_state, l2,
                                    gate, bsig, neg, safe, lb, vfirst, checked=True, cp=cp)
        if remember is not None:
            _remember_chunk(remember, (q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu), o, ht, scale,
                            output_final_state, l2, gate, bsig, neg, safe, lb, vfirst, cp)
    elif not _is_compiling() and all(t is None or type(t) in _PLAIN_TENSORS for t in (q, k, v, g, beta, A_log,
                                                                                      dt_bias, h0)):
        o, ht = _ChunkKDA.apply(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, scale, output_final_state, l2,
                                gate, bsig, neg, safe, lb, vfirst, cp)
        if remember is not None:
            _remember_chunk(remember, (q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu), o, ht, scale,
                            output_final_state, l2, gate, bsig, neg, safe, lb, vfirst, cp, train=True)
    else:
        o, ht = torch.ops.kda.chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, scale,
                                            output_final_state, l2, gate, bsig, neg, safe, lb, vfirst, cp)
    return o, (ht if output_final_state else None)


def fused_recurrent_kda(fn, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, idx, out, ht_mode, scale, l2, gate,
                        bsig, neg, safe, lower_bound, vfirst, N, nat=None):
    q, k, v, g, beta = _inputs(fn, q, k, v, g, beta)
    A_log, dt_bias = _f32(fn, "A_log", A_log, q), _f32(fn, "dt_bias", dt_bias, q)
    host = None
    if cu is not None:
        cu, host = _offsets(fn, cu, q)
        cu_cpu = _host_offsets(fn, cu_cpu, cu, host)
    else:
        cu_cpu = None
    if idx is not None:
        idx = _indices(fn, idx, q)
    if nat is not None:
        nat = _indices(fn, nat, q, "num_accepted_tokens")
    lb = 0.0 if lower_bound is None else lower_bound
    if h0 is not None:
        if not isinstance(h0, Tensor):
            raise KDATypeError(f"{fn}: argument 'initial_state': expected a torch.Tensor like q, got "
                               f"{type(h0).__name__}")
        if h0.device != q.device:
            raise KDAInvalidValueError(f"{fn}: argument 'initial_state': on {h0.device}, but q is on {q.device}")
        if ht_mode != 2:
            h0 = h0.contiguous()
        elif not h0.is_contiguous():
            raise KDANotSupportedError(f"{fn}: argument 'initial_state': the state pool is updated in place, so it "
                                       f"must be contiguous (a pool whose slots are strided apart is not "
                                       f"implemented), got strides {tuple(h0.stride())}")
    # eager: every argument was checked above and by kda.fused_recurrent_kda, so the launch checks are skipped
    eager = _eager(q, k, v, g, beta, A_log, dt_bias, h0, out)
    if out is None and ht_mode != 2:
        args = (q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, idx, scale, ht_mode == 1, l2, gate, bsig, neg,
                safe, lb, vfirst)
        if eager:
            o, ht = _fused_recurrent_kda_fwd_impl(*args, checked=True, nat=nat)
        else:
            o, ht = torch.ops.kda.fused_recurrent_kda_fwd(*args, nat)
        return o, (ht if ht_mode == 1 else None)
    if out is None:
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    else:
        if not isinstance(out, Tensor) or out.device != q.device:
            raise KDAInvalidValueError(f"{fn}: argument 'out': expected a torch.Tensor on {q.device}")
        if not out.is_contiguous():
            raise KDAInvalidValueError(f"{fn}: argument 'out': must be contiguous (it is written in place)")
        _code(fn, "out", out)
        o = out
    if ht_mode == 2:
        ht, h0_arg, in_place = h0, None, True
    else:
        ht, h0_arg, in_place = None, h0, False
        if ht_mode == 1:
            ht = torch.empty(_state_shape(q, v, N, vfirst), dtype=torch.float32, device=q.device)
    args = (q, k, v, g, beta, A_log, dt_bias, h0_arg, cu, cu_cpu, idx, o, ht, in_place, scale, l2, gate, bsig, neg,
            safe, lb, vfirst)
    if eager:
        _fused_recurrent_kda_out_impl(*args, checked=True, nat=nat)
    else:
        torch.ops.kda.fused_recurrent_kda_out(*args, nat)
    return o, ht


# ---------------------------------------------------------------------------------------------------------
# kda.chunk_kda's fast path: a call whose signature (everything its checks read: argument types, shapes,
# dtypes, devices, contiguity, flags) has passed them before runs without them. A call from a serving loop
# or benchmark then costs two torch.empty, a kda_args_t copy with its pointers set, and one ctypes call. A
# training call (tensors that require grad; which ones is part of the signature) is launched the same way, then
# recorded by _ChunkKDACached: a single training step's CUDA events count the forward's host time before its
# first kernel (bench/experiments/host_breakdown.py: ~320 of its ~430 us at B2 T8192 H32 on an H100 host went
# to the checks, the kda_args_t's filling, the size queries and autograd's Function before kda_forward was
# entered). Its backward, from the signature's second on, is _BwdCall's: the first one's kda_args_t and
# kda_backward_args_t with new pointers, no checks, no size query (docs/PERF.md, "Training step host time,
# second pass").
#
# Signatures are filed under q's shape, and one is computed only for a shape that was seen before: where the
# shapes change from call to call (variable-length prefill), a call costs one dict lookup more, not a
# signature (~5 us) and a cache entry that will not be used.
# ---------------------------------------------------------------------------------------------------------
_SCALARS = frozenset((type(None), bool, int, float))  # equal values of these mean the same to every check
_CHUNK_KWARGS = frozenset(("A_log", "dt_bias", "chunk_size", "cp_piece_len"))
_MAX_SHAPES, _MAX_CALLS = 256, 16  # bounds: q's shapes remembered, and signatures per shape
_chunk_calls: dict = {}  # q.shape -> {signature: _ChunkCall}
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def chunk_kda_cached(q, k, v, g, beta, h0, cu, cu_cpu, kwargs, scale, ofs, l2, gate, bsig, neg, safe, lb, ris,
                     vfirst, cp, use_graph, max_num_seqs):
    """kda.chunk_kda's arguments (kwargs: its **kwargs) -> (result, None) when a call of this signature was
    checked and run eagerly before; else (None, remember): what to pass to chunk_kda (None: not cacheable)."""
    if _compiling() or type(q) not in _PLAIN_TENSORS:  # first: torch.compile traces the ops, not this
        return None, None
    calls = _chunk_calls.get(shape := q.shape)
    if calls is None:
        return None, (shape, None, None)
    if ris is not False or cp is not None or (kwargs and not kwargs.keys() <= _CHUNK_KWARGS):
        return None, None  # errors, or a warning to give each time (transpose_state_layout)
    A_log, dt_bias, cp = kwargs.get("A_log"), kwargs.get("dt_bias"), kwargs.get("cp_piece_len")
    if cp is not None and type(cp) is not int:  # 64.0 == 64: let kda.chunk_kda judge every other type
        return None, None
    flags = (scale, ofs, l2, gate, bsig, neg, safe, lb, vfirst, use_graph, max_num_seqs, kwargs.get("chunk_size"), cp)
    if not _SCALARS.issuperset(map(type, flags)):
        return None, None
    grad = torch.is_grad_enabled()
    key = [flags]
    tensors = (q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu)
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) in _PLAIN_TENSORS:  # the last field: autograd records the call (as _eager decides)
            key.append((t.shape, t.dtype, t.device, t.is_contiguous(), grad and t.requires_grad))
        else:
            return None, None
    key = tuple(key)
    call = calls.get(key)
    if call is None:
        return None, (shape, key, tensors)
    if call.train:
        # the launch first, then autograd's Function: its node and inputs' edges are made while the GPU runs the
        # forward (a single step's time counts the host's time before the first kernel; Function.apply's is the
        # largest part of it that need not come first)
        launched = call.launch(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu)
        o, ht = _ChunkKDACached.apply(call, launched, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu)
        return (o, ht if call.ht_shape is not None else None), None
    return call(*tensors), None


def _remember_chunk(remember, used, o, ht, scale, ofs, l2, gate, bsig, neg, safe, lb, vfirst, cp=-1,
                    train=False) -> None:
    """After an eager chunk_kda call (`train`: one through _ChunkKDA): note q's shape if new, else cache the call's
    signature if the launch used the caller's tensors as they came (no copy, conversion or replacement), or none
    in their place (an argument the call ignores)."""
    shape, key, given = remember
    calls = _chunk_calls.get(shape)
    if calls is None:
        if len(_chunk_calls) >= _MAX_SHAPES:
            _chunk_calls.clear()
        _chunk_calls[shape] = {}
        return
    if key is None:
        return
    for u, x in zip(used, given):
        if u is not None and u is not x:
            return
    q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu = used
    args = _fill("chunk_kda", q, k, v, g, beta, A_log, dt_bias, h0, ht, cu, cu_cpu, None, o, scale, l2, gate, bsig,
                 neg, safe, lb, vfirst, cp=cp)
    # the optional pointers _fill set, as it decides
    sets = (ht.numel() > 0, h0 is not None, A_log is not None, dt_bias is not None, cu is not None,
            cu_cpu is not None and q.is_cuda)
    if len(calls) >= _MAX_CALLS:
        calls.clear()
    calls[key] = _ChunkCall(args, sets, o, ht if ofs else None, scale == 0.0,
                            (scale, l2, gate, bsig, neg, safe, lb, vfirst) if train else None)


class _ChunkCall:
    """One cached chunk_kda signature: the kda_args_t of its calls (their pointers aside: each call sets every
    pointer that is set in it), which optional pointers are set, the outputs' shapes and dtype, the device,
    and the workspace size its last call used."""
    __slots__ = ("args", "sets", "o_shape", "dtype", "ht_shape", "device", "zero", "nbytes", "flags", "train",
                 "saved_bytes", "bwd", "index", "workspace")

    def __init__(self, args: KdaArgs, sets: tuple, o: Tensor, ht: Optional[Tensor], zero: bool,
                 flags: Optional[tuple] = None):
        self.args, self.sets, self.zero = args, sets, zero
        self.o_shape, self.dtype, self.device = tuple(o.shape), o.dtype, o.device
        self.ht_shape = tuple(ht.shape) if ht is not None else None  # None: no final state returned
        self.nbytes = None
        # a call through autograd (_ChunkKDACached): _chunk_grads's flags, and the bytes the forward keeps for the
        # backward (kda_args_t.saved; asked once, or every call where the host's lengths may change them)
        self.flags, self.train, self.saved_bytes = flags, flags is not None, None
        self.bwd = None  # a training signature's backward, once its first one has run (_BwdCall)
        # CUDA: the device's index (the context is looked up per call: a fork drops the cached ones) and the
        # workspace getter
        cuda = o.device.type == "cuda" and o.device.index is not None
        self.index = o.device.index if cuda else None
        self.workspace = _workspace(o.device) if cuda else None

    def __call__(self, q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu):
        o, ht, _ = self._run(q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu, False)
        return o, ht

    def launch(self, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu):
        """A training call's forward, before _ChunkKDACached records it: (o, ht, what the forward kept for the
        backward or None); ht is an empty tensor where no final state is returned (the Function returns two
        tensors)."""
        o, ht, saved = self._run(q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu, True)
        if ht is None:
            ht = torch.empty(0, dtype=torch.float32, device=self.device)
        return o, ht, saved

    def _run(self, q, k, v, g, beta, h0, A_log, dt_bias, cu, cu_cpu, keep):
        # what _chunk_kda_fwd_impl and _launch do, the kda_args_t's other fields kept from the first call
        dev = self.device
        o = torch.empty(*self.o_shape, dtype=self.dtype, device=dev)
        ht = torch.empty(*self.ht_shape, dtype=torch.float32, device=dev) if self.ht_shape else None
        sets = self.sets
        a = _cached_args(self.args, sets[1:], q, k, v, g, beta, o, h0, A_log, dt_bias, cu, cu_cpu)
        if sets[0]:
            a.final_state = ht.data_ptr()
        saved = None
        if keep:
            if self.saved_bytes is None or sets[5]:  # cu_seqlens_cpu set: the lengths may change the saved size
                saved = _saved_tensor("chunk_kda", a, dev)
                self.saved_bytes = saved.numel() if saved is not None else 0
            elif self.saved_bytes > 0:
                saved = torch.empty(self.saved_bytes, dtype=torch.uint8, device=dev)
                a.saved, a.saved_bytes = saved.data_ptr(), self.saved_bytes
        # _run, with the device's index and workspace getter at hand
        index = self.index
        try:
            if index is not None and _cuda_get_device() == index:
                ctx = _lib._contexts.get((BACKEND_CUDA, index)) or _lib.get_context(BACKEND_CUDA, index)
                self.nbytes = _lib.run(ctx, a, False, self.workspace, _stream_of(index), self.nbytes)
            elif dev.type == "cpu":
                ctx = _lib._contexts.get(_CPU_CONTEXT) or _lib.get_context(*_CPU_CONTEXT)
                self.nbytes = _lib.run(ctx, a, False, None, None, self.nbytes)
            else:
                self.nbytes = _run_on("chunk_kda", a, False, dev, self.nbytes)
        except KDAError as e:
            raise in_callers_terms(e, "chunk_kda") from None
        if self.zero:
            o.zero_()
        return o, ht, saved


_api._torch_chunk_cached = chunk_kda_cached
