"""Autograd for the custom ops of kda._ops, and the autograd Functions of kda._torch's eager calls.

* ``kda::chunk_kda_fwd``'s backward runs ``kda::chunk_kda_bwd`` (libkda's kda_backward).
* ``kda::fused_recurrent_kda_fwd``'s backward runs ``kda::backward_not_implemented``, which raises
  KDANotSupportedError when it runs (its fake returns gradients' shapes, so that a compiled graph with a backward
  still builds and the error comes when the backward actually runs). Gradients are never made up.
* _ChunkKDA: chunk_kda_fwd and its backward without the custom op's dispatch, for eager calls on plain tensors
  that need gradients (through the op a training step's host time was ~0.5 ms more in the forward and ~0.3 ms
  more in the backward). Its CUDA forward keeps its chunk blocks for the backward (kda_args_t.saved).
* _ChunkKDACached and _BwdCall: the same for a training signature that kda._torch's fast path has cached.
"""

import ctypes
from typing import List

import torch

from . import _ops
from ._errors import KDANotSupportedError
from ._lib import KdaArgs, KdaBackwardArgs, KdaOptions, library


def _chunk_grads(ctx, do, dht, bwd, need):
    """chunk_kda_fwd's 8 gradients (q, k, v, g, beta, A_log, dt_bias, initial_state) from ctx.saved_tensors (the
    op's 10 tensor inputs) and ctx.opts, computed by `bwd(opts, inputs, do, dht, wants)`. `need`: whether each of
    the 10 inputs needs its gradient."""
    inputs = ctx.saved_tensors
    q, v, A_log, dt_bias, h0 = inputs[0], inputs[2], inputs[5], inputs[6], inputs[7]
    gate = ctx.opts.use_gate_in_kernel
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    wants = (bool(need[7]) and h0 is not None, bool(need[5]) and A_log is not None and gate,
             bool(need[6]) and dt_bias is not None and gate)
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = bwd(ctx.opts, inputs, do.contiguous(),
                                              dht.contiguous() if dht is not None else None, wants)
    return (dq, dk, dv, dg, dbeta, dA if need[5] and dA.numel() else None, ddt if need[6] and ddt.numel() else None,
            dh0 if need[7] and dh0.numel() else None)


# chunk_kda_fwd's inputs: the 10 tensors, then scale, output_final_state, the 7 options from l2norm to
# state_v_first, cp_piece_len
def _chunk_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10])
    ctx.opts = KdaOptions(inputs[10], *inputs[12:19])


def _chunk_op_backward(ctx, do, dht):
    def bwd(opts, inputs, do, dht, wants):
        return torch.ops.kda.chunk_kda_bwd(*inputs, do, dht, opts.scale, *opts[1:8], *wants)
    return _chunk_grads(ctx, do, dht, bwd, ctx.needs_input_grad) + (None,) * 12


_ops.chunk_kda_fwd.register_autograd(_chunk_op_backward, setup_context=_chunk_setup_context)


