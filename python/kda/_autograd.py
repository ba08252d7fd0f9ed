"""Autograd of the custom ops (torch.library) and of the eager fast path (ChunkKDA)."""
from typing import List

import torch

from . import _ops
from ._errors import KDANotSupportedError
from ._lib import KdaOptions
from ._ops import chunk_fwd, chunk_kda_fwd, fused_recurrent_kda_fwd


def _chunk_grads(ctx, do, dht, bwd, need):
    """The 8 gradients by `bwd(opts, inputs, do, dht, wants)`; `need`: whether each of the 10 tensors needs one."""
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


chunk_kda_fwd.register_autograd(_chunk_op_backward, setup_context=_chunk_setup_context)


@torch.library.custom_op("kda::backward_not_implemented", mutates_args=())
def backward_not_implemented(op: str, grad_outputs: List[torch.Tensor], like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Raises. Its fake returns tensors like `like`; it takes the gradients so a compiled graph cannot hoist it."""
    raise KDANotSupportedError(
        f"kda.{op}: backward is not implemented yet (libkda has the forward pass only); run the forward under "
        f"torch.no_grad() / torch.inference_mode(), or use FLA for training")


backward_not_implemented.register_fake(lambda op, grad_outputs, like: [torch.empty_like(t) for t in like])


def _fused_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])  # q, k, v, g, beta: only their shapes are used


def _fused_backward(ctx, do, dht):
    grads = torch.ops.kda.backward_not_implemented("fused_recurrent_kda", [t for t in (do, dht) if t is not None],
                                                   list(ctx.saved_tensors))
    return tuple(grads) + (None,) * 16  # the op's 21 inputs


fused_recurrent_kda_fwd.register_autograd(_fused_backward, setup_context=_fused_setup_context)


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
        saved, memo, xcp = ctx.kda_saved, ctx.kda_memo, ctx.kda_xcp

        def bwd(*args):  # through the module: a test counts its calls
            return _ops.chunk_bwd(*args, checked=True, saved=saved, memo=memo, xcp=xcp)
        return (None,) * 5 + _chunk_grads(ctx, do, dht, bwd, ctx.needs_input_grad[5:]) + (None, None)
