"""torch tensors: CPU results equal numpy's, bf16 against the reference, custom ops under torch.compile and opcheck,
chunk_kda's gradients (fused_recurrent_kda's backward refused); with a GPU: the CUDA backend against the reference, in-place pools, CUDA graph capture.

Without torch (or a GPU) each test is reported skipped with the reason (`pytest -rs`), not the module as one. Until libkda's CUDA backend exists, the CUDA tests xfail
with the library's "not supported" message.
"""

import re
import shutil

import numpy as np
import pytest

import kda
from kda_reference import kda_reference, make_inputs, rel_err


class _NoTorch:
    """Stands in for torch when it is not installed, so that the module's own uses of torch (dtypes in parameter
    tables, decorators) evaluate and each test is collected, then skipped with the reason below."""

    def __getattr__(self, name):
        return _NoTorch()

    def __call__(self, *args, **kwargs):
        return _NoTorch()

    def __bool__(self):
        return False

    def __repr__(self):
        return "torch-not-installed"


try:
    import torch
except ImportError:
    torch = None

ENTRIES = {"chunk": kda.chunk_kda, "fused": kda.fused_recurrent_kda}
if torch is None:
    torch = _NoTorch()
    pytestmark = pytest.mark.skip(reason="torch is not installed (pip install torch): the torch tests need it")
else:
    HAS_CUSTOM_OP = hasattr(torch, "library") and hasattr(torch.library, "custom_op")
    pytestmark = pytest.mark.skipif(not HAS_CUSTOM_OP, reason=f"torch {torch.__version__} has no "
                                                              f"torch.library.custom_op (kda needs torch >= 2.4)")


def to_torch(x, device="cpu", dtype=None):
    out = {}
    for key, val in x.items():
        t = torch.from_numpy(np.ascontiguousarray(val)).to(device)
        if dtype is not None and key != "initial_state" and t.is_floating_point():
            t = t.to(dtype)
        out[key] = t
    return out


def gate_kwargs(rng, mode, HV, K):
    if mode == "none":
        return {}
    A_log = rng.uniform(-1, 1, HV).astype(np.float32)
    dt_bias = (0.5 * rng.standard_normal(HV * K)).astype(np.float32)
    if mode == "softplus":
        return dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    if mode == "lb":
        return dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-4.0, safe_gate=True)
    raise AssertionError(mode)


def ref_gate(kw):
    return {k: v for k, v in kw.items() if k in ("use_gate_in_kernel", "A_log", "dt_bias", "lower_bound")}


