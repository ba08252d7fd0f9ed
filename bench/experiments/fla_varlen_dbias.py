"""FLA's test_chunk_varlen case [H4-D64-mask_p0.9-cu_seqlens[0,256,500,1000]-fp16-gate] (its inputs, made as the
test makes them), every gradient's error ratio (FLA's get_err_ratio) for FLA's chunk_kda and libkda's against the
test's reference (naive_recurrent_kda on the inputs as given) and against the same reference in float64.

    FLA_FLASH_KDA=0 KDA_LIBRARY=build-gpu/libkda.so PYTHONPATH=python:.fla python3 bench/experiments/fla_varlen_dbias.py
"""
import torch
import torch.nn.functional as F

import kda
from fla.ops.kda import chunk_kda as fla_chunk_kda
from fla.ops.kda.gate import naive_kda_gate
from fla.ops.kda.naive import naive_recurrent_kda
from fla.utils import device


def ratio(x, y):
    err = (x.detach().double() - y.detach().double()).flatten().square().mean().sqrt().item()
    return err / ((x.detach().double()).flatten().square().mean().sqrt().item() + 1e-8)


def case(H=4, D=64, mask_p=0.9, cu=(0, 256, 500, 1000), dtype=torch.float16):
    torch.manual_seed(42)
    cu_seqlens = torch.LongTensor(list(cu)).to(device)
    T, N = cu[-1], len(cu) - 1
    q = torch.randn((1, T, H, D), dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, D, dtype=torch.float32), p=2, dim=-1).to(dtype)
    v = torch.randn((1, T, H, D), dtype=dtype)
    g = torch.randn(1, T, H, D, dtype=dtype)
    A_log = torch.log(torch.randn(1, 1, H, 1, dtype=torch.float32, device=device).uniform_(1, 16))
    dt_bias = torch.randn(H * D, dtype=torch.float32, device=device)
    mask = torch.rand_like(g) > mask_p
    g = g * mask + (~mask) * (-1000)
    beta = torch.rand(1, T, H, dtype=dtype).sigmoid()
    h0 = torch.randn((N, H, D, D), dtype=torch.float32)
    q, k, v, g, beta, h0 = map(lambda x: x.to(device).requires_grad_(), (q, k, v, g, beta, h0))
    A_log, dt_bias = map(lambda x: x.to(device).requires_grad_(), (A_log, dt_bias))
    do = torch.randn_like(v)
    dht = torch.rand_like(h0)
    leaves = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, A_log=A_log, dt_bias=dt_bias)
    return leaves, do, dht, cu_seqlens, N


def recurrent64(L, s, i):
    """The definition token by token in float64 (the gate, the l2norm of q, the delta rule), one sequence."""
    d = lambda t: t.double()
    q = F.normalize(d(L["q"][0, s]), p=2, dim=-1)
    k, v, beta = d(L["k"][0, s]), d(L["v"][0, s]), d(L["beta"][0, s])
    H, K = q.shape[1], q.shape[2]
    x = d(L["g"][0, s]) + d(L["dt_bias"]).view(H, K)
    gl = -d(L["A_log"]).view(H, 1).exp() * F.softplus(x)
    S = d(L["h0"][i])
    os = []
    for t in range(q.shape[0]):
        S = S * gl[t].exp()[..., None]
        u = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * u)
        os.append(torch.einsum("hk,hkv->hv", q[t] * K ** -0.5, S))
    return torch.stack(os, 0)[None], S[None]


def grads(fn, L, do, dht, cu, N, ref=False, f64=False):
    for t in L.values():
        t.grad = None
    if ref:
        outs, hts = [], []
        for i in range(N):
            s = slice(int(cu[i]), int(cu[i + 1]))
            if f64:
                o, ht = recurrent64(L, s, i)
            else:
                gi = naive_kda_gate(L["g"][:, s].float(), L["A_log"].float(), L["dt_bias"].float())
                o, ht = naive_recurrent_kda(q=F.normalize(L["q"][:, s], p=2, dim=-1), k=L["k"][:, s], v=L["v"][:, s],
                                            beta=L["beta"][:, s], g=gi, initial_state=L["h0"][i],
                                            output_final_state=True)
            outs.append(o)
            hts.append(ht)
        o, ht = torch.cat(outs, 1), torch.cat(hts, 0)
    else:
        o, ht = fn(q=F.normalize(L["q"].clone(), p=2, dim=-1), k=L["k"].clone(), v=L["v"].clone(), g=L["g"].clone(),
                   beta=L["beta"].clone(), A_log=L["A_log"].clone(), dt_bias=L["dt_bias"].clone(),
                   initial_state=L["h0"].clone(), output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
                   use_gate_in_kernel=True, safe_gate=False)
    ((o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum()).backward()
    return {k: t.grad.detach().clone() for k, t in L.items()}


L, do, dht, cu, N = case()
ref = grads(None, L, do, dht, cu, N, ref=True)
ref64 = grads(None, L, do, dht, cu, N, ref=True, f64=True)
res = {"FLA": grads(fla_chunk_kda, L, do, dht, cu, N), "libkda": grads(kda.chunk_kda, L, do, dht, cu, N)}
print("ratio against the test's reference (naive_recurrent_kda, as given) / against it in float64")
print("%-8s" % "", " ".join("%16s" % k for k in ref))
for name, gr in res.items():
    print("%-8s" % name, " ".join("%7.5f/%7.5f" % (ratio(ref[k], gr[k]), ratio(ref64[k], gr[k])) for k in ref))
print("%-8s" % "test ref", " ".join("%7.5f/%7.5f" % (0.0, ratio(ref64[k], ref[k])) for k in ref))
print("FLA's bars: dq 0.007 dk 0.008 dv 0.007 dg 0.015 db 0.015 dh0 0.007 dA 0.008 (warning) dbias 0.005")
