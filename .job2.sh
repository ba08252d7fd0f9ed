#!/usr/bin/env bash
# session 2026-11-28c, H200: fine blocks (QΓ_lo) for fp16/fp32 inputs — build, FLA's tests (bg), every GPU test,
# acc training_fp32 with FLA, sanitizers on the fp32/fp16 backward test
R=/tmp/job2; mkdir -p $R/build $R/fla $R/tests $R/acc
env OUT=$R/build scripts/gpu-check.sh none 2>&1 | tail -2
( env OUT=$R/fla scripts/gpu-check.sh fla > $R/fla/step.log 2>&1 ) &
env OUT=$R/tests scripts/gpu-check.sh tests 2>&1 | tail -3
grep -E "bwd (f32|fp32|fp16|k256_sanitize_fp32)|fp32|f16" $R/tests/gpu_tests.log | grep -E "^[0-9]+: bwd" | head -20 > $R/tests/bwd_fp32_rows.log
env OUT=$R/acc ACC_ARGS="--seeds 2 --cases training_fp32,k64_bf16" ACC_TIMEOUT=150 scripts/gpu-check.sh acc 2>&1 | tail -6
for tool in memcheck racecheck; do
  timeout 70 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/test_gpu_bwd gpu_bwd_fp32_fp16 > $R/tests/san_$tool.log 2>&1
  echo "$tool gpu_bwd_fp32_fp16 rc=$? $(tail -1 $R/tests/san_$tool.log)"
done | tee $R/tests/sanitizers.log
wait
tail -4 $R/fla/step.log
