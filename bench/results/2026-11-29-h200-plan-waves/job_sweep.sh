#!/usr/bin/env bash
# The forward's piece count where the pre-scan spills into a second wave: cp_sweep at B1 T32768 H32 and neighbours.
set -uo pipefail
OUT=${OUT:-/tmp/kda-out}; mkdir -p $OUT /tmp/kda-logs; L=/tmp/kda-logs
T0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DKDA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" >$L/c.log 2>&1 && cmake --build build-gpu -j16 -- libkda.so >$L/b.log 2>&1; echo "build rc=$? $(( $(date +%s) - T0 )) s"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
PY="PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site PYTHONUNBUFFERED=1"
env KDA_LIBRARY=$PWD/build-gpu/libkda.so $PY timeout 400 python3 bench/cp_sweep.py "B1 T32768 H32:103,128,171,256" "T16384 H32:64,86,128" \
  "T32768 H16:103,128,171,205" "single T65536 H8:64,114" "T65536 H16:128,171,205" 2>&1 | grep -v Warn | tee $OUT/sweep.log
echo "done $(( $(date +%s) - T0 )) s"
