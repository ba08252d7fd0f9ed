#!/bin/sh
# Host emulation of the CP plan's CTA (src/cuda/cp/cp_plan.cuh) at 256, 512 and 1024 threads against the host planner
# (src/cp_plan.h) on random problems: dev/cp_plan_emu/run.sh [cases]. No GPU; g++ compiles the CUDA C as C++.
# cp_plan.cuh and seq.cuh are copied beside this folder's stand-in common.cuh (a quoted include looks in the
# including file's folder first).
set -e
W=$(cd "$(dirname "$0")/../.." && pwd); E=$W/dev/cp_plan_emu; B=${TMPDIR:-/tmp}/cp_plan_emu
mkdir -p $B
cp $W/src/cuda/cp/cp_plan.cuh $W/src/cuda/common/seq.cuh $E/common.cuh $B/
g++ -x c++ -std=c++17 -O1 -w -I$B -I$W/src/cuda/common -I$W/src/cuda/fwd -I$W/src/cuda/cp -I$W/src/cuda/decode -I$W/src/cuda/bwd -I$W/src -I$W/include $E/plan_emu.cu -o $B/plan_emu -lpthread
$B/plan_emu "$@"
