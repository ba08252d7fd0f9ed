#!/bin/sh
# Host emulation of the chunk preparation kernel (src/cuda/fwd/prep.cuh): a candidate source against a reference source,
# the workspace blocks they write on the same random problems compared byte for byte, so that a restructure of the
# kernel can be checked without a GPU. No GPU needed; g++ compiles the CUDA C as C++ (-x c++, no FMA contraction)
# with dev/bwd_emu's shim (a pthread per CUDA thread, mma.sync and ldmatrix from their fragment layouts) and this
# folder's stand-in common.cuh; each source is copied with its dynamic shared memory declaration made a pointer to
# the emulated CTA's, and compiled in a namespace of its own (prep_inst.emu.cu), its own launcher choosing the grid.
#   dev/prep_emu/run.sh [cases] [candidate, default src/cuda/fwd/prep.cuh] [reference, default git show HEAD:src/cuda/fwd/prep.cuh]
#   PREP_EMU_TOL=1e-2 dev/prep_emu/run.sh ...   a candidate whose roundings differ: where bytes differ, each region's
#     values (W, QG, Kt, Aqk, gamma, U; the lo parts reported only) as ‖cand − ref‖ / ‖ref‖ over the case, each at
#     most the tolerance; the guards and NaN positions still exact. Checked: K̃ × 1.001 gives Kt 1.4e-3 and nothing
#     else; U stored 1 KB on gives U 1.4 (and W 5.6 where it runs into the next block)
# cases: all (the default) or a comma-separated list of case numbers (harness.emu.cu's table: the classes 64, 128
# and 256 of K and V, K = V = 128 the most; sizes off the classes (EXACT = 0: 100/72, 63/33, 62/50, 200/150); bf16,
# fp16 and fp32 inputs; varlen with int32 and int64 offsets, lengths 1, 63, 65, 70, 129, T = 1; GVA; the l2norm or
# not; the gate given or in kernel (softplus with A_log and dt_bias, the lower-bound form); β sigmoid, allow_neg_eigval,
# scale; strong decay (the diagonal blocks' per-pair exponentials); non-finite rows; fine blocks). The
# candidate's launcher must keep the name kda_prep_launch<KD, VD>: its grid (CTAs, threads, shared memory) is the one
# run, so a kernel with another grid is compared as it would launch. seq.cuh and cp_plan.cuh come from the working
# tree for both; params.plan stays 0 (the CP piece table CTA is not run).
# One line per case and a final PASS or MISMATCH line (exit status 1). Compared: the whole workspace, poisoned with
# 0xA5 before each kernel, with guard zones on both sides; the inputs must stay unchanged. Case 0 also checks the
# reference's γ and Aqk's diagonal against a float64 computation from the inputs, so the emulation is known to do
# the kernel's arithmetic. The emulated SFU functions (ex2, rcp, rsqrt) are libm's: the bytes are not the GPU's,
# only the same for two sources that do the same arithmetic.
# Self-checks when the tool was written (2 cores, about 35 s for all 18 cases with the build):
#   run.sh (src/cuda/fwd/prep.cuh against HEAD's): PASS on all 18 cases (also a check that the emulation is
#     deterministic: 256 or 512 threads a CTA give the same bytes twice)
#   altered copies as the candidate, each MISMATCH in the cases of its path: the lower-bound gate's 1.0f → 1.0001f
#     (cases 2, 13); diag_block_exact's Aqk sum × 1.001 (cases 3, 17); poison_block's NaN bits (case 5); the 8-byte
#     copies skipping a row (case 10); K̃_lo × 1.0001 (7 cases with KDA_FINE_KT); solve_slab's Y × 1.00001 (16
#     cases); U stored 1 KB on (every case); 128 bytes past the last block (the guard zone; case 0: an unused
#     block); a store into q (the input check); a candidate that does not compile: exit status 1
#   case 0's math check: γ worst relative error 1.9e-6, Aqk's diagonal 3.7e-3 (bf16's unit roundoff 2^-8 = 3.9e-3)
set -e
W=$(cd "$(dirname "$0")/../.." && pwd); E=$W/dev/prep_emu; B=${TMPDIR:-/tmp}/prep_emu
CAND=${2:-$W/src/cuda/fwd/prep.cuh}
mkdir -p $B
if [ -n "$3" ]; then cp "$3" $B/ref.src; else git -C "$W" show HEAD:src/cuda/fwd/prep.cuh > $B/ref.src; fi
cp "$CAND" $B/cand.src
cp $W/src/cuda/common/seq.cuh $W/src/cuda/cp/cp_plan.cuh $E/common.cuh $W/dev/bwd_emu/shim.h $W/dev/bwd_emu/mma_tf32.cuh $B/
cp $W/dev/bwd_emu/common.cuh $B/bwd_common.cuh
for s in cand ref; do
  sed -E 's/extern __shared__ __align__\(([0-9]+)\) unsigned char ([A-Za-z_0-9]+)\[\];/unsigned char *\2 = EMU_SMEM;/' \
    $B/$s.src > $B/prep_$s.cuh
  if grep -q 'extern __shared__' $B/prep_$s.cuh; then echo "run.sh: $s: a shared memory declaration not rewritten" >&2; exit 2; fi
done
F="-w -std=c++17 -O1 -ffp-contract=off -I$B -I$W/src/cuda/common -I$W/src/cuda/fwd -I$W/src/cuda/cp -I$W/src/cuda/decode -I$W/src/cuda/bwd -I$W/src -I$W/include -I/usr/local/cuda/include"
rm -f $B/cand.o $B/ref.o $B/harness.o $B/launch.o $B/prep_emu # (a failed compile must not leave an older object to link)
g++ -x c++ $F -DPREP_NS=cand '-DPREP_SRC="prep_cand.cuh"' -c $E/prep_inst.emu.cu -o $B/cand.o & pc=$!
g++ -x c++ $F -DPREP_NS=ref '-DPREP_SRC="prep_ref.cuh"' -c $E/prep_inst.emu.cu -o $B/ref.o & pr=$!
g++ -x c++ $F -c $E/harness.emu.cu -o $B/harness.o
g++ -x c++ $F -c $W/dev/bwd_emu/launch.emu.cu -o $B/launch.o
wait $pc
wait $pr
g++ -o $B/prep_emu $B/harness.o $B/launch.o $B/cand.o $B/ref.o -lpthread -lm
$B/prep_emu "${1:-all}" "${PREP_EMU_TOL:-}"
