"""torch custom ops over libkda (kda::chunk_kda_fwd, _bwd, kda::fused_recurrent_kda_fwd, _out), their fakes and
autograd, and the launch that kda._torch's eager calls share. An output not requested is an empty tensor."""

from contextlib import nullcontext
from functools import partial
from typing import List, Optional

import torch
from torch import Tensor

from . import _lib
from ._api import _bad, _check_ndim, _check_shapes, _check_slots, _check_state
from ._errors import KDAError, KDAInvalidValueError, KDANotSupportedError, in_callers_terms
from ._lib import BACKEND_CUDA, BFLOAT16, FLOAT16, FLOAT32, INT32, INT64, KdaOptions, build_args, build_backward_args

_FLOAT = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16}
_INT = {torch.int32: INT32, torch.int64: INT64}
_ptr = Tensor.data_ptr

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):  # pragma: no cover
    raise KDANotSupportedError(f"kda: torch {torch.__version__} is too old; torch >= 2.4 (torch.library.custom_op) "
                               f"is required for torch tensors")

# the current CUDA stream and device without the public spellings' checks (the callers hold CUDA tensors)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())
_OP_NAME = {"state_indices": "ssm_state_indices", "cu_seqlens_host": "cu_seqlens_cpu"}  # kda_args_t field -> op arg


def code(fn: str, field: str, t: Tensor) -> int:
    c = (_INT if field == "cu_seqlens" else _FLOAT).get(t.dtype)
    if c is None:
        raise _bad(fn, "out" if field == "o" else field, f"dtype {t.dtype} is not supported; use float32, float16 "
                                                         f"or bfloat16", KDANotSupportedError)
    return c


def cuda_context(dev: torch.device):
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index, _lib.get_context(BACKEND_CUDA, index)


def run(fn: str, entry: str, args, dev: torch.device, nbytes: Optional[int] = None, out=(), workspace=None) -> int:
    """Context.run on `dev` (CUDA: its current stream, workspace(n) or torch's allocator), errors in `fn`'s terms."""
    try:
        if dev.type == "cuda":
            index, ctx = cuda_context(dev)
            stream = _raw_stream(index) if _raw_stream else torch.cuda.current_stream(index).cuda_stream
            ws = workspace or (lambda n: ((t := torch.empty(n, dtype=torch.uint8, device=dev)).data_ptr(), t))
            with torch.cuda.device(index) if _cuda_get_device() != index else nullcontext():
                return ctx.run(entry, args, ws, stream, nbytes, out)
        if dev.type == "cpu":
            return _lib.get_context(*_lib.CPU_CONTEXT).run(entry, args, None, None, nbytes, out)
    except KDAError as e:
        raise in_callers_terms(e, fn) from None
    raise KDANotSupportedError(f"{fn}: tensors on {dev.type} are not supported (CUDA or CPU)")


def saved_tensor(fn: str, a, dev: torch.device, memo=None) -> Optional[Tensor]:
    """kda_args_t.saved for a CUDA forward: a uint8 tensor set into `a` (None: nothing kept); `memo`: a _ChunkCall."""
    if dev.type != "cuda":
        return None
    n = memo.saved_bytes if memo is not None and not a.cu_seqlens_host else None
    if n is None:
        try:
            n = cuda_context(dev)[1].saved_size(a)
        except KDAError as e:
            raise in_callers_terms(e, fn) from None
        if memo is not None:
            memo.saved_bytes = n
    if n == 0:
        return None
    t = torch.empty(n, dtype=torch.uint8, device=dev)
    a.saved, a.saved_bytes = t.data_ptr(), n
    return t


