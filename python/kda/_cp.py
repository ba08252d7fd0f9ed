"""Context parallelism across ranks (docs/API.md §14, §15): FLA's build_cp_context, and chunk_kda's cp_context as
libkda's cp_* fields with the all-gathers of the ranks' summaries over the context's torch.distributed group."""

import operator
from dataclasses import make_dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _ops
from ._api import _bad
from ._errors import KDAAssertionError, KDAError

# A rank's share of a split: FLA's FLACPContext's fields (chunk_kda takes an FLACPContext too), then ours, the world
# size and rank it was built for. cu_seqlens, cu_seqlens_cpu: the rank's local offsets (from 0) and their host copy.
CPContext = make_dataclass("CPContext", [(name, Any, None) for name in (
    "group", "cu_seqlens", "cu_seqlens_cpu", "is_last_rank", "pre_num_ranks", "is_first_rank", "post_num_ranks",
    "conv1d_kernel_size", "pre_num_conv_tokens", "world_size", "rank")])
CPContext.__module__ = __name__


def build_cp_context(cu_seqlens, group, conv1d_kernel_size: Optional[int] = None, cu_seqlens_cpu=None) -> CPContext:
    """FLA's build_cp_context: this rank's part of the sequences of `cu_seqlens` split evenly over `group`."""
    fn, group = "build_cp_context", dist.group.WORLD if group is None else group
    R, r = dist.get_world_size(group), dist.get_rank(group)
    cu = torch.as_tensor(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise _bad(fn, "cu_seqlens", f"expected the offsets 0 <= ... <= T of the packed sequences, got {cu}")
    if cu[-1] < R or cu[-1] % R:
        raise _bad(fn, "cu_seqlens", f"T = {cu[-1]} tokens cannot be split evenly over the group's {R} ranks (a "
                                     f"multiple of the world size is needed, at least one token per rank)")
    lo, hi = r * (part := cu[-1] // R), (r + 1) * part
    first, last = max(c for c in cu if c <= lo), min(c for c in cu if c >= hi)  # the sequences at the slice's ends
    pre, post = r - first // part, (last - 1) // part - r
    host = torch.tensor(sorted({min(max(c, lo), hi) - lo for c in cu}), dtype=torch.int32)
    dev = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else host.device
    return CPContext(group, host.to(dev), host, post == 0, pre, pre == 0, post, conv1d_kernel_size, lo - first, R, r)


def local_offsets(fn: str, ctx, cu_seqlens, cu_seqlens_cpu, q):
    """The context's cu_seqlens (on q's device) and host copy, the call's, after checking what the caller passed."""
    cu, host = getattr(ctx, "cu_seqlens", None), getattr(ctx, "cu_seqlens_cpu", None)
    if not isinstance(cu, torch.Tensor):
        raise _bad(fn, "cp_context", f"expected a context with the rank's cu_seqlens (kda.build_cp_context), got "
                                     f"{type(ctx).__name__} with cu_seqlens {type(cu).__name__}", KDAAssertionError)
    offsets = (cu if host is None else host).tolist()
    if not offsets or offsets[0] != 0 or offsets[-1] != q.shape[1]:
        raise _bad(fn, "cp_context", f"its cu_seqlens {offsets} are not this rank's offsets 0, ..., T = {q.shape[1]} "
                                     f"of q's tokens")
    for name, x, own in (("cu_seqlens", cu_seqlens, cu), ("cu_seqlens_cpu", cu_seqlens_cpu, host)):
        if x is not None and x is not own and torch.as_tensor(x).tolist() != offsets:
            raise _bad(fn, name, f"differs from cp_context.cu_seqlens {offsets}, the rank's local offsets the call "
                                 f"runs with (pass either, or the same values)")
    return cu.to(q.device), host


def split(fn: str, ctx) -> "Split":
    """The rank's place in the context's split, checked against the context's group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise _bad(fn, "cp_context", "needs torch.distributed initialized (init_process_group)")
    group = getattr(ctx, "group", None)
    R, r = dist.get_world_size(group), dist.get_rank(group)
    built = getattr(ctx, "world_size", None), getattr(ctx, "rank", None)
    if built[0] is not None and built != (R, r):
        raise _bad(fn, "cp_context", f"was built for rank {built[1]} of a world size of {built[0]}, but its group has "
                                     f"{R} ranks and this is rank {r}")
    counts = [getattr(ctx, "pre_num_ranks", None), getattr(ctx, "post_num_ranks", None)]
    for name, x, top in (("pre_num_ranks", counts[0], r), ("post_num_ranks", counts[1], R - 1 - r)):
        if isinstance(x, bool) or not hasattr(x, "__index__") or not 0 <= operator.index(x) <= top:
            raise _bad(fn, "cp_context", f"{name} = {x!r} is not an int in [0, {top}] (rank {r} of {R})")
    return Split(group, R, r, *map(operator.index, counts))


class Split:
    """A call's place in a split (kda_args_t's cp_* fields), and the all-gathers of the ranks' summaries."""

    def __init__(self, group, R: int, rank: int, pre: int, post: int):
        self.group, self.R, self.rank, self.pre, self.post = group, R, rank, pre, post
        self.fwd = self.bwd = None  # the gathered summaries, kept while libkda may read them

    def workspace(self, n: int):  # CUDA: the primed summary's workspace, which the forward takes over (cp_primed)
        self.ws = self.ws if self.ws.numel() >= n else self.ws.new_empty(n)
        return self.ws.data_ptr(), self.ws

    def problem(self, a) -> None:
        """kda_args_t's cp_* fields, with the forward's gather once made (the backward's problem reads it too)."""
        a.cp_num_ranks, a.cp_rank, a.cp_pre_ranks, a.cp_post_ranks = self.R, self.rank, self.pre, self.post
        if self.fwd is not None:
            a.cp_summaries, a.cp_summaries_bytes = self.fwd.data_ptr(), self.fwd.nbytes

    def forward(self, fn: str, a, q, v) -> None:
        self.problem(a)
        self.ws, a.cp_primed = q.new_empty(0, dtype=torch.uint8), int(q.is_cuda and self.R > 1 and self.post > 0)
        self.fwd = self._gather(fn, "cp_forward_summary", a, q, v, self.post > 0)
        self.problem(a)

    def backward(self, fn: str, a, b, q, v) -> None:
        self.problem(a)
        self.bwd = self._gather(fn, "cp_backward_summary", b, q, v, self.pre > 0)
        if self.bwd is not None:
            b.cp_summaries, b.cp_summaries_bytes = self.bwd.data_ptr(), self.bwd.nbytes

    def _gather(self, fn: str, entry: str, args, q, v, needed: bool) -> Optional[torch.Tensor]:
        """[R · HV, K, K + V] float32: the ranks' summaries. A rank whose own fails joins the all-gather anyway (its
        summary NaN) and then raises, so that no rank waits for it."""
        if self.R == 1:
            return None
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        mine, err = q.new_empty((HV, K, K + V), dtype=torch.float32), None
        if needed:
            try:
                _ops.run(fn, entry, args, q.device, out=(mine.data_ptr(), mine.nbytes),
                         workspace=self.workspace if entry == "cp_forward_summary" and q.is_cuda else None)
            except KDAError as e:
                mine.fill_(float("nan"))
                err = e
        out = q.new_empty((self.R * HV, K, K + V), dtype=torch.float32)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        if err is not None:
            raise err
        return out