@torch.library.custom_op("kda::backward_not_implemented", mutates_args=())
def backward_not_implemented(op: str, grad_outputs: List[torch.Tensor], like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Raises: the backward of `op` is not implemented. Its fake returns tensors shaped like `like`; it takes the
    incoming gradients so that a compiled graph cannot move it ahead of the backward pass."""
    raise KDANotSupportedError(
        f"kda.{op}: backward is not implemented yet (libkda has the forward pass only); run the forward under "
        f"torch.no_grad() / torch.inference_mode(), or use FLA for training")


@backward_not_implemented.register_fake
def _(op, grad_outputs, like):
    return [torch.empty_like(t) for t in like]


def _fused_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])  # q, k, v, g, beta: only their shapes are used


def _fused_backward(ctx, do, dht):
    grads = torch.ops.kda.backward_not_implemented("fused_recurrent_kda", [t for t in (do, dht) if t is not None],
                                                   list(ctx.saved_tensors))
    return tuple(grads) + (None,) * 16  # the op's 21 inputs


_ops.fused_recurrent_kda_fwd.register_autograd(_fused_backward, setup_context=_fused_setup_context)


class ChunkKDA(torch.autograd.Function):
    """chunk_kda_fwd and its backward for eager calls on plain tensors that need gradients. Inputs: the options,
    output_final_state, then the op's 10 tensors. The arguments were checked by kda.chunk_kda (and the backward's
    do and dht are autograd's gradients of the outputs)."""

    @staticmethod
    def forward(ctx, opts, final, *inputs):
        # the forward keeps its chunk blocks for the backward (kda_args_t.saved; CUDA), which then does not rerun
        # the preparation stage and needs as much less workspace
        o, ht, ctx.kda_saved = _ops.chunk_fwd(opts, *inputs, final, checked=True, keep=True)
        ctx.save_for_backward(*inputs)
        ctx.opts = opts
        if not final:
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.kda_saved

        def bwd(*args):
            return _ops.chunk_bwd(*args, checked=True, saved=saved)
        return (None, None) + _chunk_grads(ctx, do, dht, bwd, ctx.needs_input_grad[2:]) + (None, None)


class ChunkKDACached(torch.autograd.Function):
    """ChunkKDA for a signature that kda.chunk_kda's fast path has cached (kda._torch._ChunkCall with `train`):
    the forward was launched from the call's kda_args_t (_ChunkCall.launch, just before apply), without the checks,
    the kda_args_t's filling or the size queries; the Function records it for autograd. The signature's first
    backward is ChunkKDA's, and it is remembered (_BwdCall): every later one launches from its kda_args_t and
    kda_backward_args_t the same way. Inputs: the call, the launch's (o, ht, saved) (a tuple: no input to
    autograd), then the op's 10 tensors."""

    @staticmethod
    def forward(ctx, call, launched, *inputs):
        o, ht, ctx.kda_saved = launched
        ctx.save_for_backward(*inputs)
        ctx.kda_call, ctx.opts = call, call.opts
        if call.ht_shape is None:  # output_final_state False: an empty tensor, as ChunkKDA's
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        call = ctx.kda_call
        if call.bwd is not None:
            return call.bwd(ctx, do, dht)
        saved = ctx.kda_saved

        def record(a, b, grads, nbytes):
            call.bwd = _BwdCall(call, a, b, grads, nbytes, saved)

        def bwd(*args):
            return _ops.chunk_bwd(*args, checked=True, saved=saved, record=record)
        return (None, None) + _chunk_grads(ctx, do, dht, bwd, ctx.needs_input_grad[2:]) + (None, None)


def cached_args(args: KdaArgs, sets: tuple, q, k, v, g, beta, o, A_log, dt_bias, h0, cu, cu_cpu) -> KdaArgs:
    """A copy of a cached signature's kda_args_t with this call's pointers: the tensors', and the optional ones
    that `sets` (initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_host) says the signature sets."""
    a = KdaArgs.from_buffer_copy(args)
    a.q, a.k, a.v, a.g, a.beta = q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr()
    a.o = o.data_ptr()
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
    """The backward of one cached training signature: the kda_args_t and kda_backward_args_t that its first
    backward filled on the checked path (_ops.chunk_bwd), with their pointers set anew by each call, exactly where
    the checked path sets them; which of d_initial_state, dA_log and ddt_bias it computes; and the workspace size
    its last call used. What the checked path reads per call is read per call here too: whether do and dht are
    given (and contiguous), and the forward's saved memory. Everything else it decides from the signature: the
    shapes, dtypes, devices and options (autograd gives do and dht the outputs' shapes, dtypes and devices), and
    which inputs need gradients."""
    __slots__ = ("args", "bargs", "sets", "wants", "zero", "device", "workspace", "nbytes", "nbytes_saved")

    def __init__(self, call, a: KdaArgs, b: KdaBackwardArgs, grads, nbytes: int, saved):
        # the per-call fields cleared (each call sets those it has): saved, the problem, d_final_state
        self.args = KdaArgs.from_buffer_copy(a)
        self.args.saved, self.args.saved_bytes = None, 0
        self.bargs = KdaBackwardArgs.from_buffer_copy(b)
        self.bargs.problem, self.bargs.d_final_state = None, None
        self.bargs.d_final_state_dtype = library().backward_template.d_final_state_dtype
        self.sets = call.sets[1:]  # initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_host (no final_state)
        # the optional gradients whose pointers the checked path set (wanted, and an output with elements)
        self.wants = tuple(t.numel() > 0 for t in grads[5:])  # d_initial_state, dA_log, ddt_bias
        self.zero, self.device = call.opts.scale == 0.0, call.device
        self.workspace = _ops.workspace_of(call.device) if call.device.type == "cuda" else None
        # the workspace size, and the saved bytes of the call that used it (the CUDA backward's workspace depends
        # on whether the forward kept its blocks: another saved size asks again)
        self.nbytes, self.nbytes_saved = nbytes, saved.numel() if saved is not None else 0

    def __call__(self, ctx, do, dht):
        """ChunkKDACached.backward's gradients: what _chunk_grads and _ops.chunk_bwd compute, in the same order,
        with the same allocations and calls."""
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
        dq, dk, dv, dg, dbeta = (torch.empty_like(t) for t in (q, k, v, g, beta))
        dh0 = torch.empty_like(h0) if wh else None
        dA = torch.empty_like(A_log) if wa else None
        ddt = torch.empty_like(dt_bias) if wd else None
        # `do` stands in for o, as on the checked path
        a = cached_args(self.args, self.sets, q, k, v, g, beta, do, A_log, dt_bias, h0, cu, cu_cpu)
        saved = ctx.kda_saved
        n_saved = 0
        if saved is not None:
            n_saved = saved.numel()
            a.saved, a.saved_bytes = saved.data_ptr(), n_saved
        b = KdaBackwardArgs.from_buffer_copy(self.bargs)
        b.problem = ctypes.addressof(a)
        b.d_o = do.data_ptr()
        if dht is not None:
            b.d_final_state, b.d_final_state_dtype = dht.data_ptr(), _ops.code("chunk_kda backward", "dht", dht)
        b.dq, b.dk, b.dv, b.dg, b.dbeta = dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr()
        if wh:
            b.d_initial_state = dh0.data_ptr()
        if wa:
            b.dA_log = dA.data_ptr()
        if wd:
            b.ddt_bias = ddt.data_ptr()
        nbytes = self.nbytes if n_saved == self.nbytes_saved else None
        n = _ops.run("chunk_kda backward", "backward", b, self.device, nbytes, self.workspace)
        if n != nbytes:
            self.nbytes, self.nbytes_saved = n, n_saved
        # ChunkKDACached's inputs: the call and the launch's outputs, the 8 gradients, cu_seqlens(_cpu)
        return None, None, dq, dk, dv, dg, dbeta, dA, ddt, dh0, None, None
