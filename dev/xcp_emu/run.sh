#!/bin/sh
# Host emulation of the cross-rank CP kernels of src/cuda/xcp/xcp.cu (the fold, the primed forward's apply) against
# their arithmetic done serially: dev/xcp_emu/run.sh [cases]. No GPU; g++ compiles the CUDA C as C++ (the launchers,
# and their host helper, which use the <<<>>> syntax and the runtime, are cut out first; no FMA contraction, as the
# references assume).
set -e
W=$(cd "$(dirname "$0")/../.." && pwd); E=$W/dev/xcp_emu; B=${TMPDIR:-/tmp}/xcp_emu
mkdir -p $B
cp $E/common.cuh $W/dev/bwd_emu/mma_tf32.cuh $B/
python3 - "$W/src/cuda/xcp/xcp.cu" "$B/xcp.cu" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
s = s.replace("extern __shared__ double fold_smem[];", "double *fold_smem = (double *)emu_smem;")
s = s.replace("extern __shared__ __align__(16) float apply_smem[];", "float *apply_smem = (float *)emu_smem;")
out, i = [], 0
for m in re.finditer(r'(extern "C" int|static cudaError_t) [^{]*\{', s):  # drop each launcher and host helper
    if m.start() < i:
        continue
    out.append(s[i:m.start()])
    depth, j = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        j += 1
    i = j
out.append(s[i:])
open(sys.argv[2], "w").write("".join(out))
PY
g++ -x c++ -std=c++17 -O1 -ffp-contract=off -w -I$B -I$W/src/cuda/common -I$W/src -I$W/include $E/xcp_emu.cu -o $B/xcp_emu -lpthread
$B/xcp_emu "${1:-81}"
