#!/usr/bin/env bash
# prep v7 (.v7, 1505991) and v7b (.v7b, 23f0b3a) against main (the tree): forward A/B (stages.py, 2 rounds),
# prep ncu (duration, instructions) at B1 T32768 H32, forward GPU tests on v7b, sanitizers on v7b.
set -uo pipefail
OUT=${OUT:-/tmp/kda-out}; mkdir -p $OUT /tmp/kda-logs; L=/tmp/kda-logs
T0=$(date +%s)
G="arch=compute_90a,code=sm_90a"
b() { cmake -S $2 -B $1 -G Ninja -DKDA_CUDA_GENCODE="$G" >$L/c-$1.log 2>&1 && cmake --build $1 -j6 "${@:3}" >$L/b-$1.log 2>&1; rc=$?; echo "build $1 rc=$rc"; [ $rc = 0 ] || grep -m5 error $L/b-$1.log; }
b build-base . -- libkda.so & b build-v7 .v7 -- libkda.so & b build-v7b .v7b & wait
echo "builds $(( $(date +%s) - T0 )) s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
PY="PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site PYTHONUNBUFFERED=1"
[ -n "${SKIPT:-}" ] || (cd build-v7b && timeout 200 ctest -R '^gpu_fwd' -j1 > $OUT/gpu_tests.log 2>&1; echo "ctest rc=$?"; grep -E "tests passed|tests failed|Failed|\*\*\*" $OUT/gpu_tests.log | head)
echo "tests done $(( $(date +%s) - T0 )) s"
for r in 1 2; do for w in base v7 v7b; do
  echo "== $w round $r" | tee -a $OUT/ab.log
  env KDA_LIBRARY=$PWD/build-$w/libkda.so $PY timeout 60 python3 bench/stages.py --sets all \
    --shapes B2T8192H64 B1T32768H32 T65536H8 V6 K64B2T8192H64 K256B2T8192H32 2>&1 | grep --line-buffered -v Warn | tee -a $OUT/ab.log
done; done
echo "timing done $(( $(date +%s) - T0 )) s"
for w in base v7 v7b; do
  env KDA_LIBRARY=$PWD/build-$w/libkda.so $PY timeout 40 ncu -k regex:kda_prep_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --metrics smsp__inst_executed.sum,sm__warps_launched.sum python3 bench/stages.py --shapes B1T32768H32 --sets all --reps 1 > $L/ncu.log 2>&1
  echo "prep $w: $(grep -E '^ +Duration' $L/ncu.log | awk '{print $NF, $(NF-1)}' | head -1) $(grep -E 'smsp__inst_executed.sum|sm__warps_launched.sum' $L/ncu.log | awk '{print $1, $NF}' | tr '\n' ' ')" | tee -a $OUT/prep_ncu.log
done
[ -n "${SKIPT:-}" ] || for tool in memcheck racecheck; do for t in gpu_fwd_varlen_empty_seq gpu_fwd_cp_sanitize; do
  [ $(( $(date +%s) - T0 )) -gt 540 ] && { echo "skip $tool $t (time)" | tee -a $OUT/san.log; continue; }
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 build-v7b/tests/test_gpu $t > $L/san.log 2>&1
  echo "$tool $t rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $L/san.log | head -1)" | tee -a $OUT/san.log
done; done
echo "== summary $(( $(date +%s) - T0 )) s"; sed -e "s|$PWD/||" $OUT/ab.log | cut -c1-150; cat $OUT/prep_ncu.log
grep -E "tests passed|tests failed" $OUT/gpu_tests.log; cat $OUT/san.log