def gate_to(kw, device):
    return {k: (torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}


# name: B, T, H, HV, K, V, cu_seqlens, l2, gate, beta sigmoid, state, v-first
TORCH_CASES = {
    "basic": (2, 37, 1, 2, 32, 32, None, False, "none", False, True, False),
    "varlen_gva": (1, 90, 1, 4, 32, 32, [0, 3, 3, 70, 90], True, "softplus", True, True, False),
    "bounded_vfirst": (1, 40, 2, 2, 16, 16, [0, 40], False, "lb", False, True, True),
    "t1": (4, 1, 1, 1, 64, 64, None, False, "none", True, True, False),
}


def case_inputs(name, seed=0, K_V=None):
    B, T, H, HV, K, V, cu, l2, gate, bsig, state, vfirst = TORCH_CASES[name]
    if K_V is not None:
        K, V = K_V
    rng = np.random.default_rng(seed)
    N = B if cu is None else len(cu) - 1
    x = make_inputs(rng, B, T, H, HV, K, V, l2=l2, gate=gate, beta_sigmoid=bsig, state=state, N=N,
                    state_v_first=vfirst)
    opts = dict(gate_kwargs(rng, gate, HV, K), use_qk_l2norm_in_kernel=l2, use_beta_sigmoid_in_kernel=bsig,
                state_v_first=vfirst, output_final_state=True)
    return x, cu, opts


def reference_of(x, cu, opts, dtype=None):
    """The fp64 reference on the inputs as the kernel sees them (rounded to dtype first)."""
    def rounded(a):
        if dtype is None:
            return a
        return torch.from_numpy(a).to(dtype).to(torch.float64).numpy()
    return kda_reference(*(rounded(x[k]) for k in ("q", "k", "v", "g", "beta")),
                         initial_state=x.get("initial_state"), cu_seqlens=cu, output_final_state=True,
                         use_qk_l2norm=opts["use_qk_l2norm_in_kernel"],
                         use_beta_sigmoid=opts["use_beta_sigmoid_in_kernel"], state_v_first=opts["state_v_first"],
                         **ref_gate(opts))


# ---------------------------------------------------------------------------------------------------------
# CPU tensors
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["chunk", "fused"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_tensors_equal_numpy(entry, name, dtype):
    x, cu, opts = case_inputs(name)
    x = {k: (v.astype(dtype) if k != "initial_state" else v) for k, v in x.items()}
    cu_np = None if cu is None else np.asarray(cu, np.int32)
    o_np, h_np = ENTRIES[entry](**x, cu_seqlens=cu_np, **opts)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)  # FLA passes LongTensor offsets
    o_t, h_t = ENTRIES[entry](**to_torch(x), cu_seqlens=cu_t, **gate_to(opts, "cpu"))
    assert isinstance(o_t, torch.Tensor) and o_t.dtype == torch.from_numpy(x["q"]).dtype
    assert h_t.dtype == torch.float32
    np.testing.assert_array_equal(o_t.numpy(), o_np)
    np.testing.assert_array_equal(h_t.numpy(), h_np)


@pytest.mark.parametrize("entry", ["chunk", "fused"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_cpu_bfloat16_against_reference(entry, name):
    x, cu, opts = case_inputs(name, seed=1)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, h = ENTRIES[entry](**to_torch(x, dtype=torch.bfloat16), cu_seqlens=cu_t, **gate_to(opts, "cpu"))
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    ref_o, ref_h = reference_of(x, cu, opts, torch.bfloat16)
    assert rel_err(o.float().numpy(), ref_o) <= 1e-2
    assert rel_err(h.numpy(), ref_h) <= 1e-2


@pytest.mark.parametrize("entry", ["chunk", "fused"])
def test_bfloat16_initial_state(entry):
    x, cu, opts = case_inputs("basic", seed=2)
    xt = to_torch(x)
    xt["initial_state"] = xt["initial_state"].bfloat16()
    o, h = ENTRIES[entry](**xt, **opts)
    x["initial_state"] = xt["initial_state"].float().numpy()
    ref_o, ref_h = reference_of(x, cu, opts)
    assert rel_err(o.numpy(), ref_o) <= 1e-5 and rel_err(h.numpy(), ref_h) <= 1e-5


def test_cpu_inplace_pool_and_out():
    rng = np.random.default_rng(3)
    x = make_inputs(rng, 1, 5, 1, 2, 16, 16, state=True, slots=6, state_v_first=True)
    pool_np = x.pop("initial_state")
    xt = to_torch(x)
    pool = torch.from_numpy(pool_np.copy())
    before = pool.clone()
    cu = torch.tensor([0, 1, 2, 2, 5], dtype=torch.int32)
    idx = torch.tensor([5, -1, 2, 0], dtype=torch.int32)
    out = torch.empty(1, 5, 2, 16)
    o, h = kda.fused_recurrent_kda(**xt, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                   cu_seqlens=cu, state_v_first=True, out=out)
    assert o is out and h is pool
    ref_o, ref_pool = kda_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool_np,
                                    cu_seqlens=cu.numpy(), state_indices=idx.numpy(), state_v_first=True)
    assert rel_err(o.numpy(), ref_o) <= 1e-5 and rel_err(pool.numpy(), ref_pool) <= 1e-5
    for s in (1, 3, 4):
        assert torch.equal(pool[s], before[s])


def test_cpu_pool_read_only():
    rng = np.random.default_rng(12)
    x = make_inputs(rng, 2, 3, 1, 1, 16, 16, state=True, slots=4)
    pool_np = x.pop("initial_state")
    pool = torch.from_numpy(pool_np.copy())
    idx = torch.tensor([2, 0], dtype=torch.int32)
    o, h = kda.fused_recurrent_kda(**to_torch(x), initial_state=pool, ssm_state_indices=idx)
    assert h is None and torch.equal(pool, torch.from_numpy(pool_np))
    o_np, _ = kda.fused_recurrent_kda(**x, initial_state=pool_np, ssm_state_indices=idx.numpy())
    np.testing.assert_array_equal(o.numpy(), o_np)


def test_ops_check_shapes_when_called_directly():
    """The ops are public: called without the Python entry point, they still refuse memory they cannot read."""
    import kda._torch  # noqa: F401
    x = to_torch(make_inputs(np.random.default_rng(13), 1, 8, 1, 2, 16, 16))
    flags = (0.25, False, False, False, False, False, False, 0.0, False)
    args = [x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, None, None]
    torch.ops.kda.chunk_kda_fwd(*args, *flags)
    for i, name, bad in ((3, "g", x["g"][..., :8]), (4, "beta", x["beta"][:, :4]), (1, "k", x["k"].transpose(1, 2)),
                         (7, "initial_state", torch.zeros(1, 2, 16, 8))):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(ValueError, match=f"'{name}'"):
            torch.ops.kda.chunk_kda_fwd(*wrong, *flags)


def test_mixed_containers():
    x, cu, opts = case_inputs("varlen_gva")
    xt = to_torch(x)
    topts = gate_to(opts, "cpu")
    ref = kda.chunk_kda(**xt, cu_seqlens=torch.tensor(cu), **topts)
    # offsets as a numpy array or a list, and numpy gate parameters, are taken with torch inputs
    for offsets in (np.asarray(cu, np.int32), list(cu)):
        out = kda.chunk_kda(**xt, cu_seqlens=offsets, **opts)
        assert torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
    with pytest.raises(TypeError, match="'initial_state'"):
        kda.chunk_kda(**dict(xt, initial_state=x["initial_state"]), cu_seqlens=torch.tensor(cu), **topts)
    with pytest.raises(TypeError, match="'v'"):
        kda.chunk_kda(**dict(xt, v=x["v"]), cu_seqlens=torch.tensor(cu), **topts)


def test_non_contiguous_pool_refused():
    rng = np.random.default_rng(4)
    x = to_torch(make_inputs(rng, 2, 1, 1, 1, 16, 16))
    big = torch.zeros(4, 2, 1, 16, 16)
    pool = big[:, 0]  # slots strided apart
    with pytest.raises(NotImplementedError, match="initial_state"):
        kda.fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True,
                                ssm_state_indices=torch.tensor([0, 1], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------
# autograd: chunk_kda's gradients (libkda's kda_backward); fused_recurrent_kda's backward is refused
# ---------------------------------------------------------------------------------------------------------
def torch_naive(q, k, v, g, beta, h0, cu, scale, l2=False, gate=False, A_log=None, dt_bias=None, lower_bound=None,
                bsig=False, neg=False, vfirst=False):
    """KDA from its definition in torch (any float dtype; float64 for the gradients' reference): (o, ht)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    if l2:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if gate:
        x = g + (dt_bias.view(HV, K) if dt_bias is not None else 0)
        A = torch.exp(A_log).view(HV, 1) if A_log is not None else 1.0
        g = lower_bound * torch.sigmoid(A * x) if lower_bound else -A * torch.nn.functional.softplus(x)
    g = g.clamp(-80.0, 0.0)
    if bsig:
        beta = (2.0 if neg else 1.0) * torch.sigmoid(beta)
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs, finals = [], []
    for n, (b, t0, t1) in enumerate(bounds):
        heads, hts = [], []
        for h in range(HV):
            S = h0[n, h] if h0 is not None else q.new_zeros(K, V)
            if h0 is not None and vfirst:
                S = S.transpose(0, 1)
            rows = []
            for t in range(t0, t1):
                S = torch.exp(g[b, t, h]).unsqueeze(1) * S
                kt, qt = k[b, t, h // G], q[b, t, h // G]
                S = S + beta[b, t, h] * torch.outer(kt, v[b, t, h] - kt @ S)
                rows.append(scale * (qt @ S))
            heads.append(torch.stack(rows) if rows else v.new_zeros(0, V).to(q.dtype))
            hts.append(S.transpose(0, 1) if vfirst else S)
        outs.append(torch.stack(heads, 1))
        finals.append(torch.stack(hts))
    o = torch.cat(outs, 0).view(B, T, HV, V) if cu is None else torch.cat(outs, 0).unsqueeze(0)
    return o, torch.stack(finals)


GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _grad_case(name, seed):
    x, cu, opts = case_inputs(name, seed=seed)
    xt = to_torch(x)
    kw = gate_to(opts, "cpu")
    for key in ("A_log", "dt_bias"):
        if key in kw:
            xt[key] = kw.pop(key)
    return xt, cu, kw


def _naive_kwargs(kw, xt, K):
    return dict(scale=K ** -0.5, l2=kw["use_qk_l2norm_in_kernel"], gate=kw.get("use_gate_in_kernel", False),
                A_log=xt.get("A_log"), dt_bias=xt.get("dt_bias"), lower_bound=kw.get("lower_bound"),
                bsig=kw["use_beta_sigmoid_in_kernel"], vfirst=kw["state_v_first"])


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_chunk_gradients_against_torch_float64(name):
    """Every gradient (FLA's return order and dtypes) against torch autograd through the definition in float64."""
    xt, cu, kw = _grad_case(name, seed=3)
    leaves = {key: xt[key].clone().requires_grad_() for key in GRAD_INPUTS if key in xt}
    args = {**xt, **leaves}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    o, ht = kda.chunk_kda(**args, cu_seqlens=cu_t, **kw)
    gen = torch.Generator().manual_seed(7)
    wo, wh = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    ((o * wo).sum() + (ht * wh).sum()).backward()

    ref = {key: t.detach().double().requires_grad_() for key, t in leaves.items()}
    full = {**{key: t.double() for key, t in xt.items()}, **ref}
    o64, h64 = torch_naive(full["q"], full["k"], full["v"], full["g"], full["beta"], full.get("initial_state"), cu,
                           **_naive_kwargs(kw, full, xt["q"].shape[3]))
    ((o64 * wo.double()).sum() + (h64 * wh.double()).sum()).backward()
    assert rel_err(o.detach().numpy(), o64.detach().numpy()) <= 1e-5
    for key, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, key
        err = rel_err(t.grad.numpy(), ref[key].grad.numpy())
        assert err <= 1e-4, f"{key}: relative error {err:.3g}"  # measured 2e-7..2e-6


def test_chunk_gradients_bfloat16():
    xt, cu, kw = _grad_case("varlen_gva", seed=4)
    xt = {key: (t.bfloat16() if key in ("q", "k", "v", "g", "beta") else t) for key, t in xt.items()}
    leaves = {key: xt[key].clone().requires_grad_() for key in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = kda.chunk_kda(**{**xt, **leaves}, cu_seqlens=torch.tensor(cu), **kw)
    (o.float().sum() + ht.sum()).backward()
    for key, t in leaves.items():
        assert t.grad.dtype == t.dtype and torch.isfinite(t.grad.float()).all(), key


def test_chunk_gradcheck_reference_backend(monkeypatch):
    """torch.autograd.gradcheck through libkda's fp64 reference backend. libkda's tensors are at most float32, so
    the check runs on float32 tensors with a step (1e-3) and tolerances to match (the backend computes in float64
    and rounds its outputs to float32)."""
    from kda import _lib
    monkeypatch.setattr(_lib, "CPU_CONTEXT", (_lib.BACKEND_REFERENCE, 0))
    rng = np.random.default_rng(9)
    x = to_torch(make_inputs(rng, 1, 6, 1, 2, 4, 3, l2=True, gate="softplus", beta_sigmoid=True, state=True))
    A_log = torch.tensor([0.1, -0.3])
    dt_bias = 0.3 * torch.randn(8, generator=torch.Generator().manual_seed(1))
    inputs = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"],
                                                    A_log, dt_bias)]

    def f(q, k, v, g, beta, h0, A_log, dt_bias):
        return kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                             dt_bias=dt_bias, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True)

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "inputs are not double precision"
        assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("which", ["q", "g", "initial_state"])
def test_fused_recurrent_backward_raises(which):
    x, _, opts = case_inputs("basic")
    xt = to_torch(x)
    xt[which] = xt[which].clone().requires_grad_()
    o, h = kda.fused_recurrent_kda(**xt, **opts)
    assert o.requires_grad
    with pytest.raises(NotImplementedError, match="backward is not implemented"):
        (o.sum() + h.sum()).backward()
    assert xt[which].grad is None


def test_no_grad_and_inference_mode():
    x, _, opts = case_inputs("basic")
    xt = to_torch(x)
    xt["q"].requires_grad_()
    with torch.no_grad():
        o1, _ = kda.chunk_kda(**xt, **opts)
    with torch.inference_mode():
        o2, _ = kda.chunk_kda(**xt, **opts)
    assert not o1.requires_grad and torch.equal(o1, o2)


# ---------------------------------------------------------------------------------------------------------
# custom ops: opcheck, torch.compile
# ---------------------------------------------------------------------------------------------------------
def test_opcheck():
    import kda._torch  # noqa: F401  (registers the ops)
    rng = np.random.default_rng(5)
    x = to_torch(make_inputs(rng, 1, 19, 1, 2, 16, 16, state=True, N=2))
    cu = torch.tensor([0, 7, 19])
    common = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None)
    flags = (False, False, False, False, False, 0.0, False)
    torch.library.opcheck(torch.ops.kda.chunk_kda_fwd.default,
                          common + (x["initial_state"], cu, None, 0.25, True) + flags)
    torch.library.opcheck(torch.ops.kda.chunk_kda_fwd.default,
                          common + (x["initial_state"], cu, None, 0.25, True) + flags + (128,))
    torch.library.opcheck(torch.ops.kda.fused_recurrent_kda_fwd.default,
                          common + (x["initial_state"], cu, None, None, 0.25, True) + flags)
    do, dht = torch.randn(1, 19, 2, 16), torch.randn(2, 2, 16, 16)
    torch.library.opcheck(torch.ops.kda.chunk_kda_bwd.default,
                          common + (x["initial_state"], cu, None, do, dht, 0.25) + flags + (True, False, False))
    pool = torch.randn(4, 2, 16, 16)
    o = torch.empty(1, 19, 2, 16)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.kda.fused_recurrent_kda_out.default,
                          common + (None, cu, None, idx, o, pool, True, 0.25) + flags)


