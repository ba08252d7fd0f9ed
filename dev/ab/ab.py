"""A/B of two builds on one GPU (dev/ab/prepare.sh, phase1.sh, phase2.sh). `hash`: a sha256 per output of fixed cases
(forward, backward, decode, CP, options); `time`: medians (ms) of the standard shapes. KDA_LIBRARY picks the library,
PYTHONPATH the package."""
import hashlib, sys, os, statistics
import torch
import kda

dev = torch.device("cuda")

def gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g

def rnd(g, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

def inputs(seed, B, T, H, HV, K, V, dtype=torch.bfloat16, strong=False, gate_in=False):
    g = gen(seed)
    q = rnd(g, B, T, H, K, dtype=dtype)
    k = rnd(g, B, T, H, K, dtype=dtype)
    v = rnd(g, B, T, HV, V, dtype=dtype)
    if gate_in:
        gg = rnd(g, B, T, HV, K, dtype=dtype)
    else:
        gg = (-torch.rand(B, T, HV, K, generator=g) * (8.0 if strong else 0.5)).to(dtype).to(dev)
    beta = torch.rand(B, T, HV, generator=g).to(dtype).to(dev)
    return q, k, v, gg, beta

def h(t):
    if t is None:
        return "none"
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

def fwd_case(name, seed, B, T, H, HV, K, V, dtype=torch.bfloat16, h0=False, cu=None, gate_in=False, strong=False,
             l2=True, cp=None, bwd=False, bsig=False, lb=None, svf=False):
    q, k, v, g, beta = inputs(seed, B, T, H, HV, K, V, dtype, strong, gate_in)
    if bsig:
        beta = (beta.float() * 4 - 2).to(dtype)
    N = (len(cu) - 1) if cu is not None else B
    gen2 = gen(seed + 1)
    init = None
    if h0:
        shp = (N, HV, V, K) if svf else (N, HV, K, V)
        init = (torch.randn(*shp, generator=gen2) * 0.1).float().to(dev)
    kw = {}
    if gate_in:
        kw["A_log"] = (torch.rand(HV, generator=gen2) * 2 - 1).float().to(dev)
        kw["dt_bias"] = (torch.randn(HV * K, generator=gen2) * 0.1).float().to(dev)
    if cp is not None:
        kw["cp_piece_len"] = cp
    cus = torch.tensor(cu, dtype=torch.int32, device=dev) if cu is not None else None
    leaves = [q, k, v, g, beta] + ([init] if init is not None else [])
    if bwd:
        for t in leaves:
            t.requires_grad_(True)
        for t in kw.values():
            if isinstance(t, torch.Tensor):
                t.requires_grad_(True)
    o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate_in, use_beta_sigmoid_in_kernel=bsig,
                          lower_bound=lb, state_v_first=svf, cu_seqlens=cus, **kw)
    out = [(name + ".o", o), (name + ".ht", ht)]
    if bwd:
        gd = gen(seed + 2)
        do = torch.randn(o.shape, generator=gd).to(o.dtype).to(dev)
        dht = torch.randn(ht.shape, generator=gd).float().to(dev) * 0.1
        torch.autograd.backward([o, ht], [do, dht])
        names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
        for n_, t in zip(names, leaves):
            out.append((f"{name}.{n_}", t.grad))
        for n_, t in kw.items():
            if isinstance(t, torch.Tensor):
                out.append((f"{name}.d{n_}", t.grad))
    return out

def dec_case(name, seed, N, HV, H, K, V, T=1, pool=0, dtype=torch.bfloat16, gate_in=False):
    q, k, v, g, beta = inputs(seed, 1 if pool == 0 else N, T, H, HV, K, V, dtype, False, gate_in)
    gen2 = gen(seed + 1)
    kw = {}
    if gate_in:
        kw = dict(A_log=(torch.rand(HV, generator=gen2) * 2 - 1).float().to(dev),
                  dt_bias=(torch.randn(HV * K, generator=gen2) * 0.1).float().to(dev))
    if pool:
        st = (torch.randn(pool, HV, K, V, generator=gen2) * 0.1).float().to(dev)
        idx = torch.randperm(pool, generator=gen2)[:N].to(torch.int32).to(dev)
        o, ht = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=st, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in,
                                        ssm_state_indices=idx, inplace_final_state=True, **kw)
        return [(name + ".o", o), (name + ".pool", st)]
    st = (torch.randn(1, HV, K, V, generator=gen2) * 0.1).float().to(dev)
    o, ht = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=st, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in, **kw)
    return [(name + ".o", o), (name + ".ht", ht)]