def check_launch(fn: str, q, k, v, g, beta, o, v_first: bool, **optional) -> None:
    """What libkda cannot check itself (sizes, dtypes, devices, layouts behind the pointers): the ops are public."""
    _check_ndim(fn, q, k, v, g, beta, fused=True)
    B, T, H, K, HV, V = _check_shapes(fn, q, k, v, g, beta, KDAInvalidValueError, headwise_ok=True)
    if tuple(o.shape) != tuple(v.shape):
        raise _bad(fn, "o", f"expected v's shape {list(v.shape)}, got {list(o.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise _bad(fn, name, f"dtype {t.dtype} differs from q's {q.dtype}")
    h0, ht, cu, idx, nat, host = (optional.get(f) for f in ("initial_state", "final_state", "cu_seqlens",
                                                            "state_indices", "num_accepted_tokens", "cu_seqlens_host"))
    N = B if cu is None else cu.shape[0] - 1
    for name, t in (("initial_state", h0), ("final_state", ht)):
        if t is not None:
            _check_state(fn, name, t, N, HV, K, V, v_first, pool=idx is not None)
    if h0 is not None and ht is not None and h0.shape[0] != ht.shape[0]:
        raise _bad(fn, "final_state", f"{ht.shape[0]} slots, but initial_state has {h0.shape[0]}")
    _check_slots(fn, idx, nat, N)
    for name, t in (("ssm_state_indices", idx), ("num_accepted_tokens", nat)):
        if t is not None and t.dtype != torch.int32:
            raise _bad(fn, name, f"expected int32, got {t.dtype}")
    if cu is not None and (cu.dim() != 1 or cu.dtype not in _INT or B != 1):
        raise _bad(fn, "cu_seqlens", f"expected int32/int64 [N + 1] with B = 1, got {cu.dtype} {list(cu.shape)}, "
                                     f"B = {B}")
    if host is not None and (host.device.type != "cpu" or cu is None or host.shape != cu.shape or
                             host.dtype != cu.dtype):
        raise _bad(fn, "cu_seqlens_cpu", "expected a host copy of cu_seqlens (same shape and dtype)")
    for name, n in (("A_log", HV), ("dt_bias", HV * K)):
        t = optional.get(name)
        if t is not None and (t.numel() != n or t.dtype != torch.float32):
            raise _bad(fn, name, f"expected float32 [{n}], got {t.dtype} {list(t.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("o", o), *optional.items(), ("q", q)):
        if t is not None and name != "cu_seqlens_host":
            if t.device != q.device:
                raise _bad(fn, _OP_NAME.get(name, name), f"on {t.device}, but q is on {q.device}")
            if not t.is_contiguous():
                raise _bad(fn, _OP_NAME.get(name, name), "must be contiguous")


def launch(fn: str, entry: str, opts: KdaOptions, q, k, v, g, beta, o, checked: bool = False, hs=None,
           keep: bool = False, memo=None, xcp=None, **optional) -> Optional[Tensor]:
    """libkda's `entry` ("forward", "decode") on tensors; `optional` by kda_args_t's names (an empty final_state:
    none). `hs`: chunk_states. `keep`: returns kda_args_t.saved. `memo`: a _ChunkCall. `xcp`: a kda._cp.Split."""
    ht = optional.get("final_state")
    if ht is not None and ht.numel() == 0:
        optional["final_state"] = None
    if not q.is_cuda:
        optional["cu_seqlens_host"] = None
    if not checked:
        check_launch(fn, q, k, v, g, beta, o, opts.state_v_first, **optional)
    a = build_args(opts, fn, _ptr, code, q, k, v, g, beta, o, chunk_states=hs, **optional)
    if xcp is not None:
        xcp.forward(fn, a, q, v)
    saved = saved_tensor(fn, a, q.device, memo) if keep else None
    n = run(fn, entry, a, q.device, None if memo is None or a.cp_primed else memo.nbytes,
            workspace=xcp and xcp.workspace)
    if xcp is not None:
        xcp.ws = None
    if memo is not None:
        memo.nbytes = n
    if opts.scale == 0.0:  # FLA: o = 0 * S^T q (build_args runs it with scale 1)
        o.zero_()
    return saved


def new_state(q: Tensor, v: Tensor, cu: Optional[Tensor], final: bool, v_first: bool) -> Tensor:
    K, HV, V = q.shape[3], v.shape[2], v.shape[3]
    N = q.shape[0] if cu is None else cu.shape[0] - 1
    shape = ((N, HV, V, K) if v_first else (N, HV, K, V)) if final else (0,)
    return q.new_empty(shape, dtype=torch.float32)


def new_outputs(q: Tensor, v: Tensor, cu: Optional[Tensor], final: bool, v_first: bool):
    return v.new_empty(v.shape), new_state(q, v, cu, final, v_first)


def chunk_fwd(opts: KdaOptions, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, final: bool, checked=False,
              hs=None, keep=False, memo=None, xcp=None):
    o, ht = new_outputs(q, v, cu, final, opts.state_v_first)
    saved = launch("chunk_kda", "forward", opts, q, k, v, g, beta, o, checked, hs, keep, memo, xcp, initial_state=h0,
                   final_state=ht, cu_seqlens=cu, cu_seqlens_host=cu_cpu, A_log=A_log, dt_bias=dt_bias)
    return (o, ht, saved) if keep else (o, ht)


def bwd_outputs(inputs, wants):
    """chunk_bwd's gradients; d_initial_state, dA_log, ddt_bias empty unless wanted and given (no aliasing)."""
    extra = [torch.empty_like(t) if want and t is not None else inputs[0].new_empty((0,), dtype=torch.float32)
             for t, want in zip((inputs[7], inputs[5], inputs[6]), wants)]  # initial_state, A_log, dt_bias
    return (*map(torch.empty_like, inputs[:5]), *extra)


def chunk_bwd(opts: KdaOptions, inputs, do, dht, wants, checked=False, saved=None, memo=None, xcp=None):
    """kda_backward of chunk_fwd's 10 `inputs` for do and dht (None or empty: zero); `wants`: d_initial_state,
    dA_log, ddt_bias. `saved`: what the forward kept (None: recomputed). `memo`: a _ChunkCall. `xcp`: the Split."""
    fn = "chunk_kda backward"
    q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu = inputs
    if dht is not None and dht.numel() == 0:
        dht = None
    optional = dict(initial_state=h0, cu_seqlens=cu, cu_seqlens_host=cu_cpu if q.is_cuda else None, A_log=A_log,
                    dt_bias=dt_bias)
    if not checked:
        check_launch(fn, q, k, v, g, beta, do, opts.state_v_first, final_state=dht, **optional)
    if opts.scale == 0.0:  # FLA: o = 0 * S^T q, so o passes no gradient
        do = torch.zeros_like(do)
    grads = bwd_outputs(inputs, wants)
    a = build_args(opts, fn, _ptr, code, q, k, v, g, beta, do, **optional)  # the forward's; do stands in for o
    n_saved = 0 if saved is None else saved.numel()
    if saved is not None:
        a.saved, a.saved_bytes = saved.data_ptr(), n_saved
    b = build_backward_args(a, fn, _ptr, code, do, dht, [t if t.numel() else None for t in grads])
    if xcp is not None:
        xcp.backward(fn, a, b, q, v)
    n = run(fn, "backward", b, q.device, memo.bwd_nbytes if memo is not None and memo.bwd_saved == n_saved else None)
    if memo is not None:
        memo.bwd_nbytes, memo.bwd_saved = n, n_saved
    return grads


def fused_launch(opts: KdaOptions, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, idx, nat, o, ht,
                 checked=False):
    launch("fused_recurrent_kda", "decode", opts, q, k, v, g, beta, o, checked, initial_state=h0, final_state=ht,
           cu_seqlens=cu, cu_seqlens_host=cu_cpu, state_indices=idx, num_accepted_tokens=nat, A_log=A_log,
           dt_bias=dt_bias)


# The ops: schemas from the shared parts (the fakes and the autograd rules index the arguments in this order)
_TENSORS = ("Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
            "Tensor? initial_state, Tensor? cu_seqlens, Tensor? cu_seqlens_cpu")
_FLAGS = ("bool use_qk_l2norm_in_kernel, bool use_gate_in_kernel, bool use_beta_sigmoid_in_kernel, "
          "bool allow_neg_eigval, bool safe_gate, float lower_bound, bool state_v_first")
_DECODE = f"{_TENSORS}, Tensor? ssm_state_indices"


@torch.library.custom_op("kda::chunk_kda_fwd", mutates_args=(), schema=f"({_TENSORS}, float scale, "
                         f"bool output_final_state, {_FLAGS}, SymInt cp_piece_len=-1) -> (Tensor, Tensor)")
def chunk_kda_fwd(*args):
    """kda_forward: (o, final_state or []). lower_bound 0.0: unset; cp_piece_len -1 auto, 0 off, else tokens."""
    return chunk_fwd(KdaOptions(args[10], *args[12:]), *args[:10], args[11])


@torch.library.custom_op("kda::chunk_kda_bwd", mutates_args=(), schema=f"({_TENSORS}, Tensor do, Tensor? dht, "
                         f"float scale, {_FLAGS}, bool want_dh0, bool want_dA_log, bool want_ddt_bias) -> (Tensor, "
                         f"Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def chunk_kda_bwd(*args):
    """kda_backward of chunk_kda_fwd: the 8 gradients in the inputs' dtypes, the last three empty unless wanted."""
    return chunk_bwd(KdaOptions(*args[12:20]), args[:10], args[10], args[11], args[20:])


@torch.library.custom_op("kda::fused_recurrent_kda_fwd", mutates_args=(), schema=f"({_DECODE}, float scale, "
                         f"bool output_final_state, {_FLAGS}, Tensor? num_accepted_tokens=None) -> (Tensor, Tensor)")
def fused_recurrent_kda_fwd(*args):
    """libkda's recurrent decode (kda_decode) into new tensors. Returns (o, final_state or [])."""
    opts, nat = KdaOptions(args[11], *args[13:20]), args[20] if len(args) > 20 else None
    o, ht = new_outputs(args[0], args[2], args[8], args[12], opts.state_v_first)
    fused_launch(opts, *args[:11], nat, o, ht)
    return o, ht


@torch.library.custom_op("kda::fused_recurrent_kda_out", mutates_args=("o", "final_state"), schema=f"({_DECODE}, "
                         f"Tensor(a11!) o, Tensor(a12!)? final_state, bool state_in_place, float scale, {_FLAGS}, "
                         f"Tensor? num_accepted_tokens=None) -> ()")
def fused_recurrent_kda_out(*args):
    """kda_decode into o and final_state when given; with state_in_place, final_state is the initial state too."""
    o, ht, in_place, opts = args[11], args[12], args[13], KdaOptions(*args[14:22])
    fused_launch(opts, *args[:7], ht if in_place else args[7], *args[8:11], args[22] if len(args) > 22 else None,
                 o, ht)


# the fakes: the forwards' outputs from q, v, cu_seqlens, output_final_state and state_v_first; chunk_kda_bwd's
# gradients like the first 8 inputs, as want_dh0, want_dA_log, want_ddt_bias (the last 3) say
chunk_kda_fwd.register_fake(lambda *args: new_outputs(args[0], args[2], args[8], args[11], args[18]))
chunk_kda_bwd.register_fake(lambda *args: bwd_outputs(args[:8], args[-3:]))
fused_recurrent_kda_fwd.register_fake(lambda *args: new_outputs(args[0], args[2], args[8], args[12], args[19]))
fused_recurrent_kda_out.register_fake(lambda *args, **kwargs: None)


def _chunk_grads(ctx, do, dht, bwd, need):
    """The 8 gradients by `bwd(opts, inputs, do, dht, wants)`; `need`: whether each of the 10 tensors needs one."""
    inputs, gate = ctx.saved_tensors, ctx.opts.use_gate_in_kernel  # A_log, dt_bias, h0: inputs[5], [6], [7]
    wants = (bool(need[7]) and inputs[7] is not None, bool(need[5]) and inputs[5] is not None and gate,
             bool(need[6]) and inputs[6] is not None and gate)
    do = torch.zeros_like(inputs[2]) if do is None else do.contiguous()  # v: contiguous, in q's dtype
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = bwd(ctx.opts, inputs, do, None if dht is None else dht.contiguous(), wants)
    return (dq, dk, dv, dg, dbeta, dA if need[5] and dA.numel() else None, ddt if need[6] and ddt.numel() else None,
            dh0 if need[7] and dh0.numel() else None)


# chunk_kda_fwd's inputs: the 10 tensors, scale, output_final_state, the 7 options (l2norm .. state_v_first), cp
def _chunk_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10])
    ctx.opts = KdaOptions(inputs[10], *inputs[12:19])


def _chunk_op_backward(ctx, do, dht):
    def bwd(opts, inputs, do, dht, wants):
        return torch.ops.kda.chunk_kda_bwd(*inputs, do, dht, opts.scale, *opts[1:8], *wants)
    return _chunk_grads(ctx, do, dht, bwd, ctx.needs_input_grad) + (None,) * 12


@torch.library.custom_op("kda::backward_not_implemented", mutates_args=())
def backward_not_implemented(op: str, grad_outputs: List[torch.Tensor], like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Raises. Its fake returns tensors like `like`; it takes the gradients so a compiled graph cannot hoist it."""
    raise KDANotSupportedError(
        f"kda.{op}: backward is not implemented yet (libkda has the forward pass only); run the forward under "
        f"torch.no_grad() / torch.inference_mode(), or use FLA for training")


def _fused_backward(ctx, do, dht):
    grads = torch.ops.kda.backward_not_implemented("fused_recurrent_kda", [t for t in (do, dht) if t is not None],
                                                   list(ctx.saved_tensors))
    return tuple(grads) + (None,) * 16  # the op's 21 inputs


backward_not_implemented.register_fake(lambda op, grad_outputs, like: [torch.empty_like(t) for t in like])
chunk_kda_fwd.register_autograd(_chunk_op_backward, setup_context=_chunk_setup_context)
# fused_recurrent_kda_fwd saves q, k, v, g, beta for their shapes only
fused_recurrent_kda_fwd.register_autograd(_fused_backward, setup_context=lambda ctx, inputs, output:
                                          ctx.save_for_backward(*inputs[:5]))


class ChunkKDA(torch.autograd.Function):
    """chunk_kda_fwd and its backward on checked arguments: opts, final, the fast path's (o, ht, saved) or None,
    its _ChunkCall or None, a kda._cp.Split or None, the op's 10 tensors."""

    @staticmethod
    def forward(ctx, opts, final, launched, memo, xcp, *inputs):
        if launched is None:  # kept for the backward: kda_args_t.saved
            launched = chunk_fwd(opts, *inputs, final, checked=True, keep=True, xcp=xcp)
        o, ht, ctx.kda_saved = launched
        ctx.save_for_backward(*inputs)
        ctx.opts, ctx.kda_memo, ctx.kda_xcp = opts, memo, xcp
        if not final:
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        bwd = partial(chunk_bwd, checked=True, saved=ctx.kda_saved, memo=ctx.kda_memo, xcp=ctx.kda_xcp)
        return (None,) * 5 + _chunk_grads(ctx, do, dht, bwd, ctx.needs_input_grad[5:]) + (None, None)