def _compile_inputs():
    x, cu, opts = case_inputs("varlen_gva")
    xt = to_torch(x)
    cu_t = torch.tensor(cu, dtype=torch.int64)
    return xt, cu_t, gate_to(opts, "cpu")


def test_compile_aot_eager_fullgraph():
    xt, cu, opts = _compile_inputs()

    def step(q, k, v, g, beta, h0):
        o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **opts)
        o2, _ = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **opts)
        return o + o2, ht

    args = [xt[k] for k in ("q", "k", "v", "g", "beta", "initial_state")]
    eager = step(*args)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_compile_inplace_pool_update():
    rng = np.random.default_rng(6)
    x = to_torch(make_inputs(rng, 3, 1, 1, 2, 16, 16))
    pool = torch.randn(5, 2, 16, 16)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)

    def decode(q, k, v, g, beta, pool, idx):
        o, _ = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                       ssm_state_indices=idx)
        return o * 1.0

    eager_pool = pool.clone()
    o_eager = decode(*(x[k] for k in ("q", "k", "v", "g", "beta")), eager_pool, idx)
    fn = torch.compile(decode, backend="aot_eager", fullgraph=True)
    o_comp = fn(*(x[k] for k in ("q", "k", "v", "g", "beta")), pool, idx)
    assert torch.equal(o_eager, o_comp)
    assert torch.equal(pool, eager_pool)  # the compiled call updated the caller's pool in place


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_compile_inductor():
    xt, cu, opts = _compile_inputs()

    def step(q, k, v, g, beta, h0):
        o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **opts)
        return o.float() * 2, ht

    args = [xt[k] for k in ("q", "k", "v", "g", "beta", "initial_state")]
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True)(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_compiled_backward():
    """torch.compile keeps chunk_kda differentiable (register_autograd): the compiled graph's gradients are the
    eager ones."""
    xt, cu, opts = _compile_inputs()

    def step(q, k, v, g, beta):
        o, _ = kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, **opts)
        return (o * o).sum()

    grads = []
    for fn in (step, torch.compile(step, backend="aot_eager")):
        q = xt["q"].clone().requires_grad_()
        gg = xt["g"].clone().requires_grad_()
        fn(q, xt["k"], xt["v"], gg, xt["beta"]).backward()
        grads.append((q.grad, gg.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# ---------------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------------
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch" if torch else
                                  "torch is not installed (pip install torch): the torch tests need it")


def cuda_call(fn, *args, **kwargs):
    """Run fn; while libkda has no CUDA backend, xfail with its message."""
    try:
        return fn(*args, **kwargs)
    except kda.KDANotSupportedError as e:
        if e.status is not None:  # libkda's own NOT_SUPPORTED
            pytest.xfail(f"libkda's CUDA backend: {e}")
        raise


@requires_gpu
@pytest.mark.parametrize("name", list(TORCH_CASES))
@pytest.mark.parametrize("KV", [64, 128])
def test_cuda_chunk_gradients_against_cpu(name, KV):
    """chunk_kda's gradients on CUDA tensors (libkda's CUDA backward) against the same call on CPU tensors (the CPU
    backward, itself checked against float64 autograd above); float32 tensors, so the difference is the CUDA
    forward's and backward's bf16 chunk blocks."""
    x, cu, opts = case_inputs(name, seed=5, K_V=(KV, KV))
    grads = {}
    for dev in ("cpu", "cuda"):
        xt = to_torch(x, dev)
        kw = gate_to(opts, dev)
        for key in ("A_log", "dt_bias"):
            if key in kw:
                xt[key] = kw.pop(key)
        leaves = {key: xt[key].clone().requires_grad_() for key in GRAD_INPUTS if key in xt}
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device=dev)
        o, ht = cuda_call(kda.chunk_kda, **{**xt, **leaves}, cu_seqlens=cu_t, **kw)
        gen = torch.Generator().manual_seed(9)
        wo, wh = torch.randn(o.shape, generator=gen).to(dev), torch.randn(ht.shape, generator=gen).to(dev)
        cuda_call(lambda: ((o * wo).sum() + (ht * wh).sum()).backward())
        grads[dev] = {key: t.grad for key, t in leaves.items()}
    for key, g_cpu in grads["cpu"].items():
        g_gpu = grads["cuda"][key]
        assert g_gpu is not None and g_gpu.dtype == g_cpu.dtype and g_gpu.shape == g_cpu.shape, key
        err = rel_err(g_gpu.cpu().numpy(), g_cpu.numpy())
        assert err <= 3e-2, f"{key}: relative error {err:.3g} against the CPU backward"