def hash_cases():
    C = []
    C += fwd_case("f_bf16_T8192", 1, 1, 8192, 16, 16, 128, 128, h0=True)
    C += fwd_case("f_T1", 2, 2, 1, 4, 4, 128, 128, h0=True)
    C += fwd_case("f_T65", 3, 1, 65, 4, 4, 128, 128)
    C += fwd_case("f_varlen_empty", 4, 1, 1300 + 547 + 963, 8, 8, 128, 128, h0=True, cu=[0, 1300, 1300, 1847, 2810])
    C += fwd_case("f_gva4", 5, 1, 2048, 4, 16, 128, 128, h0=True)
    C += fwd_case("f_k64", 6, 1, 2048, 8, 8, 64, 64)
    C += fwd_case("f_k100v72", 7, 1, 1000, 8, 8, 100, 72, h0=True)
    C += fwd_case("f_k256", 8, 1, 1024, 4, 4, 256, 256, h0=True)
    C += fwd_case("f_fp16", 9, 1, 777, 4, 4, 128, 128, dtype=torch.float16)
    C += fwd_case("f_fp32", 10, 1, 500, 4, 4, 128, 128, dtype=torch.float32, h0=True)
    C += fwd_case("f_gate", 11, 1, 1500, 4, 4, 128, 128, gate_in=True, lb=-5.0)
    C += fwd_case("f_gate_nolb", 12, 1, 600, 4, 4, 128, 128, gate_in=True)
    C += fwd_case("f_strong", 13, 1, 900, 4, 4, 128, 128, strong=True, h0=True)
    C += fwd_case("f_bsig_svf", 14, 1, 700, 4, 4, 128, 128, bsig=True, h0=True, svf=True)
    C += fwd_case("f_cp_auto", 15, 1, 32768, 4, 4, 128, 128, h0=True)
    C += fwd_case("f_cp_forced", 16, 1, 8192, 4, 4, 128, 128, h0=True, cp=1024)
    C += fwd_case("f_cp_off", 16, 1, 8192, 4, 4, 128, 128, h0=True, cp=0)
    C += fwd_case("f_cp_varlen", 17, 1, 20000 + 300 + 9000, 4, 4, 128, 128, cu=[0, 20000, 20300, 29300], cp=2048)
    C += fwd_case("b_bf16", 20, 1, 2048, 4, 4, 128, 128, h0=True, bwd=True)
    C += fwd_case("b_gate", 21, 1, 1100, 4, 4, 128, 128, gate_in=True, lb=-5.0, bwd=True, h0=True)
    C += fwd_case("b_varlen", 22, 1, 1300 + 547 + 963, 4, 4, 128, 128, h0=True, cu=[0, 1300, 1300, 1847, 2810],
                  bwd=True)
    C += fwd_case("b_gva", 23, 1, 1024, 2, 8, 128, 128, bwd=True)
    C += fwd_case("b_k64", 24, 1, 1024, 4, 4, 64, 64, bwd=True)
    C += fwd_case("b_k256", 25, 1, 512, 2, 2, 256, 256, bwd=True, h0=True)
    C += fwd_case("b_fp32", 26, 1, 300, 2, 2, 128, 128, dtype=torch.float32, bwd=True)
    C += fwd_case("b_cp", 27, 1, 32768, 2, 2, 128, 128, bwd=True, h0=True)
    C += dec_case("d_pool", 30, 64, 32, 32, 128, 128, pool=100)
    C += dec_case("d_gva_gate", 31, 16, 32, 8, 128, 128, pool=40, gate_in=True)
    C += dec_case("d_seq", 32, 1, 8, 8, 128, 128, T=37)
    C += dec_case("d_k64", 33, 8, 16, 16, 64, 64, pool=20)
    torch.cuda.synchronize()
    for n, t in C:
        print(n, h(t))

