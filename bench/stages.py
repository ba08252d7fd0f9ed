"""Stage timings of the CUDA backend: the development skip bits (src/cuda/common/kda_cuda.h, KDA_SKIP) leave phases
out, so the difference to the full run is what a phase costs. Results are wrong while bits are set. The bits
exist only in a development build (cmake -DKDA_DEV=ON), which exports kda_dev_set_tuning; with a shipped build
only the "all" set (no bits) can be timed.

    KDA_LIBRARY=build-dev/libkda.so PYTHONPATH=python python3 bench/stages.py [--shapes ...] [--sets ...]

One process, inputs made on the GPU once per shape, CUDA events; each set's figure is GPU time per call of calls
enqueued back to back (median of --reps groups), so that host time does not blur the differences.
"""
import argparse
import itertools
import os
import time

import ctypes

import torch

import kda
from timing import back_to_back_ms

SHAPES = {
    "B2T8192H64": (2, 8192, 64, 64),
    "B1T32768H32": (1, 32768, 32, 32),
    "B1T8192H64": (1, 8192, 64, 64),
    "B1T512H64": (1, 512, 64, 64),
    "B8T4096H32": (8, 4096, 32, 32),
    "GVA": (2, 8192, 16, 64),
    "V8x1024": (1, 8192, 64, 64, [1024] * 8),
    "V6": (1, 8192, 64, 64, [1300, 547, 2048, 963, 271, 3063]),
    # issue 9's CP shapes (auto plan: split), for ncu of the CP kernels
    "T65536H8": (1, 65536, 8, 8),
    "GVAT65536": (1, 65536, 2, 8),
    # other head sizes: (B, T, HQK, HV, lengths or None, K = V)
    "K64B2T8192H64": (2, 8192, 64, 64, None, 64),
    "K64V8x1024": (1, 8192, 64, 64, [1024] * 8, 64),
    "K256B2T8192H32": (2, 8192, 32, 32, None, 256),
    "K100B2T8192H32": (2, 8192, 32, 32, None, 100),
}
# name: (skip bits, forced BV or None[, "mma": the mma.sync recurrence where wgmma would run])
SETS = {
    "all": (0, None), "prep": (16, None), "rec": (8, None),
    "prep-A": (16 | 1, None), "prep-TII": (16 | 2, None), "prep-WU": (16 | 4, None), "prep-gate": (16 | 32, None),
    "prep-norm": (16 | 64, None), "prep-step3": (16 | 128, None), "prep-out": (16 | 256, None),
    "prep-skeleton": (16 | 231, None),
    # prep alone at one CTA (8 warps) an SM, results right: the producer of a fused CTA (issue 55) against "prep"
    "prep-solo": (16 | 4096, None),
    "rec-nocopy": (8 | 1024, None), "rec-nomath": (8 | 2048, None), "rec-empty": (8 | 3072, None),
    # the recurrence by mma.sync where it would use wgmma: A/B in one build
    "all-mma": (0, None, "mma"), "rec-mma": (8, None, "mma"), "rec-nocopy-mma": (8 | 1024, None, "mma"),
}


def inputs(B, T, HQK, HV, lens=None, K=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    x = dict(q=r(B, T, HQK, K), k=r(B, T, HQK, K), v=r(B, T, HV, K), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=(torch.rand(HV, generator=g, device="cuda") * 2.0 - 1.0).float(),
             dt_bias=(0.5 * torch.randn(HV * K, generator=g, device="cuda")).float(),
             initial_state=(0.1 * torch.randn(B if lens is None else len(lens), HV, K, K, generator=g,
                                              device="cuda")).float())
    if lens is not None:  # varlen: one row of T = sum(lens) tokens
        x["cu_seqlens"] = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32,
                                       device="cuda")
    return x


def run(x):
    return kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                         A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=-5.0, output_final_state=True, state_v_first=True,
                         cu_seqlens=x.get("cu_seqlens"))


def dev_tuning():
    """kda_dev_set_tuning(skip, bv, rec_mma, stages) of a development build, or None."""
    lib = ctypes.CDLL(os.environ.get("KDA_LIBRARY", "libkda.so"))
    try:
        f = lib.kda_dev_set_tuning
    except AttributeError:
        return None
    f.argtypes = [ctypes.c_int] * 4
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["B2T8192H64", "B1T32768H32"])
    ap.add_argument("--sets", nargs="*", default=["all", "prep", "rec"])
    ap.add_argument("--bv", nargs="*", default=[])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--legacy-env", action="store_true", help="a library built before the development switches "
                    "moved to KDA_DEV builds: set its KDA_DEV_* variables instead")
    ap.add_argument("--host", action="store_true", help="also the host time per call and back-to-back GPU time")
    a = ap.parse_args()
    tune = dev_tuning()
    if tune is None and any(SETS[n][0] or len(SETS[n]) > 2 for n in a.sets):
        if not a.legacy_env:
            raise SystemExit("these sets need a development build (cmake -DKDA_DEV=ON): kda_dev_set_tuning not found")

        def tune(skip, bv, mma, stages):  # builds before 2026-11-23 read these variables (A/Bs against them)
            for k, v in (("KDA_DEV_SKIP", skip), ("KDA_DEV_BV", bv), ("KDA_DEV_REC_MMA", mma)):
                if v:
                    os.environ[k] = str(v)
                else:
                    os.environ.pop(k, None)
    for s in a.shapes:
        x = inputs(*SHAPES[s])
        cells = []
        for name in a.sets:
            skip, bv = SETS[name][:2]
            mma = 1 if len(SETS[name]) > 2 else 0
            for b in ([bv] if not a.bv or not name.startswith("rec") else a.bv):
                if tune:
                    tune(skip, int(b or 0), mma, 0)
                t = back_to_back_ms(lambda: run(x), reps=a.reps)
                cells.append("%s%s %.3f" % (name, "/bv%s" % b if b else "", t))
        if tune:
            tune(0, 0, 0, 0)
        if a.host:
            # host time of one call (the GPU runs behind), and GPU time per call of 20 calls back to back
            run(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                run(x)
            host = (time.perf_counter() - t) / 20 * 1e3
            b2b = back_to_back_ms(lambda: run(x), reps=1, group=20)
            cells.append("host/call %.3f | back-to-back/call %.3f" % (host, b2b))
        print("%-12s " % s + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