@requires_gpu
@pytest.mark.parametrize("name", ["varlen_gva", "bounded_vfirst", "t1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_saved_blocks_same_gradients(name, dtype, monkeypatch):
    """Under autograd the CUDA forward keeps its chunk blocks for the backward (kda_args_t.saved), which then does
    not rerun its preparation stage: the same gradient bytes as the backward that recomputes them."""
    import kda._ops as kt
    from kda import _api
    monkeypatch.setattr(_api, "_torch_chunk_cached", None)  # every call through kt.saved_tensor
    x, cu, opts = case_inputs(name, seed=11, K_V=(128, 128))
    kept = []
    real = kt.saved_tensor

    def spy(*a):
        t = real(*a)
        kept.append(t)
        return t

    runs = []
    for keep in (True, False):
        monkeypatch.setattr(kt, "saved_tensor", spy if keep else (lambda *a: None))
        xt = to_torch(x, "cuda", dtype=dtype)
        kw = gate_to(opts, "cuda")
        for key in ("A_log", "dt_bias"):
            if key in kw:
                xt[key] = kw.pop(key)
        leaves = {key: xt[key].clone().requires_grad_() for key in GRAD_INPUTS if key in xt}
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device="cuda")
        o, ht = kda.chunk_kda(**{**xt, **leaves}, cu_seqlens=cu_t, **kw)
        gen = torch.Generator().manual_seed(9)
        wo, wh = torch.randn(o.shape, generator=gen).to("cuda"), torch.randn(ht.shape, generator=gen).to("cuda")
        ((o.float() * wo).sum() + (ht * wh).sum()).backward()
        runs.append({key: t.grad for key, t in leaves.items()})
    assert len(kept) == 1 and kept[0] is not None and kept[0].dtype == torch.uint8
    for key, g in runs[0].items():
        assert g is not None and torch.equal(g, runs[1][key]), key


@requires_gpu
@pytest.mark.parametrize("entry", ["chunk", "fused"])
@pytest.mark.parametrize("neg", [False, True])
def test_cuda_beta_sigmoid_in_kernel_same_bits(entry, neg):
    """β's sigmoid inside the kernel gives the bits of torch's float32 sigmoid passed as β (FLA's
    test_chunk_use_beta_sigmoid_in_kernel compares the two): o, the final state and, for chunk_kda, the gradients
    of q, k, v, g and the initial state are equal."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, D = 1, 300, 2, 64
    q, k, v = (torch.rand(B, T, H, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, generator=gen)).to("cuda")
    logit = torch.randn(B, T, H, generator=gen).to("cuda", torch.bfloat16)
    h0 = torch.randn(B, H, D, D, generator=gen).to("cuda")
    do = torch.randn(B, T, H, D, generator=gen).to("cuda", torch.bfloat16)
    dht = torch.randn(B, H, D, D, generator=gen).to("cuda")
    outs = []
    for inside in (True, False):
        leaves = [t.clone().requires_grad_(entry == "chunk") for t in (q, k, v, g, h0)]
        beta = logit if inside else logit.float().sigmoid() * (2.0 if neg else 1.0)
        kw = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg) if inside else {}
        o, ht = ENTRIES[entry](*leaves[:4], beta, initial_state=leaves[4], output_final_state=True,
                               use_qk_l2norm_in_kernel=True, **kw)
        res = [o, ht]
        if entry == "chunk":
            ((o * do).sum() + (ht * dht).sum()).backward()
            res += [t.grad for t in leaves]
        outs.append(res)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@requires_gpu
@pytest.mark.parametrize("entry", ["chunk", "fused"])
@pytest.mark.parametrize("name", list(TORCH_CASES))
@pytest.mark.parametrize("KV", [64, 128])
def test_cuda_against_reference(entry, name, KV):
    x, cu, opts = case_inputs(name, seed=7, K_V=(KV, KV))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device="cuda")
    o, h = cuda_call(ENTRIES[entry], **to_torch(x, "cuda", torch.bfloat16), cu_seqlens=cu_t, **gate_to(opts, "cuda"))
    torch.cuda.synchronize()
    assert o.device.type == "cuda" and o.dtype == torch.bfloat16 and h.dtype == torch.float32
    ref_o, ref_h = reference_of(x, cu, opts, torch.bfloat16)
    assert rel_err(o.float().cpu().numpy(), ref_o) <= 1e-2
    assert rel_err(h.cpu().numpy(), ref_h) <= 1e-2


@requires_gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_cuda_vllm_decode_inplace_pool(pool_dtype):
    rng = np.random.default_rng(8)
    N, HV, K = 4, 4, 128
    x = make_inputs(rng, 1, N, 2, HV, K, K, l2=True)
    pool_np = (0.5 * rng.standard_normal((9, HV, K, K))).astype(np.float32)
    pool = torch.from_numpy(pool_np).to("cuda", pool_dtype)
    before = pool.clone()
    idx = torch.tensor([7, 2, -1, 4], dtype=torch.int32, device="cuda")
    cu = torch.arange(N + 1, dtype=torch.int32, device="cuda")
    o, h = cuda_call(kda.fused_recurrent_kda, **to_torch(x, "cuda", torch.bfloat16), initial_state=pool,
                     inplace_final_state=True, ssm_state_indices=idx, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                     state_v_first=True)
    torch.cuda.synchronize()
    assert h is pool
    rounded = {k: torch.from_numpy(v).bfloat16().double().numpy() for k, v in x.items()}
    ref_o, ref_pool = kda_reference(*(rounded[k] for k in ("q", "k", "v", "g", "beta")),
                                    initial_state=before.double().cpu().numpy(), cu_seqlens=cu.cpu().numpy(),
                                    state_indices=idx.cpu().numpy(), use_qk_l2norm=True, state_v_first=True)
    assert rel_err(o.float().cpu().numpy(), ref_o) <= 1e-2
    for s in (7, 2, 4):
        assert rel_err(pool[s].double().cpu().numpy(), ref_pool[s]) <= 1e-2
    for s in (0, 1, 3, 5, 6, 8):
        assert torch.equal(pool[s], before[s])


@requires_gpu
def test_cuda_graph_capture_and_replay():
    x, cu, opts = case_inputs("varlen_gva", seed=9, K_V=(128, 128))
    static = to_torch(x, "cuda", torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    gopts = gate_to(opts, "cuda")

    def step():
        return kda.chunk_kda(**static, cu_seqlens=cu_t, **gopts)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up (context creation, allocator) outside the capture
            cuda_call(step)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, h_static = step()
    # new inputs in the same memory, then replay
    x2, _, _ = case_inputs("varlen_gva", seed=10, K_V=(128, 128))
    for key, val in to_torch(x2, "cuda", torch.bfloat16).items():
        static[key].copy_(val)
    graph.replay()
    torch.cuda.synchronize()
    o_eager, h_eager = step()
    torch.cuda.synchronize()
    assert torch.equal(o_static, o_eager) and torch.equal(h_static, h_eager)
    ref_o, _ = reference_of(x2, cu, opts, torch.bfloat16)
    assert rel_err(o_static.float().cpu().numpy(), ref_o) <= 1e-2


@requires_gpu
def test_cuda_device_slots_checked_in_eager_calls_only():
    """ssm_state_indices in device memory: an eager call reads them on the host and refuses a repeated or
    out-of-range slot (nothing written); under CUDA graph capture they are not read, and the kernels skip a slot
    out of range at replay."""
    xt = to_torch(make_inputs(np.random.default_rng(12), 1, 2, 1, 2, 64, 64), "cuda")
    pool = torch.ones(4, 2, 64, 64, device="cuda")
    cu, idx = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"), torch.zeros(2, dtype=torch.int32,
                                                                                        device="cuda")

    def step():
        return kda.fused_recurrent_kda(**xt, initial_state=pool, inplace_final_state=True, ssm_state_indices=idx,
                                       cu_seqlens=cu)
    for bad, words in (([1, 1], "are both 1; slots must be distinct"), ([1, 4], "[1] = 4 is not below")):
        idx.copy_(torch.tensor(bad))
        with pytest.raises(ValueError, match=r"'ssm_state_indices'.*" + re.escape(words)):
            step()
        assert bool((pool == 1).all())
    idx.copy_(torch.tensor([2, 3]))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda_call(step)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    before = pool.clone()
    idx.copy_(torch.tensor([1, 9]))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(pool[1], before[1])
    assert all(torch.equal(pool[i], before[i]) for i in (0, 2, 3))


@requires_gpu
def test_cuda_runs_on_the_current_stream_without_host_sync():
    x, _, opts = case_inputs("basic", seed=11, K_V=(64, 64))
    xt = to_torch(x, "cuda", torch.bfloat16)
    cuda_call(kda.chunk_kda, **xt, **opts)  # warm-up: context, workspace sizes
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, h = kda.chunk_kda(**xt, **opts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    s.synchronize()
    o_ref, h_ref = kda.chunk_kda(**xt, **opts)
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)


@requires_gpu
def test_cuda_argument_errors():
    x, cu, opts = case_inputs("varlen_gva", K_V=(64, 64))
    xt = to_torch(x, "cuda", torch.bfloat16)
    gopts = gate_to(opts, "cuda")
    with pytest.raises(ValueError, match="'k'"):
        kda.chunk_kda(**dict(xt, k=xt["k"].cpu()), cu_seqlens=torch.tensor(cu, device="cuda"), **gopts)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda.chunk_kda(**xt, cu_seqlens=torch.tensor(cu), **gopts)
    bad_host = torch.tensor([0, 3, 2, 70, 90])
    with pytest.raises(ValueError, match="cu_seqlens_host"):
        cuda_call(kda.chunk_kda, **xt, cu_seqlens=torch.tensor(cu, device="cuda"), cu_seqlens_cpu=bad_host, **gopts)


# ---------------------------------------------------------------------------------------------------------
# The eager fast path of chunk_kda: a signature that passed the checks before skips them (kda._torch)
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def fast_path(monkeypatch):
    """An empty signature cache, and a count of the calls it served."""
    from kda import _torch
    _torch._chunk_calls.clear()
    served = []
    call, launch = _torch._ChunkCall.__call__, _torch._ChunkCall.launch

    def counted(self, *args):
        served.append(self)
        return call(self, *args)

    def counted_launch(self, *args):  # a training call's forward (launched before autograd records it)
        served.append(self)
        return launch(self, *args)
    monkeypatch.setattr(_torch._ChunkCall, "__call__", counted)
    monkeypatch.setattr(_torch._ChunkCall, "launch", counted_launch)
    yield served
    _torch._chunk_calls.clear()


def uncached(fn, *args, **kwargs):
    """fn with chunk_kda's fast path off: every check made, nothing remembered."""
    from kda import _api
    fast, _api._torch_chunk_cached = _api._torch_chunk_cached, None
    try:
        return fn(*args, **kwargs)
    finally:
        _api._torch_chunk_cached = fast


def assert_same(a, b):
    assert (a[1] is None) == (b[1] is None)
    assert a[0].dtype == b[0].dtype and a[0].shape == b[0].shape and a[0].stride() == b[0].stride()
    assert torch.equal(a[0], b[0])
    if a[1] is not None:
        assert a[1].dtype == b[1].dtype and a[1].shape == b[1].shape and torch.equal(a[1], b[1])


# (case, dtype, changes to the case's options)
FAST_SIGNATURES = [
    ("basic", None, {}),
    ("basic", None, dict(output_final_state=False)),
    ("basic", None, dict(scale=0.0)),
    ("basic", torch.bfloat16, dict(scale=0.5, state_v_first=True)),
    ("varlen_gva", None, {}),
    ("varlen_gva", torch.bfloat16, dict(state_v_first=True)),
    ("bounded_vfirst", None, {}),
    ("bounded_vfirst", None, dict(lower_bound=0.0, safe_gate=False)),  # g replaced by zeros: never cached
    ("t1", torch.float16, dict(initial_state=None)),
    ("basic", None, dict(cp_piece_len=0)),
    ("varlen_gva", None, dict(cp_piece_len=128)),
]


def fast_inputs(name, dtype, changes, seed):
    x, cu, opts = case_inputs(name, seed=seed)
    xt = to_torch(x, dtype=dtype)
    kwargs = dict(gate_to(opts, "cpu"), cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32))
    kwargs.update(changes)
    if "initial_state" in changes:
        xt.pop("initial_state", None)
    return xt, kwargs