def bench(fn, iters=20, warm=5):
    """Median ms per call; each sample times enough calls back to back for ~3 ms of GPU work, so that the host's
    per-call time overlaps the queue and the sample measures the kernels."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
    a.record(); fn(); b.record(); b.synchronize()
    reps = max(1, min(200, int(3.0 / max(a.elapsed_time(b), 1e-3))))
    ts = []
    for _ in range(iters):
        a.record()
        for _ in range(reps):
            fn()
        b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    return statistics.median(ts)

def time_cases():
    rows = []
    only = os.environ.get("AB_SHAPES", "").split(",")  # a comma-separated subset of the names below; empty: all
    want = lambda name: only == [""] or name in only
    def fwd(name, B, T, H, HV, K=128, V=128, cu=None, h0=True):
        if not want(name):
            return
        q, k, v, g, beta = inputs(99, B, T, H, HV, K, V, gate_in=True)
        N = len(cu) - 1 if cu else B
        A_log = torch.rand(HV, device=dev); dt = torch.randn(HV * K, device=dev) * 0.1
        init = torch.randn(N, HV, K, V, device=dev) * 0.1 if h0 else None
        cus = torch.tensor(cu, dtype=torch.int32, device=dev) if cu else None
        f = lambda: kda.chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt,
                                  cu_seqlens=cus)
        rows.append((name, bench(f)))
    def train(name, B, T, H, HV, K=128, V=128):
        if not want(name):
            return
        q, k, v, g, beta = inputs(98, B, T, H, HV, K, V)
        for t in (q, k, v, g, beta):
            t.requires_grad_(True)
        do = torch.randn(B, T, HV, V, device=dev).to(torch.bfloat16)
        def f():
            o, _ = kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
            o.backward(do)
        rows.append((name, bench(f, iters=10, warm=3)))
    def dec(name, N, H, HV, pool):
        if not want(name):
            return
        q, k, v, g, beta = inputs(97, N, 1, H, HV, 128, 128)
        st = torch.randn(pool, HV, 128, 128, device=dev) * 0.1
        idx = torch.randperm(pool, device=dev)[:N].to(torch.int32)
        f = lambda: kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=st, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, ssm_state_indices=idx,
                                            inplace_final_state=True)
        rows.append((name, bench(f, iters=50)))
    fwd("fwd_B2T8192H64", 2, 8192, 64, 64)
    fwd("fwd_B1T8192H64", 1, 8192, 64, 64)
    fwd("fwd_B8T4096H32", 8, 4096, 32, 32)
    fwd("fwd_B1T512H64", 1, 512, 64, 64)
    fwd("fwd_B1T32768H32", 1, 32768, 32, 32)
    fwd("fwd_V8x1024H64", 1, 8192, 64, 64, cu=[i * 1024 for i in range(9)])
    c6 = [0]
    for n in [1300, 547, 2048, 963, 271, 3063]:
        c6.append(c6[-1] + n)
    fwd("fwd_varlen6H64", 1, c6[-1], 64, 64, cu=c6)
    fwd("fwd_GVA16x64", 2, 8192, 16, 64)
    fwd("fwd_T65536H8", 1, 65536, 8, 8)
    fwd("fwd_K64_B2T8192H32", 2, 8192, 32, 32, K=64, V=64)
    fwd("fwd_K256_B2T8192H32", 2, 8192, 32, 32, K=256, V=256)
    train("train_B2T8192H32", 2, 8192, 32, 32)
    train("train_B1T32768H16", 1, 32768, 16, 16)
    dec("dec_N256H32", 256, 32, 32, 512)
    dec("dec_N32H32", 32, 32, 32, 64)
    for n, t in rows:
        print(f"{n} {t:.4f}")

if __name__ == "__main__":
    (hash_cases if sys.argv[1] == "hash" else time_cases)()
