#!/usr/bin/env bash
# session 2026-11-28c, H200, wip/11-kt-lo: one dev build; k64 and strong-decay gradients (libkda; FLA's figures on
# these inputs are known); the forward with and without K̃_lo (stages.py all / all-nokt); the forward and backward tests
R=${OUT:-/tmp/job3}; mkdir -p $R
t0=$(date +%s)
cmake -S . -B build-dev -G Ninja -DKDA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" -DKDA_DEV=ON > $R/cmake.log 2>&1
cmake --build build-dev -j16 > /tmp/build.log 2>&1 || { grep -E "error" /tmp/build.log | head -20; exit 1; }
grep -E "Potential|spill" /tmp/build.log | sort | uniq -c | sort -rn | head -20 > $R/ptxas.log
echo "build $(( $(date +%s) - t0 )) s; $(grep -c Potential /tmp/build.log) wgmma warnings"
PY="env KDA_LIBRARY=$PWD/build-dev/libkda.so PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1"
$PY timeout 70 python3 bench/bwd_accuracy.py --seeds 2 --cases k64_bf16,strong_decay_bf16,training_bf16 --fla-cases none 2>&1 | grep --line-buffered -v Warn | tee $R/acc.log
$PY timeout 100 python3 bench/stages.py --sets all all-nokt --shapes B2T8192H64 V6 B1T32768H32 K64B2T8192H64 2>&1 | grep --line-buffered -v Warn | tee $R/stages.log
(cd build-dev && timeout 150 ctest -R "^gpu_(fwd|bwd|contract)" -j1 --timeout 100 > $R/gpu_tests.log 2>&1)
grep -E "tests passed|tests failed|\*\*\*Failed|Failed  " $R/gpu_tests.log | head