def test_fast_path_equals_checked_path(fast_path):
    """Signatures of one shape and of several, interleaved, each with new data at every call: the cached calls
    give what the checked path gives, bit for bit."""
    for rnd in range(3):
        before = len(fast_path)
        for i, (name, dtype, changes) in enumerate(FAST_SIGNATURES):
            xt, kwargs = fast_inputs(name, dtype, changes, seed=100 * rnd + i)
            expected = uncached(kda.chunk_kda, **xt, **kwargs)
            assert_same(kda.chunk_kda(**xt, **kwargs), expected)
    # a shape's first call notes it, a later one caches the signature, the next is served (lower_bound=0.0 never)
    assert len(fast_path) - before == len(FAST_SIGNATURES) - 1


def test_fast_path_new_arguments_of_a_cached_shape(fast_path):
    """After a signature is cached, a call that differs in anything its checks read takes the checked path: a
    non-contiguous tensor, another dtype, nn.Parameter gate inputs, other flags, and errors (same messages)."""
    xt, kwargs = fast_inputs("varlen_gva", None, {}, seed=1)
    for _ in range(3):
        kda.chunk_kda(**xt, **kwargs)
    assert len(fast_path) == 1
    k_strided = torch.cat([xt["k"], xt["k"]], dim=-1)[..., :xt["k"].shape[-1]]
    assert not k_strided.is_contiguous()
    params = dict(A_log=torch.nn.Parameter(kwargs["A_log"]), dt_bias=torch.nn.Parameter(kwargs["dt_bias"]))
    variants = [(dict(xt, k=k_strided), kwargs),
                (dict(xt, beta=xt["beta"].half()), kwargs),
                (xt, dict(kwargs, **params)),
                (xt, dict(kwargs, use_beta_sigmoid_in_kernel=False)),
                (xt, dict(kwargs, cu_seqlens=kwargs["cu_seqlens"].long())),
                (xt, dict(kwargs, cu_seqlens=kwargs["cu_seqlens"].tolist())),
                (xt, dict(kwargs, cp_piece_len=64)),
                (xt, dict(kwargs, cp_piece_len=np.int64(64)))]
    with torch.no_grad():  # the parameters require grad
        for args, kw in variants:
            assert_same(kda.chunk_kda(**args, **kw), uncached(kda.chunk_kda, **args, **kw))
    errors = [(dict(xt, k=xt["k"].half()), kwargs),
              (dict(xt, beta=xt["beta"][:, :-1]), kwargs),
              (dict(xt, beta=xt["beta"].double()), kwargs),
              (xt, dict(kwargs, dt_bias=kwargs["dt_bias"][:-1])),
              (xt, dict(kwargs, cu_seqlens=torch.tensor([0, 3, 2, 70, 90], dtype=torch.int32))),  # found by libkda
              (xt, dict(kwargs, transpose_state_layout=True, state_v_first=True)),
              (xt, dict(kwargs, cp_piece_len=100)),
              (xt, dict(kwargs, cp_piece_len=64.0))]
    for args, kw in errors:
        with pytest.raises(Exception) as cached_err:
            kda.chunk_kda(**args, **kw)
        with pytest.raises(Exception) as checked_err:
            uncached(kda.chunk_kda, **args, **kw)
        assert type(cached_err.value) is type(checked_err.value) and str(cached_err.value) == str(checked_err.value)


