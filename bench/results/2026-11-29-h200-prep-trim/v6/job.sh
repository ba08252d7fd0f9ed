#!/usr/bin/env bash
# prep v6 (wip/9-prep-trim: v5 + the solve's staging addresses by pan_off_r8) against main (.base): forward A/B
# (stages.py, 2 rounds), cp_time T65536 H8, prep ncu (duration, instructions) at B1 T32768 H32, the forward GPU
# tests, memcheck/racecheck on varlen + CP tests.
# Before: rm -rf .base && mkdir .base && git archive main | tar -x -C .base; carry .base .whl .job23.sh .kda-commit
set -uo pipefail
OUT=${OUT:-/tmp/kda-out}; mkdir -p $OUT /tmp/kda-logs; L=/tmp/kda-logs
T0=$(date +%s)
G="arch=compute_90a,code=sm_90a"
b() { cmake -S $2 -B $1 -G Ninja -DKDA_CUDA_GENCODE="$G" >$L/c-$1.log 2>&1 && cmake --build $1 -j8 >$L/b-$1.log 2>&1; rc=$?; echo "build $1 rc=$rc"; [ $rc = 0 ] || grep -m5 error $L/b-$1.log; }
b build-gpu . & b build-base .base & wait
echo "builds $(( $(date +%s) - T0 )) s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
PY="PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site PYTHONUNBUFFERED=1"
(cd build-gpu && timeout 240 ctest -R '^gpu_fwd' -j1 > $OUT/gpu_tests.log 2>&1; echo "ctest rc=$?"; grep -E "tests passed|tests failed|Failed|\*\*\*" $OUT/gpu_tests.log | head)
echo "tests done $(( $(date +%s) - T0 )) s"
for r in 1 2; do for w in base gpu; do
  echo "== $w round $r" | tee -a $OUT/ab.log
  env KDA_LIBRARY=$PWD/build-$w/libkda.so $PY timeout 100 python3 bench/stages.py --sets all \
    --shapes B2T8192H64 B1T32768H32 T65536H8 V6 K64B2T8192H64 K256B2T8192H32 2>&1 | grep --line-buffered -v Warn | tee -a $OUT/ab.log
  env KDA_LIBRARY=$PWD/build-$w/libkda.so $PY timeout 60 python3 bench/experiments/cp_time.py "single T65536 H8" 2>&1 |
    grep --line-buffered -v Warn | tee -a $OUT/ab.log
done; done
echo "timing done $(( $(date +%s) - T0 )) s"
for w in base gpu; do for sh in B1T32768H32; do
  env KDA_LIBRARY=$PWD/build-$w/libkda.so $PY timeout 40 ncu -k regex:kda_prep_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --metrics smsp__inst_executed.sum,sm__warps_launched.sum python3 bench/stages.py --shapes $sh --sets all --reps 1 > $L/ncu.log 2>&1
  echo "prep $w $sh: $(grep -E '^ +Duration' $L/ncu.log | awk '{print $NF, $(NF-1)}' | head -1) $(grep -E 'smsp__inst_executed.sum|sm__warps_launched.sum' $L/ncu.log | awk '{print $1, $NF}' | tr '\n' ' ')" | tee -a $OUT/prep_ncu.log
done; done
for tool in memcheck racecheck; do for t in gpu_fwd_varlen_empty_seq gpu_fwd_cp_sanitize; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/test_gpu $t > $L/san.log 2>&1
  echo "$tool $t rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $L/san.log | head -1)" | tee -a $OUT/san.log
done; done
echo "== summary $(( $(date +%s) - T0 )) s"; sed -e "s|$PWD/||" $OUT/ab.log | cut -c1-150; cat $OUT/prep_ncu.log
grep -E "tests passed|tests failed" $OUT/gpu_tests.log; cat $OUT/san.log
