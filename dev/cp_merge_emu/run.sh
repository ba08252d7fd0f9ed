#!/bin/sh
# Host emulation of the CP merge (src/cuda/cp/cp_merge.cu) against its arithmetic done serially, on random piece tables:
# dev/cp_merge_emu/run.sh [cases] [merge source, default src/cuda/cp/cp_merge.cu]. No GPU; g++ compiles the CUDA C as
# C++ (no FMA contraction: the kernel's own fmaf calls are its only fused operations). The source is copied beside
# this folder's stand-in common.cuh, its dynamic shared memory declaration made a pointer to the emulated buffer.
set -e
W=$(cd "$(dirname "$0")/../.." && pwd); E=$W/dev/cp_merge_emu; B=${TMPDIR:-/tmp}/cp_merge_emu
SRC=${2:-$W/src/cuda/cp/cp_merge.cu}
mkdir -p $B
cp $E/common.cuh $W/dev/bwd_emu/mma_tf32.cuh $B/
sed 's/extern __shared__ __align__(16) float msm\[\];/float *msm = (float *)emu_smem;/' "$SRC" > $B/cp_merge.cu
g++ -x c++ -std=c++17 -O1 -ffp-contract=off -w -I$B -I$W/src/cuda/common -I$W/src/cuda/fwd -I$W/src/cuda/cp -I$W/src/cuda/decode -I$W/src/cuda/bwd -I$W/src -I$W/include $E/merge_emu.cu -o $B/merge_emu -lpthread
$B/merge_emu "${1:-40}"