def test_fast_path_grad_mode(fast_path):
    """Cached without autograd, then called with a tensor that requires grad: the custom op records the graph."""
    xt, kwargs = fast_inputs("basic", None, {}, seed=2)
    xt["q"].requires_grad_()
    with torch.no_grad():
        for _ in range(3):
            o, _ = kda.chunk_kda(**xt, **kwargs)
    assert len(fast_path) == 1 and not o.requires_grad
    o, h = kda.chunk_kda(**xt, **kwargs)
    assert o.requires_grad and len(fast_path) == 1
    o.float().sum().backward()
    assert xt["q"].grad is not None and xt["q"].grad.shape == xt["q"].shape


def _training_step(fn, xt, cu, kw, need, seed):
    """o, the final state (None if not returned) and every leaf's gradient of one training step through fn"""
    leaves = {key: xt[key].clone().requires_grad_() for key in need if key in xt}
    o, ht = fn(**{**xt, **leaves}, cu_seqlens=cu, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen)).sum()
    if ht is not None:
        loss = loss + (ht * torch.randn(ht.shape, generator=gen)).sum()
    loss.backward()
    return o.detach(), None if ht is None else ht.detach(), {key: t.grad for key, t in leaves.items()}


@pytest.mark.parametrize("name,need,changes", [
    ("varlen_gva", GRAD_INPUTS, {}),
    ("basic", ("q", "v", "initial_state"), dict(output_final_state=False)),
    ("bounded_vfirst", ("k", "g", "A_log"), {}),
])
def test_fast_path_training(fast_path, name, need, changes):
    """Training calls (tensors that require grad) of a signature seen before skip the checks too: o, the final state and every gradient equal the checked path's, bit for bit, with new
    data each call; a call that differs in which tensors require grad takes the checked path."""
    for rnd in range(4):
        xt, cu, kw = _grad_case(name, seed=20 + rnd)
        kw.update(changes)
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int64)
        got = _training_step(kda.chunk_kda, xt, cu, kw, need, seed=rnd)
        expected = _training_step(lambda **a: uncached(kda.chunk_kda, **a), xt, cu, kw, need, seed=rnd)
        assert (got[1] is None) == (expected[1] is None) == ("output_final_state" in changes)
        assert torch.equal(got[0], expected[0]) and (got[1] is None or torch.equal(got[1], expected[1]))
        for key, t in expected[2].items():
            assert got[2][key] is not None and got[2][key].dtype == t.dtype and torch.equal(got[2][key], t), key
    assert len(fast_path) == 2  # a shape's first call notes it, the second caches the signature
    xt, cu, kw = _grad_case(name, seed=30)
    kw.update(changes)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    other = tuple(n for n in GRAD_INPUTS if n in xt and n not in need)[:1]
    for fewer in (need[1:],) + ((need + other,) if other else ()):
        got = _training_step(kda.chunk_kda, xt, cu, kw, fewer, seed=5)
        expected = _training_step(lambda **a: uncached(kda.chunk_kda, **a), xt, cu, kw, fewer, seed=5)
        assert torch.equal(got[0], expected[0])
        for key, t in expected[2].items():
            assert torch.equal(got[2][key], t), key
    assert len(fast_path) == 2


@pytest.fixture
def bwd_fast_path(fast_path, monkeypatch):
    """fast_path, and a count of the backward calls of a cached training signature (those given its memo)."""
    from kda import _ops
    served = []
    bwd = _ops.chunk_bwd

    def counted(*args, memo=None, **kwargs):
        if memo is not None:
            served.append(memo)
        return bwd(*args, memo=memo, **kwargs)
    monkeypatch.setattr(_ops, "chunk_bwd", counted)
    yield served


