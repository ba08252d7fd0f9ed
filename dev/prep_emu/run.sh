#!/bin/sh
# Host emulation of the chunk preparation kernel (src/cuda/prep.cuh): a candidate source against a reference source,
# the workspace blocks they write on the same random problems compared byte for byte, so that a restructure of the
# kernel can be checked without a GPU. No GPU needed; g++ compiles the CUDA C as C++ (-x c++, no FMA contraction)
# with dev/bwd_emu's shim (a pthread per CUDA thread, mma.sync and ldmatrix from their fragment layouts) and this
# folder's stand-in common.cuh; each source is copied with its dynamic shared memory declaration made a pointer to
# the emulated CTA's, and compiled in a namespace of its own (prep_inst.emu.cu), its own launcher choosing the grid.
#   dev/prep_emu/run.sh [cases] [candidate, default src/cuda/prep.cuh] [reference, default git show HEAD:src/cuda/prep.cuh]
# cases: all (the default) or a comma-separated list of case numbers (harness.emu.cu's table); the candidate's
# launcher must keep the name kda_prep_launch<KD, VD>. PREP_EMU_256=1 adds the classes (256, 256) and a case of them.
# One line per case and a final PASS or MISMATCH line (exit status 1). Case 0 also checks the reference's γ and
# Aqk's diagonal against a float64 computation from the inputs, so the emulation is known to do the arithmetic.
# Self-checks when the tool was written (2 cores, about N s for all cases):
#   run.sh (src/cuda/prep.cuh against HEAD's):                        PASS on every case
#   a copy with rcp_approx(1.0f + ...) in the lower-bound gate changed to 1.0f / (1.0001f + ...):  MISMATCH
#   case 0's math check: γ worst relative error ~E1, Aqk's diagonal ~E2 (bf16's rounding)
set -e
W=$(cd "$(dirname "$0")/../.." && pwd); E=$W/dev/prep_emu; B=${TMPDIR:-/tmp}/prep_emu
CAND=${2:-$W/src/cuda/prep.cuh}
mkdir -p $B
if [ -n "$3" ]; then cp "$3" $B/ref.src; else git -C "$W" show HEAD:src/cuda/prep.cuh > $B/ref.src; fi
cp "$CAND" $B/cand.src
cp $W/src/cuda/seq.cuh $W/src/cuda/cp_plan.cuh $E/common.cuh $W/dev/bwd_emu/shim.h $B/
cp $W/dev/bwd_emu/common.cuh $B/bwd_common.cuh
for s in cand ref; do
  sed -E 's/extern __shared__ __align__\(([0-9]+)\) unsigned char ([A-Za-z_0-9]+)\[\];/unsigned char *\2 = EMU_SMEM;/' \
    $B/$s.src > $B/prep_$s.cuh
  if grep -q 'extern __shared__' $B/prep_$s.cuh; then echo "run.sh: $s: a shared memory declaration not rewritten" >&2; exit 2; fi
done
X=""; [ -n "$PREP_EMU_256" ] && X="-DPREP_CLASS_256"
F="-w -std=c++17 -O1 -ffp-contract=off $X -I$B -I$W/src/cuda -I$W/src -I$W/include -I/usr/local/cuda/include"
g++ -x c++ $F -DPREP_NS=cand '-DPREP_SRC="prep_cand.cuh"' -c $E/prep_inst.emu.cu -o $B/cand.o &
g++ -x c++ $F -DPREP_NS=ref '-DPREP_SRC="prep_ref.cuh"' -c $E/prep_inst.emu.cu -o $B/ref.o &
g++ -x c++ $F -c $E/harness.emu.cu -o $B/harness.o
wait
g++ -o $B/prep_emu $B/harness.o $B/cand.o $B/ref.o -lpthread -lm
$B/prep_emu "${1:-all}"
