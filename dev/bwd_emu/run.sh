#!/bin/sh
# Host emulation of the CUDA backward's stages 3-4 (bwd_chunk.cuh, bwd_pairs.cuh, bwd_finish.cu): one host thread per CUDA
# thread, mma.sync emulated from its fragment layouts (common.cuh here), against the fp64 oracle with exact
# S and dS+ per chunk; use_blocks = 1: dS+ by the emulated bwd_dstate.cuh from the synthesized bf16 chunk
# blocks (S stays exact: stage 1 is the forward's recurrence kernel, not emulated here); use_blocks = 2: as 1, then
# the split stage 3 of 16-bit inputs (bwd_inter.cuh, the chunk kernel's SPLIT path; the inputs stay fp32 here).
# No GPU needed; about a minute per case on two cores.
#   dev/bwd_emu/run.sh [build|suite|k256|ARGS...]   ARGS: K V gate vfirst use_blocks mode hqk hv decay neg
# Environment: EMU_NO_L2NORM=1 runs without the l2norm (q, k as given); EMU_DUMP=FILE writes the computed gradients
# (float32, in the order printed) to FILE; for the suite, EMU_DUMP_DIR=DIR writes each case's to DIR/<its args>.bin,
# and dev/bwd_emu/compare.py DIR1 DIR2 compares two trees' cases gradient by gradient, bit for bit.
# What-ifs for the rounding budget (docs/PERF.md, "dA_log against FLA"): EMU_GSCALE=F multiplies the raw gate by F
# (bench/bwd_accuracy.py's strong_decay is 8); EMU_DUMP_REF=FILE writes the oracle's gradients, then g, A_log and
# dt_bias (dev/bwd_emu/dalog_parts.py reads both dumps); EMU_TF32_EXACT=1 or a list of stages (chunk, pairs, inter,
# dstate) keeps tf32 operands at 24 bits; on the split path (use_blocks 2) EMU_EXACT_DGAM=1 gives the pairs kernel
# dγ from the exact S and dS+, EMU_EXACT_DQG=1 dQΓ = dO Sᵀ from the exact S, EMU_EXACT_DKT=1..5 dK̃ = Δ dS+ᵀ from
# chosen operands (harness.emu.cu, kt_delta / kt_ds); EMU_S_NOISE=E multiplies each element of S by 1 + E u (u of
# standard deviation 1). EMU_INPUTS=FILE takes the inputs, do and dht from FILE (dev/bwd_emu/acc_inputs.py writes
# bench/bwd_accuracy.py's), with mode 5: EMU_B sequences (default 1) of EMU_T tokens (default 300).
# The forward's S (stage 1 is not emulated; S is exact unless): EMU_S_BLOCKS=MASK computes S by the chunk recurrence
# S <- Diag(γ) S + K̃ᵀ (U − W S) in fp64 from the panels in MASK (1 W, 2 U, 4 K̃) as the blocks' bf16, the others exact
# (7: as the GPU's forward reads them); EMU_S_BITS=N rounds the masked panels to N significant bits instead (11: fp16's
# precision), EMU_S_DELTA=N rounds Δ and EMU_S_SOP=N rounds S as W S's operand (docs/PERF.md, "dA_log at k64 seed 1").
# EMU_PAIRS_16=bf16|f16 rounds q, k and g to that format for every stage; EMU_PAIRS_16_STORE=1 then gives the pairs kernel
# 16-bit copies (its head_rows_vec path), EMU_CHUNK_16_STORE=1 the chunk kernel (q, k, g, v: its 16-bit input paths):
# the dumps with and without them compare bit for bit.
# Needs a CPU build in build-c (libkda.a). The emulator (harness.emu.cu, emu_*.emu.cu: the launches; shim.h,
# common.cuh: the CUDA features) is C, compiled by g++ (-x c++) because the kernels' tile sizes are templates.
set -e
[ -n "$EMU_DUMP_DIR" ] && mkdir -p "$EMU_DUMP_DIR"
W=$(cd "$(dirname "$0")/../.." && pwd); E=$W/dev/bwd_emu; B=$W/build-emu
mkdir -p $B
build() {
  python3 - "$W" "$B" <<'PY'
import sys; w, b = sys.argv[1], sys.argv[2]
for f, cut in [('bwd_chunk.cuh', 'template <int KC, int VC, int SPLIT, int KSP, int NVH>\nstatic int launch_chunk'), ('bwd_finish.cu', 'extern "C" int kda_bwd_launch_finish'),
               ('bwd_dstate.cuh', 'template <int KC, int BV>\nstatic int launch_dstate'),
               ('bwd_inter.cuh', 'template <int KC, int VC, int NVH>\nstatic int launch_inter'),
               ('bwd_pairs.cuh', 'template <int KC, int NVH>\nstatic int launch_pairs')]:
    s = open(w + '/src/cuda/bwd/' + f).read()
    s = s[:s.index(cut)]  # the kernels (the launchers and instance macros after the cut need the CUDA runtime)
    if f.endswith('.cuh'): s += '#endif\n'  # the header guard the cut left open
    open(b + '/' + f.split('.')[0] + '.emu.h', 'w').write(s)
PY
  cp $W/src/cuda/bwd/bwd.cuh $W/src/cuda/common/seq.cuh $W/src/cuda/common/states16.cuh $E/common.cuh $E/shim.h $B/ # their "common.cuh": the stand-in
  F="-w -std=c++17 -O1 -DKDA_DEV_BUILD=1 -I$B -I$E -I$W/src/cuda/common -I$W/src/cuda/fwd -I$W/src/cuda/cp -I$W/src/cuda/decode -I$W/src/cuda/bwd -I$W/src -I$W/include -I$W/tools -I$W/tests/common -I/usr/local/cuda/include"
  for f in emu_chunk emu_finish emu_dstate emu_inter emu_pairs harness launch; do g++ -x c++ $F -c $E/$f.emu.cu -o $B/$f.o; done
  gcc -O1 -std=c11 -I$W/include -I$W/src -I$W/tools -c $W/tools/synth.c -o $B/synth.o
  gcc -O1 -std=c11 -I$W/include -I$W/src -I$W/tests/common -I$W/tools -c $W/tests/common/compare.c -o $B/compare.o
  g++ -o $B/harness $B/harness.o $B/launch.o $B/emu_chunk.o $B/emu_finish.o $B/emu_dstate.o $B/emu_inter.o $B/emu_pairs.o $B/synth.o $B/compare.o $W/build-c/libkda.a -lpthread -lm
}
case "${1:-suite}" in
  build) build ;;
  profile) # executions per source line of the chunk kernel (gcov of the emulation, summed over CUDA threads)
    build
    shift
    args="$*"
    [ -n "$args" ] || args="128 128 2 0 0 3 1 2"
    rm -f $B/*.gcda
    g++ -x c++ $F --coverage -fprofile-update=atomic -c $E/emu_chunk.emu.cu -o $B/emu_chunk_cov.o
    g++ --coverage -o $B/harness_cov $B/harness.o $B/launch.o $B/emu_chunk_cov.o $B/emu_finish.o $B/emu_dstate.o $B/emu_inter.o $B/emu_pairs.o $B/synth.o \
      $B/compare.o $W/build-c/libkda.a -lpthread -lm
    (cd $B && ./harness_cov $args >/dev/null && gcov -o . emu_chunk_cov.o >/dev/null 2>&1 &&
      python3 $E/line_profile.py bwd_chunk.emu.h.gcov) ;;
  suite)
    build
    for args in "64 64 1" "128 128 2" "100 72 3 1" "64 128 1 1 0 2 2 8" "128 64 0 0 0 1" "64 64 1 0 0 0 1 2 30" "64 64 1 0 0 3" \
                "128 128 2 0 1" "100 72 3 1 1" "64 128 1 1 1 2 2 8" "128 128 2 0 2" "100 72 3 1 2 2 2 8" \
                "128 128 2 0 2 0 2 2" "64 64 1 0 0 3 2 2"; do # the last two: one value head per q/k head (G = 1)
      [ -n "$EMU_DUMP_DIR" ] && export EMU_DUMP="$EMU_DUMP_DIR/$(echo $args | tr ' ' _).bin"
      printf "%-28s " "$args"; $B/harness $args | tr '\n' ' ' | sed 's/ (nonfinite 0)//g'; echo
    done
    args="100 72 3 1 2 2 2 8" # without l2norm: no cluster (G = 4, K below its class)
    [ -n "$EMU_DUMP_DIR" ] && export EMU_DUMP="$EMU_DUMP_DIR/nol2_$(echo $args | tr ' ' _).bin"
    printf "%-28s " "nol2 $args"; EMU_NO_L2NORM=1 $B/harness $args | tr '\n' ' ' | sed 's/ (nonfinite 0)//g'; echo ;;
  k256) # class 256 (docs/PERF.md "Backward at K = V = 256"): the chunk kernel's K cluster and V halves, the pairs
    # kernel's clusters of 8, the inter kernel at K 256; 2-4 minutes a case on two cores
    build
    for args in "256 128 2" "256 256 2" "256 256 2 0 2" "200 150 3 1 2 2 2 8" "64 256 1 0 2" "256 64 0 0 1 1"; do
      [ -n "$EMU_DUMP_DIR" ] && export EMU_DUMP="$EMU_DUMP_DIR/$(echo $args | tr ' ' _).bin"
      printf "%-28s " "$args"; $B/harness $args | tr '\n' ' ' | sed 's/ (nonfinite 0)//g'; echo
    done ;;
  *) $B/harness "$@" ;;
esac
