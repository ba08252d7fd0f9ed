#!/bin/sh
# The cross-rank fold and apply timed alone (bench.cu), or the apply's variants beside it (variants.cu, checked
# against its output): sh dev/xcp_bench/run.sh [variants] on a machine with a Hopper GPU.
set -e
W=$(cd "$(dirname "$0")/../.." && pwd)
SRC=$W/dev/xcp_bench/${1:-bench}.cu
nvcc -arch=sm_90a -O3 -I$W/src/cuda/xcp -I$W/src/cuda/common -I$W/src -I$W/include $SRC -o ${TMPDIR:-/tmp}/xcp_${1:-bench}
${TMPDIR:-/tmp}/xcp_${1:-bench}
