"""The torch halves of kda.chunk_kda and kda.fused_recurrent_kda (arguments checked by kda._api), and chunk_kda's
fast path for a signature seen before. Eager calls on plain tensors skip the ops' dispatch; torch.compile does not."""

from typing import Optional

import torch
from torch import Tensor

from . import _api, _ops
from ._errors import KDANotSupportedError, KDATypeError
from ._lib import KdaOptions

# nn.Parameter (A_log, dt_bias of a model) disables __torch_function__: to the ops it is a plain tensor
_PLAIN_TENSORS = frozenset((Tensor, torch.nn.Parameter))
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_bad = _api._bad
# kda.chunk_kda's fast path: a call whose signature (everything its checks read: types, shapes, dtypes, devices,
# contiguity, options) passed them before runs without them, and tries its last workspace size first (Context.run
# settles one that falls short). Signatures are filed under q's shape, and made only for a shape seen before.
_SCALARS = frozenset((type(None), bool, int, float))  # equal values of these mean the same to every check
_CHUNK_KWARGS = frozenset(("A_log", "dt_bias", "chunk_size", "cp_piece_len"))
_MAX_SHAPES, _MAX_CALLS = 256, 16  # bounds: q's shapes remembered, and signatures per shape
_chunk_calls: dict = {}  # q.shape -> {signature: _ChunkCall}


def _tensor(fn: str, name: str, x, like: Tensor, dtype=None) -> Tensor:
    if not isinstance(x, Tensor):
        raise _bad(fn, name, f"expected a torch.Tensor like q, got {type(x).__name__}", KDATypeError)
    if x.device != like.device:
        raise _bad(fn, name, f"on {x.device}, but q is on {like.device}")
    if dtype is not None and x.dtype != dtype:
        raise _bad(fn, name, f"dtype {x.dtype} differs from q's {dtype}; q, k and v must share one dtype",
                   KDANotSupportedError)
    _ops.code(fn, name, x)
    return x.contiguous()


def _inputs(fn: str, q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu):
    q = _tensor(fn, "q", q, q)
    k, v = _tensor(fn, "k", k, q, q.dtype), _tensor(fn, "v", v, q, q.dtype)
    g, beta = _tensor(fn, "g", g, q), _tensor(fn, "beta", beta, q)
    return q, k, v, g, beta, _f32(fn, "A_log", A_log, q), _f32(fn, "dt_bias", dt_bias, q), *_offsets(fn, cu, cu_cpu, q)


def _f32(fn: str, name: str, x, q: Tensor) -> Optional[Tensor]:
    if x is None:
        return None
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x, dtype=torch.float32).to(q.device)
    elif x.device != q.device:
        raise _bad(fn, name, f"on {x.device}, but q is on {q.device}")
    if x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous():  # the usual case: three torch calls less
        return x
    return x.to(torch.float32).contiguous().view(-1)


def _ints(fn: str, name: str, x, device, dtypes=(torch.int32,)) -> Tensor:
    if isinstance(x, Tensor):
        if x.device != device:
            hint = "; pass it there (and the host copy as cu_seqlens_cpu)" if name == "cu_seqlens" else ""
            raise _bad(fn, name, f"on {x.device}, but q is on {device}{hint}")
        if x.dtype in dtypes:
            return x.contiguous()
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise _bad(fn, name, f"expected integers ({' or '.join(str(d)[6:] for d in dtypes)}), got {x.dtype}")
        x = x.cpu()
    import numpy as np
    return torch.from_numpy(_api.host_ints(fn, name, x, tuple(np.dtype(str(d)[6:]) for d in dtypes))).to(device)


def _offsets(fn: str, cu, cu_cpu, q: Tensor):
    if cu is None:
        return None, None
    host = None if isinstance(cu, Tensor) else _ints(fn, "cu_seqlens", cu, torch.device("cpu"), _ops._INT)
    cu = _ints(fn, "cu_seqlens", cu, q.device, _ops._INT) if host is None else host.to(q.device)
    if not cu.is_cuda or cu_cpu is None:
        return cu, host if cu.is_cuda else None  # on the CPU, cu_seqlens itself is read
    if isinstance(cu_cpu, Tensor) and cu_cpu.device.type != "cpu":
        raise _bad(fn, "cu_seqlens_cpu", f"must be in host memory, got {cu_cpu.device}")
    cu_cpu = _ints(fn, "cu_seqlens_cpu", cu_cpu, torch.device("cpu"), (cu.dtype,))
    if cu_cpu.shape != cu.shape:
        raise _bad(fn, "cu_seqlens_cpu", f"shape {list(cu_cpu.shape)} differs from cu_seqlens' {list(cu.shape)}")
    return cu, cu_cpu


