"""bench/bwd_accuracy.py's inputs for one case and seed, as the emulator's EMU_INPUTS file (float32: q k v g beta
A_log dt_bias h0 do dht), so that the host emulation runs on exactly what the GPU's `acc` check ran on.

    PYTHONPATH=python:bench python3 dev/bwd_emu/acc_inputs.py strong_decay_bf16 0 /tmp/sd0.bin
    dev/bwd_emu/run.sh build     (run.sh ARGS runs the harness as last built)
    EMU_INPUTS=/tmp/sd0.bin EMU_T=300 dev/bwd_emu/run.sh 128 128 1 0 2 5 4 4     (K V gate vfirst blocks mode HQK HV)
Cases of equal-length sequences only (mode 5: EMU_B sequences of EMU_T tokens).
"""
import sys

from bwd_accuracy import CASES, make

name, seed, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
B, T, HQK, HV, K, dtype, gscale = CASES[name]
assert not isinstance(T, list), "equal-length sequences only (not varlen)"
x, w, _ = make(B, T, HQK, HV, K, dtype, gscale, seed=seed)
with open(path, "wb") as f:
    for t in (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"], w["do"], w["dht"]):
        f.write(t.float().contiguous().numpy().tobytes())
print(f"{name} seed {seed}: B {B} T {T} HQK {HQK} HV {HV} K {K} -> {path}; run with EMU_B={B} EMU_T={T}, args {K} {K} 1 0 2 5 {HQK} {HV}")
