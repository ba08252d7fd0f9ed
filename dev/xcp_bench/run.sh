#!/bin/sh
# The cross-rank fold and apply timed alone (bench.cu): sh dev/xcp_bench/run.sh on a machine with a Hopper GPU.
set -e
W=$(cd "$(dirname "$0")/../.." && pwd)
nvcc -arch=sm_90a -O3 -I$W/src/cuda/xcp -I$W/src/cuda/common -I$W/src -I$W/include $W/dev/xcp_bench/bench.cu \
    -o ${TMPDIR:-/tmp}/xcp_bench
${TMPDIR:-/tmp}/xcp_bench