def device_slots(fn: str, idx: Tensor, nat, cu, T: int, slots: int) -> None:
    """ssm_state_indices in device memory, checked on a host copy as libkda checks host ones (src/validate.c): each
    slot a sequence reads or writes below `slots` (negative: none), then no slot touched twice."""
    bad = lambda what: _bad(fn, "ssm_state_indices", what)  # noqa: E731
    rows, items = idx.tolist(), []  # items: (sequence, the entry's name, slot, whether it is the slot a row reads)
    lens = [T] * len(rows) if cu is None or idx.dim() == 1 else cu.diff().tolist()
    reads = [1] * len(rows) if nat is None else nat.tolist()
    for n, (row, ln, rd) in enumerate(zip(rows, lens, reads)):
        if idx.dim() == 1:
            row, ln, rd = [row], 1, 1
        elif ln > len(row):
            raise bad(f"T_max = {len(row)} is smaller than " + (f"T = {T}" if cu is None else f"sequence {n}'s {ln} "
                      f"tokens") + " (a 2-D ssm_state_indices needs a slot for every token)")
        elif nat is not None and not 1 <= rd <= len(row):
            raise _bad(fn, "num_accepted_tokens", f"num_accepted_tokens[{n}] = {rd} is outside [1, T_max = {len(row)}]")
        name = (lambda t: f"ssm_state_indices[{n}]") if idx.dim() == 1 else (lambda t: f"ssm_state_indices[{n}][{t}]")
        for col in (rd - 1, *range(ln)):  # the slot it reads, then those it writes (1-D: the same)
            if row[col] >= slots:
                raise bad(f"{name(col)} = {row[col]} is not below the number of slots of initial_state = {slots}")
        items += [(n, name(t), row[t], False) for t in range(ln)]
        items += [] if row[rd - 1] in row[:ln] else [(n, name(rd - 1), row[rd - 1], True)]
    first = {}
    for n, name, s, read in items:
        if s >= 0 and first.setdefault(s, name) != name:
            raise bad(f"{first[s]} and {name} are both {s}; slots must be distinct" if idx.dim() == 1 else
                      f"slot {s} ({name}, the slot sequence {n} reads) is touched by another sequence of the call"
                      if read else f"slot {s} ({name}) is touched twice in one call; the slots of a call must be "
                      f"distinct")


def _eager(*ts) -> bool:
    grad = torch.is_grad_enabled()
    return not _compiling() and all(t is None or (type(t) in _PLAIN_TENSORS and not (grad and t.requires_grad))
                                    for t in ts)


