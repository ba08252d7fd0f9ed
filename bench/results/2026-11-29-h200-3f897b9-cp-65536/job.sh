#!/usr/bin/env bash
# main after the plan-waves merge: CP tests, sanitizer, bench_cp T65536 shapes with FLA; the sweep's PNG.
OUT=${OUT:-/tmp/kda-out}; mkdir -p $OUT
GTEST_RE='^gpu_fwd_cp' CP_SAN_TESTS=gpu_fwd_cp_sanitize CP_BENCH_ARGS="--only 65536 --quick" CP_BENCH_TIMEOUT=330 bash scripts/gpu-check.sh cp
python3 bench/cp_sweep.py --plot $OUT/sweep.png bench/results/2026-11-29-h200-plan-waves/sweep_main.log && echo png ok
