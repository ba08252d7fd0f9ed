#!/usr/bin/env python3
"""Host overhead of one kda.chunk_kda / kda.fused_recurrent_kda call on a tiny CPU (numpy) problem.

Compares, on the same problem and the same workspace:
  C     kda_forward (or kda_decode) called directly through ctypes with a prebuilt kda_args_t;
  py    kda.chunk_kda (or kda.fused_recurrent_kda) on numpy arrays: argument checks, output allocation, the
        workspace query, the same C call.
Each figure is the median over many blocks of the mean time per call in a block.

    KDA_LIBRARY=build/libkda.so PYTHONPATH=python python3 bench/python_overhead.py [--threads 1]
"""

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import kda  # noqa: E402
from kda import _lib  # noqa: E402


def problem(T, H, HV, K, V, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, T, H, K)).astype(np.float32)
    k = rng.standard_normal((1, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, T, HV, V)).astype(np.float32)
    g = np.log(rng.uniform(0.5, 1.0, (1, T, HV, K))).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (1, T, HV)).astype(np.float32)
    return q, k, v, g, beta


def direct_call(decode, q, k, v, g, beta):
    """A prebuilt kda_args_t and workspace, and a closure that calls the C entry point only."""
    L = _lib.library()
    ctx = _lib.get_context(_lib.BACKEND_CPU, 0)
    a = _lib.KdaArgs.from_buffer_copy(L.template)
    B, T, H, K = q.shape
    a.batch, a.seq_len, a.num_qk_heads, a.num_v_heads, a.head_dim_k, a.head_dim_v = B, T, H, v.shape[2], K, v.shape[3]
    o = np.empty(v.shape, np.float32)
    a.dtype = a.g_dtype = a.beta_dtype = a.o_dtype = _lib.FLOAT32
    a.q, a.k, a.v, a.g, a.beta, a.o = (x.ctypes.data for x in (q, k, v, g, beta, o))
    size_fn = L.decode_workspace_size if decode else L.forward_workspace_size
    run_fn = L.decode if decode else L.forward
    n = ctypes.c_size_t()
    st = size_fn(ctx.handle, ctypes.byref(a), ctypes.byref(n))
    assert st == 0, L.error(st)
    ws = ctx.host_workspace(n.value) if n.value else None  # the workspace kda's calls use too
    nbytes, handle, pa = n.value, ctx.handle, ctypes.byref(a)

    def call():
        st = run_fn(handle, pa, ws, nbytes, None)
        if st:
            raise L.error(st)
    return call, o


def timeit(fn, blocks, per_block):
    for _ in range(per_block * 5):  # warm-up
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(blocks):
        t0 = clock()
        for _ in range(per_block):
            fn()
        samples.append((clock() - t0) / per_block / 1e3)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="CPU backend threads (default 1: least noise)")
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--per-block", type=int, default=50)
    ap.add_argument("--torch", action="store_true", help="also time torch CPU tensors (the custom-op path)")
    args = ap.parse_args()
    kda.set_num_threads(args.threads)
    worst = 0.0
    print(f"libkda {kda.library_version()} at {kda.library_path()}; CPU backend, {args.threads} thread(s); "
          f"median over {args.blocks} blocks of {args.per_block} calls")
    print(f"{'call':<28} {'shape (B,T,H,HV,K,V)':<22} {'C (us)':>9} {'kda (us)':>9} {'overhead (us)':>14}")
    for name, decode, T in (("chunk_kda", False, 1), ("chunk_kda", False, 16), ("fused_recurrent_kda", True, 1),
                            ("fused_recurrent_kda", True, 16)):
        H = HV = 1
        K = V = 64
        q, k, v, g, beta = problem(T, H, HV, K, V)
        c_call, o_c = direct_call(decode, q, k, v, g, beta)
        entry = kda.fused_recurrent_kda if decode else kda.chunk_kda

        def py_call():
            entry(q, k, v, g, beta)
        o_py, _ = entry(q, k, v, g, beta)
        c_call()
        assert np.array_equal(o_py, o_c), "the two paths must compute the same thing"
        t_c = timeit(c_call, args.blocks, args.per_block)
        t_py = timeit(py_call, args.blocks, args.per_block)
        print(f"{name:<28} {str((1, T, H, HV, K, V)):<22} {t_c:9.2f} {t_py:9.2f} {t_py - t_c:14.2f}")
        worst = max(worst, t_py - t_c)
        if args.torch:
            import torch
            qt, kt, vt, gt, bt = (torch.from_numpy(x) for x in (q, k, v, g, beta))

            def torch_call():
                entry(qt, kt, vt, gt, bt)
            assert torch.equal(entry(qt, kt, vt, gt, bt)[0], torch.from_numpy(o_c))
            t_t = timeit(torch_call, args.blocks, args.per_block)
            label = name + " (torch)"
            print(f"{label:<28} {str((1, T, H, HV, K, V)):<22} {t_c:9.2f} {t_t:9.2f} {t_t - t_c:14.2f}")
    print(f"largest numpy-path overhead: {worst:.2f} us (target <= 20 us above the C call)")


if __name__ == "__main__":
    main()