def _loss_step(fn, xt, cu, kw, need, seed, loss, retain=False):
    """_training_step with a choice of loss: "both" (o and the final state, random weights), "o" (o alone: autograd
    hands the backward zeros for the final state), "ht" (the final state alone: zeros for o), "sum" (o.sum(): an
    expanded, non-contiguous gradient of o). `retain`: backward twice through the same graph (retain_graph), the
    gradients accumulated."""
    leaves = {key: xt[key].clone().requires_grad_() for key in need if key in xt}
    o, ht = fn(**{**xt, **leaves}, cu_seqlens=cu, **kw)
    gen = torch.Generator().manual_seed(seed)
    if loss == "sum":
        total = o.sum()
    elif loss == "ht" and ht is not None:
        total = (ht * torch.randn(ht.shape, generator=gen)).sum()
    else:
        total = (o.float() * torch.randn(o.shape, generator=gen)).sum()
        if ht is not None and loss == "both":
            total = total + (ht * torch.randn(ht.shape, generator=gen)).sum()
    total.backward(retain_graph=retain)
    if retain:
        total.backward()
    return o.detach(), None if ht is None else ht.detach(), {key: t.grad for key, t in leaves.items()}


@pytest.mark.parametrize("name,need,changes", [
    ("varlen_gva", GRAD_INPUTS, {}),
    ("basic", ("q", "v", "initial_state"), dict(output_final_state=False)),
    ("basic", ("k", "beta", "initial_state"), dict(scale=0.0)),
    ("bounded_vfirst", ("k", "g", "A_log"), {}),
    ("t1", ("q", "dt_bias", "initial_state"), {}),
])
def test_fast_path_training_backward(bwd_fast_path, name, need, changes):
    """A cached training signature's backward (its workspace size remembered): with new data every call and
    every kind of loss (incoming gradients of o and the final state given, zero, or non-contiguous), and through
    retain_graph, o, the final state and every gradient equal the checked path's bit for bit, in dtype too. A call
    that differs in which tensors require grad, or in a shape, takes the checked path, forward and backward."""
    losses = ("both", "o", "ht", "sum", "both", "o", "both")
    for rnd, loss in enumerate(losses):
        xt, cu, kw = _grad_case(name, seed=40 + rnd)
        kw.update(changes)
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int64)
        retain = rnd == len(losses) - 1
        got = _loss_step(kda.chunk_kda, xt, cu, kw, need, rnd, loss, retain)
        expected = _loss_step(lambda **a: uncached(kda.chunk_kda, **a), xt, cu, kw, need, rnd, loss, retain)
        assert (got[1] is None) == (expected[1] is None)
        assert torch.equal(got[0], expected[0]) and (got[1] is None or torch.equal(got[1], expected[1]))
        assert got[2].keys() == expected[2].keys()
        for key, t in expected[2].items():
            if t is None:  # an input the loss does not reach (h0 with scale 0 and no final state, ...)
                assert got[2][key] is None, key
                continue
            assert got[2][key] is not None and got[2][key].dtype == t.dtype, key
            assert got[2][key].shape == t.shape and torch.equal(got[2][key], t), (key, loss)
    # the first call notes the shape, the second caches the signature; every later backward (two with
    # retain_graph) is the cached signature's
    assert len(bwd_fast_path) == len(losses) - 2 + 1
    served = len(bwd_fast_path)
    xt, cu, kw = _grad_case(name, seed=50)
    kw.update(changes)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    other = tuple(n for n in GRAD_INPUTS if n in xt and n not in need)[:1]
    for fewer in (need[1:],) + ((need + other,) if other else ()):
        got = _loss_step(kda.chunk_kda, xt, cu, kw, fewer, 5, "both")
        expected = _loss_step(lambda **a: uncached(kda.chunk_kda, **a), xt, cu, kw, fewer, 5, "both")
        for key, t in expected[2].items():
            assert torch.equal(got[2][key], t), key
    assert len(bwd_fast_path) == served  # other requires-grad sets: other signatures, checked
    longer = {key: (torch.cat([t, t[:, :1]], dim=1) if key in ("q", "k", "v", "g", "beta") else t)
              for key, t in xt.items()}
    if cu is None:  # one token more per row: another shape
        got = _loss_step(kda.chunk_kda, longer, None, kw, need, 6, "both")
        expected = _loss_step(lambda **a: uncached(kda.chunk_kda, **a), longer, None, kw, need, 6, "both")
        for key, t in expected[2].items():
            assert torch.equal(got[2][key], t), key
        assert len(bwd_fast_path) == served


def test_fast_path_training_backward_varlen_lengths(bwd_fast_path):
    """One cached varlen signature (the number of sequences fixed) with other lengths each call: the CPU
    backward's workspace follows the longest sequence, so a remembered size may be too small (the call is made
    again with the size libkda asks for) or larger than needed; the gradients equal the checked path's."""
    from kda import _lib, _torch
    L = _lib.library()
    queries = []
    query = L.backward_workspace_size
    xt, _, kw = _grad_case("varlen_gva", seed=60)
    T = xt["q"].shape[1]
    # the third call's backward is remembered with the longest sequence 30; the fourth needs more (87), the
    # fifth less (45)
    sizes = []
    for rnd, lens in enumerate(([3, 0, 67, 20], [30, 30, 10, 20], [10, 30, 30, 20], [1, 1, 1, 87], [45, 45, 0, 0])):
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64)
        assert int(cu[-1]) == T
        L.backward_workspace_size = lambda *a: queries.append(rnd) or query(*a)
        try:
            got = _loss_step(kda.chunk_kda, xt, cu, kw, GRAD_INPUTS, rnd, "both")
        finally:
            L.backward_workspace_size = query
        expected = _loss_step(lambda **a: uncached(kda.chunk_kda, **a), xt, cu, kw, GRAD_INPUTS, rnd, "both")
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        for key, t in expected[2].items():
            assert torch.equal(got[2][key], t), key
        calls = [c for calls in _torch._chunk_calls.values() for c in calls.values()]
        sizes.append(calls[0].bwd_nbytes if calls else None)
    assert len(bwd_fast_path) == 3
    # checked backwards ask for the size; the remembered one asks again only where it fell short
    assert queries == [0, 1, 2, 3]
    assert sizes[2] < sizes[3] == sizes[4]


def test_fast_path_workspace_too_small(fast_path):
    """A remembered workspace size that no longer suffices (more CPU threads since, or simply wrong) is never
    handed to libkda as if it did: the call is made again with the size libkda asks for."""
    from kda import _torch
    xt, kwargs = fast_inputs("varlen_gva", None, {}, seed=3)
    expected = uncached(kda.chunk_kda, **xt, **kwargs)
    threads = kda.get_num_threads()
    try:
        kda.set_num_threads(1)
        for _ in range(3):
            assert_same(kda.chunk_kda(**xt, **kwargs), expected)
        (call,) = [c for calls in _torch._chunk_calls.values() for c in calls.values()]
        one = call.nbytes
        assert one > 0
        kda.set_num_threads(3)
        assert_same(kda.chunk_kda(**xt, **kwargs), expected)
        assert call.nbytes > one
        for wrong in (0, 1, one - 1):
            call.nbytes = wrong
            assert_same(kda.chunk_kda(**xt, **kwargs), expected)
            assert call.nbytes > one
    finally:
        kda.set_num_threads(threads)
    assert len(fast_path) == 5


