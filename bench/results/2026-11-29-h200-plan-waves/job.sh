#!/usr/bin/env bash
# The plan's pre-scan wave rule (tree: wip/9-plan-waves) against main (.base): GPU fwd + bwd tests on the tree,
# cp_sweep's auto rows of both builds, two alternated rounds.
set -uo pipefail
OUT=${OUT:-/tmp/kda-out}; mkdir -p $OUT /tmp/kda-logs; L=/tmp/kda-logs
T0=$(date +%s)
G="arch=compute_90a,code=sm_90a"
b() { cmake -S $2 -B $1 -G Ninja -DKDA_CUDA_GENCODE="$G" >$L/c-$1.log 2>&1 && cmake --build $1 -j$3 "${@:4}" >$L/b-$1.log 2>&1; rc=$?; echo "build $1 rc=$rc"; [ $rc = 0 ] || grep -m5 error $L/b-$1.log; }
b build-gpu . 10 & b build-base .base 6 -- libkda.so & wait
echo "builds $(( $(date +%s) - T0 )) s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
PY="PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site PYTHONUNBUFFERED=1"
(cd build-gpu && timeout 280 ctest -R '^gpu_(fwd|bwd)' -j1 > $OUT/gpu_tests.log 2>&1; echo "ctest rc=$?"; grep -E "tests passed|tests failed|Failed|\*\*\*" $OUT/gpu_tests.log | head)
echo "tests done $(( $(date +%s) - T0 )) s"
for r in 1 2; do for w in base gpu; do
  echo "== $w round $r" | tee -a $OUT/ab.log
  env KDA_LIBRARY=$PWD/build-$w/libkda.so $PY timeout 100 python3 bench/cp_sweep.py "B1 T32768 H32:128,171" "T16384 H32:64,86" \
    "T16384 H24:52,64" "single T65536 H8:64" 2>&1 | grep --line-buffered -v Warn | tee -a $OUT/ab.log
done; done
echo "== summary $(( $(date +%s) - T0 )) s"; grep -E "^[A-Za-z]|auto|==" $OUT/ab.log
grep -E "tests passed|tests failed" $OUT/gpu_tests.log