def chunk_kda(fn, opts: KdaOptions, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, final: bool, remember=None,
              states: bool = False, xcp=None):
    """`remember`: chunk_kda_cached's note; `states`: return_intermediate_states; `xcp`: cp_context's Split."""
    q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu = _inputs(fn, q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu)
    h0 = None if h0 is None else _tensor(fn, "initial_state", h0, q)
    inputs = (q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu)
    if states:  # FLA's h, [B, Σ ceil(len / 64), HV, K, V] in q's dtype, from the host's lengths (FLA's too)
        ends = [0, q.shape[1]] if cu is None else (cu_cpu if cu_cpu is not None else cu.cpu()).tolist()
        K, HV, V = q.shape[3], v.shape[2], v.shape[3]
        shape = (q.shape[0], sum((b - a + 63) // 64 for a, b in zip(ends, ends[1:])), HV)
        h = q.new_empty(shape + ((V, K) if opts.state_v_first else (K, V)))
        hs = h if q.dtype != torch.float16 else h.new_empty(h.shape, dtype=torch.float32)  # what libkda writes
        o, ht = _ops.chunk_fwd(opts, *inputs, final, hs=hs, xcp=xcp)
        if hs is not h:
            h.copy_(hs)
        return o, (ht if final else None), h
    train = False
    if _eager(*inputs[:8]):
        o, ht = _ops.chunk_fwd(opts, *inputs, final, checked=True, xcp=xcp)
    elif not _compiling() and all(t is None or type(t) in _PLAIN_TENSORS for t in inputs[:8]):
        o, ht = _ops.ChunkKDA.apply(opts, final, None, None, xcp, *inputs)
        train = True
    elif xcp is not None:
        raise _bad(fn, "cp_context", "is not implemented by kda on tensor subclasses or traced by torch.compile",
                   KDANotSupportedError)
    else:
        o, ht = torch.ops.kda.chunk_kda_fwd(*inputs, opts.scale, final, *opts[1:8], opts.cp)
        remember = None
    if remember is not None:
        _remember_chunk(remember, inputs, opts, final, train)
    return o, (ht if final else None)


def fused_recurrent_kda(fn, opts: KdaOptions, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, idx, nat, out,
                        ht_mode: int):
    """ht_mode: 0 no final state, 1 a new one, 2 initial_state updated in place (and returned)."""
    q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu = _inputs(fn, q, k, v, g, beta, A_log, dt_bias, cu, cu_cpu)
    idx = None if idx is None else _ints(fn, "ssm_state_indices", idx, q.device)
    nat = None if nat is None else _ints(fn, "num_accepted_tokens", nat, q.device)
    if idx is not None and idx.is_cuda and not (_compiling() or torch.cuda.is_current_stream_capturing()):
        device_slots(fn, idx, nat, cu if cu_cpu is None else cu_cpu, q.shape[1], h0.shape[0])  # offsets: the host's
    if h0 is not None:
        c = _tensor(fn, "initial_state", h0, q)
        if c is not h0 and ht_mode == 2:  # .contiguous() copied it
            raise _bad(fn, "initial_state", f"the state pool is updated in place, so it must be contiguous (a pool "
                                            f"whose slots are strided apart is not implemented), got strides "
                                            f"{tuple(h0.stride())}", KDANotSupportedError)
        h0 = c
    if out is not None:
        if not isinstance(out, Tensor) or out.device != q.device:
            raise _bad(fn, "out", f"expected a torch.Tensor on {q.device}")
        if not out.is_contiguous():
            raise _bad(fn, "out", "must be contiguous (it is written in place)")
        _ops.code(fn, "o", out)
    eager, final = _eager(q, k, v, g, beta, A_log, dt_bias, h0, out), ht_mode == 1
    if not eager and out is None and ht_mode != 2:  # the functional op
        o, ht = torch.ops.kda.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, idx,
                                                      opts.scale, final, *opts[1:8], nat)
        return o, (ht if final else None)
    o = v.new_empty(v.shape) if out is None else out
    ht = h0 if ht_mode == 2 else (_ops.new_state(q, v, cu, True, opts.state_v_first) if final else None)
    if eager:  # every argument was checked above and by kda.fused_recurrent_kda
        _ops.fused_launch(opts, q, k, v, g, beta, A_log, dt_bias, h0, cu, cu_cpu, idx, nat, o, ht, checked=True)
    else:
        torch.ops.kda.fused_recurrent_kda_out(q, k, v, g, beta, A_log, dt_bias, None if ht_mode == 2 else h0, cu,
                                              cu_cpu, idx, o, ht, ht_mode == 2, opts.scale, *opts[1:8], nat)
    return o, ht


def chunk_kda_cached(tensors, kwargs, flags):
    """(result, None) for a signature checked and run eagerly before; else (None, chunk_kda's `remember`)."""
    if _compiling() or type(tensors[0]) not in _PLAIN_TENSORS:  # first: torch.compile traces the ops, not this
        return None, None
    calls = _chunk_calls.get(shape := tensors[0].shape)
    if calls is None:
        return None, (shape, None, None)
    # not here: return_intermediate_states, cp_context (other kinds of call), transpose_state_layout (warns each time)
    if flags[8] is not False or flags[10] is not None or (kwargs and not kwargs.keys() <= _CHUNK_KWARGS):
        return None, None
    cp = kwargs.get("cp_piece_len")
    flags = flags + (kwargs.get("chunk_size"), cp)
    # 64.0 == 64 as a key: kda.chunk_kda judges a cp_piece_len of any other type than int
    if not _SCALARS.issuperset(map(type, flags)) or type(cp) not in (type(None), int):
        return None, None
    grad = torch.is_grad_enabled()
    inputs = (*tensors[:5], kwargs.get("A_log"), kwargs.get("dt_bias"), *tensors[5:])
    if not all(t is None or type(t) in _PLAIN_TENSORS for t in inputs):
        return None, None
    # the last field: autograd records the call (as _eager decides)
    key = (flags, *(None if t is None else (t.shape, t.dtype, t.device, t.is_contiguous(), grad and t.requires_grad)
                    for t in inputs))
    call = calls.get(key)
    if call is None:
        return None, (shape, key, inputs)
    inputs = tuple(None if unused else t for unused, t in zip(call.unused, inputs))
    if call.train:
        o, ht = _ops.ChunkKDA.apply(call.opts, call.final, call.launch(*inputs), call, None, *inputs)
        return (o, ht if call.final else None), None
    return call(*inputs), None


def _remember_chunk(remember, used, opts: KdaOptions, final: bool, train: bool) -> None:
    """Note q's shape if new, else cache the signature if the launch used the caller's tensors as they came."""
    shape, key, given = remember
    calls = _chunk_calls.get(shape)
    if calls is None:
        if len(_chunk_calls) >= _MAX_SHAPES:
            _chunk_calls.clear()
        _chunk_calls[shape] = {}
    elif key is not None and all(u is None or u is x for u, x in zip(used, given)):
        if len(calls) >= _MAX_CALLS:
            calls.clear()
        calls[key] = _ChunkCall(opts, final, train, tuple(u is None for u in used))


class _ChunkCall:
    """One cached chunk_kda signature: its options, flags, ignored arguments, and the sizes its last calls used."""
    __slots__ = ("opts", "final", "train", "unused", "nbytes", "saved_bytes", "bwd_nbytes", "bwd_saved")

    def __init__(self, opts: KdaOptions, final: bool, train: bool, unused: tuple):
        self.opts, self.final, self.train, self.unused = opts, final, train, unused
        self.nbytes = self.saved_bytes = self.bwd_nbytes = self.bwd_saved = None

    def __call__(self, *inputs):
        o, ht = _ops.chunk_fwd(self.opts, *inputs, self.final, checked=True, memo=self)
        return o, (ht if self.final else None)

    def launch(self, *inputs):
        return _ops.chunk_fwd(self.opts, *inputs, self.final, checked=True, keep=True, memo=self)


_api._torch_chunk_cached = chunk_kda_cached
