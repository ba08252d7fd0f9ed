#!/usr/bin/env bash
# session 2026-11-28c, H200, HEAD e7c7ccc: FLA beside libkda on the bf16 cases without same-run FLA figures, and training_fp32
R=/tmp/job1; mkdir -p $R/build $R/accA $R/accB $R/tc
env OUT=$R/build scripts/gpu-check.sh none 2>&1 | tail -3
( env OUT=$R/accB ACC_ARGS="--seeds 2 --cases training_fp32" ACC_TIMEOUT=380 scripts/gpu-check.sh acc > $R/accB/step.log 2>&1 ) &
sleep 5
env OUT=$R/accA ACC_ARGS="--seeds 2 --cases training_bf16,strong_decay_bf16,varlen_bf16,varlen6_bf16" ACC_TIMEOUT=380 scripts/gpu-check.sh acc 2>&1 | tail -5
wait
env OUT=$R/tc scripts/gpu-check.sh tritoncache 2>&1 | tail -3