def test_fast_path_cache_is_bounded(fast_path):
    from kda import _torch
    rng = np.random.default_rng(4)
    for T in range(1, _torch._MAX_SHAPES + 20):
        x = to_torch(make_inputs(rng, 1, T, 1, 1, 16, 16))
        for _ in range(2):
            kda.chunk_kda(**x)
    assert len(_torch._chunk_calls) <= _torch._MAX_SHAPES
    x = to_torch(make_inputs(rng, 1, 7, 1, 1, 16, 16))
    for s in range(_torch._MAX_CALLS + 5):
        kda.chunk_kda(**x, scale=1.0 + s)
        kda.chunk_kda(**x, scale=1.0 + s)
    assert all(len(calls) <= _torch._MAX_CALLS for calls in _torch._chunk_calls.values())


@requires_gpu
def test_cuda_fast_path(fast_path):
    """CUDA: cached calls equal checked ones, on the current stream; a misaligned tensor of a cached signature
    gets the checked path's error message."""
    x, cu, opts = case_inputs("varlen_gva", seed=12, K_V=(64, 64))
    xt = to_torch(x, "cuda", torch.bfloat16)
    kw = dict(gate_to(opts, "cuda"), cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda"),
              cu_seqlens_cpu=torch.tensor(cu, dtype=torch.int32))
    expected = cuda_call(uncached, kda.chunk_kda, **xt, **kw)
    for _ in range(3):
        got = kda.chunk_kda(**xt, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        on_s = kda.chunk_kda(**xt, **kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert len(fast_path) == 2
    assert_same(got, expected)
    assert_same(on_s, expected)
    q = xt["q"]
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape).copy_(q)
    errs = []
    for f in (kda.chunk_kda, lambda **a: uncached(kda.chunk_kda, **a)):
        with pytest.raises(kda.KDAError) as e:
            f(**dict(xt, q=misaligned), **kw)
        errs.append(str(e.value))
    assert errs[0] == errs[1] and "aligned" in errs[0]


@requires_gpu
@pytest.mark.parametrize("name,host_copy", [("varlen_gva", True), ("varlen_gva", False), ("basic", False)])
def test_cuda_fast_path_training(bwd_fast_path, name, host_copy):
    """CUDA training steps of a cached signature (its forward keeping its blocks, its backward's workspace size
    remembered): o, the final state and every gradient equal the checked path's bit for bit, with new data each
    step, on the current stream (one step on a side stream)."""
    def step(fn, xt, kw, seed, stream=None):
        leaves = {key: xt[key].clone().requires_grad_() for key in GRAD_INPUTS if key in xt}
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            o, ht = fn(**{**xt, **leaves}, **kw)
            gen = torch.Generator().manual_seed(seed)
            wo, wh = torch.randn(o.shape, generator=gen).cuda(), torch.randn(ht.shape, generator=gen).cuda()
            ((o.float() * wo).sum() + (ht * wh).sum()).backward()
        torch.cuda.synchronize()
        return o.detach(), ht.detach(), {key: t.grad for key, t in leaves.items()}

    side = torch.cuda.Stream()
    for rnd in range(6):
        x, cu, opts = case_inputs(name, seed=70 + rnd, K_V=(64, 64))
        xt = to_torch(x, "cuda", torch.bfloat16)
        kw = gate_to(opts, "cuda")
        for key in ("A_log", "dt_bias"):
            if key in kw:
                xt[key] = kw.pop(key)
        if cu is not None:
            kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
            if host_copy:
                kw["cu_seqlens_cpu"] = torch.tensor(cu, dtype=torch.int32)
        got = cuda_call(step, kda.chunk_kda, xt, kw, rnd, side if rnd == 5 else None)
        expected = step(lambda **a: uncached(kda.chunk_kda, **a), xt, kw, rnd)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        for key, t in expected[2].items():
            assert got[2][key] is not None and got[2][key].dtype == t.dtype and torch.equal(got[2][key], t), key
    assert len(bwd_fast_path) == 4  # the third step's backward on: a cached signature's


# ---------------------------------------------------------------------------------------------------------
# return_intermediate_states (kda_args_t.chunk_states): the state before every 64-token chunk, inference only
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("vfirst", [False, True])
def test_return_intermediate_states(device, varlen, vfirst):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    rng = np.random.default_rng(5)
    B, T, H, HV, K, V = (1, 300, 1, 2, 64, 64) if varlen else (2, 150, 1, 2, 64, 64)
    lens = [130, 0, 64, 106] if varlen else None
    cu = None if lens is None else np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    N = len(lens) if varlen else B
    x = make_inputs(rng, B, T, H, HV, K, V, state=True, N=N, state_v_first=vfirst)
    xt = to_torch(x, device, torch.bfloat16)
    cu_t = None if cu is None else torch.from_numpy(cu).to(device)
    opts = dict(cu_seqlens=cu_t, output_final_state=True, state_v_first=vfirst)
    with pytest.raises(AssertionError, match="inference mode"):
        kda.chunk_kda(**xt, return_intermediate_states=True, **opts)
    with torch.inference_mode():
        with pytest.raises(AssertionError, match="disable_recompute"):
            kda.chunk_kda(**xt, return_intermediate_states=True, disable_recompute=True, **opts)
        o, ht, h = kda.chunk_kda(**xt, return_intermediate_states=True, **opts)
        o2, ht2 = kda.chunk_kda(**xt, **opts)
    seq_lens = lens if varlen else [T] * B
    nt = sum((n + 63) // 64 for n in seq_lens) if varlen else (T + 63) // 64
    tail = (V, K) if vfirst else (K, V)
    assert h.shape == ((1, nt, HV) + tail if varlen else (B, nt, HV) + tail) and h.dtype == torch.bfloat16
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    rows = h.reshape(-1, HV, *tail).float().cpu()
    # each sequence's rows: its initial state, then the final state of its first 64 c tokens
    row, off = 0, 0
    for n, L in enumerate(seq_lens):
        for c in range((L + 63) // 64):
            if c == 0:
                want = xt["initial_state"][n].float().cpu()
            else:
                sl = slice(off, off + 64 * c)
                if varlen:
                    part = {k: t[:, sl] for k, t in xt.items() if k != "initial_state"}
                else:
                    part = {k: t[n:n + 1, :64 * c] for k, t in xt.items() if k != "initial_state"}
                with torch.inference_mode():
                    _, want = kda.chunk_kda(**part, initial_state=xt["initial_state"][n:n + 1], output_final_state=True,
                                            state_v_first=vfirst)
                want = want[0].cpu()
            err = ((rows[row] - want).norm() / want.norm()).item()
            assert err <= 1e-2, f"sequence {n} chunk {c}: {err:.3g}"
            row += 1
        off += L
    assert row == (nt if varlen else B * nt)  # h's rows: nt per sequence, or Σ nt of the sequences (varlen)
