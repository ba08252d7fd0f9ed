#!/bin/sh
# Host emulation of the CUDA decode kernel (src/cuda/decode.cu): one std::thread per CUDA thread, warp shuffles
# and votes emulated (common.cuh here), launched through kda_cuda_decode_run with host pointers, against the
# fp64 oracle. No GPU needed; seconds per case on two cores. Needs a CPU build in build-c (libkda.a):
#   cmake -S . -B build-c -G Ninja -DKDA_WITH_CUDA=OFF && ninja -C build-c kda
#   dev/dec_emu/run.sh [build|suite|ARGS...]   ARGS: see harness.cpp
set -e
W=$(cd "$(dirname "$0")/../.." && pwd); E=$W/dev/dec_emu; B=$W/build-emu-dec
mkdir -p $B
build() {
  # decode.cu as it is, its <<<launch>>> replaced by the emulated launch
  sed -e 's/kda_decode_kernel<VF, KC, SF32, EX><<<(unsigned)ctas, DEC_THREADS, 0, (cudaStream_t)stream>>>(\*p);/emu_launch((unsigned)ctas, DEC_THREADS, [\&]() { kda_decode_kernel<VF, KC, SF32, EX>(*p); });/' \
      $W/src/cuda/decode.cu > $B/decode.emu.cpp
  grep -q emu_launch $B/decode.emu.cpp || { echo "run.sh: the launch line of decode.cu changed"; exit 1; }
  cp $E/common.cuh $B/
  F="-w -std=c++17 -O1 -I$B -I$W/src/cuda -I$W/src -I$W/include -I$W/tools -I$W/tests/common -I/usr/local/cuda/include"
  g++ $F -c $B/decode.emu.cpp -o $B/decode.o
  g++ $F -c $E/harness.cpp -o $B/harness.o
  gcc -O1 -std=c11 -I$W/include -I$W/src -I$W/tools -c $W/tools/synth.c -o $B/synth.o
  gcc -O1 -std=c11 -I$W/include -I$W/src -I$W/tests/common -I$W/tools -c $W/tests/common/compare.c -o $B/compare.o
  g++ -o $B/harness $B/harness.o $B/decode.o $B/synth.o $B/compare.o $W/build-c/libkda.a -lpthread -lm
}
case "${1:-suite}" in
  build) build ;;
  suite)
    build
    fail=0
    # K V vf sdt mode T hqk hv gate poison headwise ctas accepted dtype varlen dup
    while read -r name args; do
      [ -z "$name" ] && continue
      printf "%-26s " "$name"; $B/harness $args || fail=1
    done <<'CASES'
vf_f32_k128_pool        128 128 1 0 1 1 1 2 2 0 0 0 0 0
kf_f32_k128_pool        128 128 0 0 1 1 1 2 2 0 0 0 0 0
vf_bf16_k128_pool       128 128 1 2 1 1 1 2 2 0 0 0 0 2
kf_bf16_k128_pool       128 128 0 2 1 1 1 2 2 0 0 0 0 2
vf_f32_k100_v72_plain   100 72 1 0 0 1 1 2 3 0 0 0 0 0
kf_f32_k100_v72_plain   100 72 0 0 0 2 1 2 1 0 0 0 0 0
vf_gva4_mtp3            128 128 1 0 1 3 2 8 2 0 0 0 0 0
kf_gva4_mtp3            128 128 0 0 1 3 2 8 0 0 0 0 0 0
vf_spec2d_accepted      128 128 1 0 2 3 1 2 2 0 0 0 1 0 1
kf_spec2d_accepted_bf16 128 128 0 2 2 3 1 2 3 0 0 0 1 2 1
vf_nan_token            128 128 1 0 1 3 1 2 2 1 0 0 0 0 1
kf_nan_token            128 128 0 0 1 3 1 2 2 1 0 0 0 0 1
vf_inf_state_column     128 128 1 0 1 2 1 2 2 2 0 0 0 0
kf_inf_state_column     128 128 0 0 1 2 1 2 2 2 0 0 0 0
vf_headwise_spec        64 128 1 0 2 2 1 2 2 0 1 0 1 0 1
kf_headwise_pool        64 128 0 0 1 2 1 2 1 0 1 0 0 1
vf_k64_ctas1            64 64 1 0 1 2 1 2 2 0 0 1 0 0 1
kf_k256_ctas3           256 256 0 0 1 2 1 2 3 0 0 3 0 0
vf_k256_bf16            256 256 1 2 1 1 1 2 1 0 0 0 0 2
vf_k3_v200_f16          3 200 1 0 0 2 1 2 2 0 0 0 0 1
kf_k256_v17             256 17 0 0 0 1 1 2 0 0 0 0 0 0
vf_dup_slot             128 128 1 0 1 2 1 2 2 0 0 0 0 0 0 1
kf_dup_slot_spec        128 128 0 0 2 2 1 2 2 0 0 0 1 0 0 1
CASES
    [ $fail = 0 ] && echo "all OK" || { echo "FAILURES"; exit 1; } ;;
  *) $B/harness "$@" ;;
esac
