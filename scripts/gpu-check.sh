#!/usr/bin/env bash
# One device call: build for sm_90a, then the steps named on the command line, in order (default: tests):
#   tests     the GPU tests (CTest gpu_*, or those matching GTEST_RE: accuracy table against the fp64 oracle)
#   sanitize  compute-sanitizer memcheck + racecheck on SAN_TESTS at each recurrence tiling (KDA_TEST_BV 32/64/128)
#   ab        A/B of this tree against the tree in .base/ (carried; e.g. `git archive <commit> | tar -x -C .base`):
#             GPU time of back-to-back calls (bench/stages.py, set "all"), A B A B, on AB_SHAPES
#   bench     ours vs FLA (bench/bench_fla.py BENCH_ARGS; the FLA wheels travel in .whl/, carried)
#   fla       FLA's tests/ops/test_kda.py with libkda swapped in (scripts/fla-tests.sh; FLA's source in .fla/,
#             carried), FLA_ARGS passed to pytest
#   pytests   the Python suite on the GPU
#   dev       a development build (-DKDA_DEV=ON) and stage timings by skip bits (bench/stages.py STAGE_ARGS)
#   devab     the same for .base (legacy KDA_DEV_* variables) and this tree, twice
#   ncu       utilisation and stall reasons of the kernels of B2 T8192 H64 (NCU_KERNELS)
#   decab     bench_decode (no crossover) for this tree and for .var1 (a variant; DEC_VAR=var2 for .var2)
#   fwdsrc    ncu source counters of one forward kernel (FWD_SRC_KERNEL, FWD_SRC_SHAPE): top lines by stall samples
#   ncudec    ncu of the decode kernel and of FLA's fused_recurrent_kda_fwd_kernel on DEC_NCU_SHAPE
#   cp        intra-card CP (issue 9): the gpu_fwd_cp* tests, memcheck + racecheck on them (CP_SAN_TESTS), then
#             bench/bench_cp.py against FLA and FLA-CP (CP_BENCH_ARGS, e.g. "--quick" or "--only 65536")
#   cpprof    per-kernel durations (ncu) of one call of each CPPROF_SHAPES shape (bench/cp_kernels.py), auto and off
#             (CPPROF_PIECES), for each build-$lib of CPPROF_LIBS (default gpu)
#   bwdprof   the backward (issue 11): per-stage ms (CUDA events in a -DKDA_DEV=ON build, bench/bwd_stages.py) of
#             BWD_SHAPES, then per-kernel duration and SOL (ncu) of one training step of "B2 T8192 H32"
#   bwdab     the backward's per-stage ms of .var1 (a variant tree, carried), of this tree and of .var2 when carried,
#             two rounds, dev builds, and this tree's gradients against .var1's ("vs ref")
#   bwdskip   the backward's per-stage ms and step time with and without BWD_SKIP (development skip bits), two
#             rounds, dev build; gradients against the skip run's
#   timeline  one training step of TIMELINE_SHAPE under torch.profiler: every kernel's start, duration and the idle
#             gap before it; the host's time to enqueue the forward and the backward (bench/step_timeline.py)
#   ncuab     one backward kernel (NCUAB_KERNEL) under ncu, .var1's build and this tree's side by side
#   bwdsrc    ncu source counters of the backward kernels (BWD_SRC_KERNELS, BWD_SRC_SHAPE): top lines by stall samples
#   bwdbench  the training step (forward + backward) against FLA in one process: bench/bench_bwd.py BWD_BENCH_ARGS,
#             cut after BWD_BENCH_TIMEOUT seconds if set (so that a `tritoncache` after it still runs: FLA's autotuning
#             results of the shapes it finished come back for the next call)
#   cptimeline  one intra-card CP forward call: host time, single vs back-to-back ms, its runtime calls and kernels
#   hostprof  the training step's host time: enqueue times, single step against back to back, cProfile (build-gpu)
#   hostbreak the training step's host time by function (bench/experiments/host_breakdown.py)
#   hostab    host time and single-step ms, .var1's Python package against this tree's (one library)
#   acc       libkda's and FLA's gradients against the fp64 oracle (bench/bwd_accuracy.py ACC_ARGS)
#   tritoncache  Triton's cache (.triton-cache/, FLA's kernels and autotuning) as $OUT/triton-cache.tgz: unpack it
#             into .triton-cache/ here and carry that folder, so that FLA does not autotune again on a fresh machine
#   bwdsan    bwdcheck's first half: the gpu_bwd tests, memcheck + racecheck (BWD_SAN_TESTS)
#   bwdcheck  the backward after a kernel change: gpu_bwd tests, memcheck + racecheck (BWD_SAN_TESTS), per-stage ms
#             of BWD_SHAPES twice (dev build), gradients against the fp64 oracle (bench/bwd_accuracy.py, libkda only)
#   decvar    the decode kernels' forced-size test and gpu_decode_time_variants only
#   rmw       torch's in-place read-modify-write bandwidth on decode-sized pools (the decode kernel's ceiling)
#   decode    the decode kernel (issue 10): its GPU tests (with the N1 H32 time per call from C), memcheck and
#             racecheck on DEC_SAN_TESTS, then bench/bench_decode.py against FLA's fused_recurrent_kda_fwd
# Logs and results go to $OUT; a short table is printed last.
# The commit the results name: a carried .kda-commit (`git describe --always --dirty > .kda-commit` before the
# call; ignored through .git/info/exclude), as the device copy's git metadata may be stale.
set -uo pipefail
OUT=${OUT:-/tmp/kda-out}
LOG=/tmp/kda-logs   # build logs stay on the machine ($OUT brings back at most 8 files)
mkdir -p "$OUT" "$LOG"
[ $# -eq 0 ] && set -- tests
cd "$(dirname "$0")/.."
[ -f .kda-commit ] && export KDA_COMMIT="$(cat .kda-commit)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
GENCODE="arch=compute_90a,code=sm_90a"

build() { # dir src [cmake args]
  local dir=$1 src=$2; shift 2
  local t0=$(date +%s)
  cmake -S "$src" -B "$dir" -G Ninja -DKDA_CUDA_GENCODE="$GENCODE" "$@" >"$LOG/cmake-$(basename $dir).log" 2>&1 ||
    { tail -30 "$LOG/cmake-$(basename $dir).log"; return 1; }
  cmake --build "$dir" -j16 >"$LOG/build-$(basename $dir).log" 2>&1 ||
    { grep -E "error" "$LOG/build-$(basename $dir).log" | head -30; return 1; }
  echo "build $dir $(( $(date +%s) - t0 )) s ($(grep -c 'spill' "$LOG/build-$(basename $dir).log") spill lines)"
}
case "$*" in bwdab | bwdskip) build build-dev . -DKDA_DEV=ON || exit 1 ;; # these alone need only dev builds
  *) build build-gpu . || exit 1 ;; esac
PYENV="PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1"
# (grep --line-buffered in the pipelines below: a step cut by its timeout or by the call's end keeps the lines it had)

# Triton's cache (with FLA's autotuning results: FLA_CACHE_RESULTS, on by default in FLA 0.6.0) in .triton-cache/ when carried there: FLA's
# backward autotunes for minutes per shape on a fresh machine. The step `tritoncache` brings it back as
# $OUT/triton-cache.tgz; unpack it into .triton-cache/ (ignored) and carry that folder in the next call.
mkdir -p .triton-cache && export TRITON_CACHE_DIR=$PWD/.triton-cache
# or as the pieces the step `tritoncache` brought back, carried in .tc/ (the unpacked cache is over the carry limit)
ls .tc/triton-cache.tgz.part-* >/dev/null 2>&1 && cat .tc/triton-cache.tgz.part-* | tar -xz -C .triton-cache
[ -f .tc/triton-autotune.tgz ] && tar -xzf .tc/triton-autotune.tgz -C .triton-cache

fla_site() { # FLA 0.6.0 wheels into /tmp/site, once
  [ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
}

ncu_src_report() { # kernel: the report $LOG/KERNEL.ncu-rep as source (CUDA, and SASS gzipped) and details in
  # $OUT; its summary lines and the top source lines by stall samples printed
  local kn=$1
  ncu --import "$LOG/$kn.ncu-rep" --page source --csv --print-source cuda >"$OUT/src_$kn.csv" 2>>"$LOG/ncu_$kn.log"
  ncu --import "$LOG/$kn.ncu-rep" --page source --csv --print-source sass >"$LOG/sass_$kn.csv" 2>/dev/null
  gzip -c "$LOG/sass_$kn.csv" >"$OUT/sass_$kn.csv.gz"
  ncu --import "$LOG/$kn.ncu-rep" --page details >"$OUT/det_$kn.txt" 2>>"$LOG/ncu_$kn.log"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Stall" "$OUT/det_$kn.txt" | head -12
  python3 scripts/ncu_src_top.py "$OUT/src_$kn.csv" 45 | cut -c1-170 | tee "$OUT/top_$kn.txt"
  python3 scripts/ncu_src_top.py --phases "$OUT/sass_$kn.csv.gz" | cut -c1-170 | tee "$OUT/phases_$kn.txt"
}

for step in "$@"; do
  echo "== $step $(date +%T)"
  case "$step" in
  tests) # GTEST_RE: the CTests to run (default every GPU test)
    (cd build-gpu && ctest -R "${GTEST_RE:-^gpu_}" -V -j1 --timeout 600) >"$OUT/gpu_tests.log" 2>&1
    grep -E "tests passed|tests failed" "$OUT/gpu_tests.log"
    grep -E "CHECK|FAIL|Failed" "$OUT/gpu_tests.log" | head -20
    echo "largest errors:"; grep -E "^[0-9]+: case" "$OUT/gpu_tests.log" | sort -k5 -g | tail -4 | cut -c1-110
    ;;
  sanitize)
    for bv in 32 64 128; do for tool in memcheck racecheck; do
      for t in ${SAN_TESTS:-gpu_fwd_varlen_empty_seq gpu_fwd_gva_4x}; do
        KDA_TEST_BV=$bv compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/test_gpu $t >"$LOG/san.log" 2>&1
        echo "bv $bv $tool $t rc=$? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/san.log" | head -1))"
      done; done; done
    ;;
  ab)
    build build-base .base || exit 1
    for v in ${AB_VARIANTS:-}; do build build-$v .$v || exit 1; done
    for r in 1 2; do for which in base gpu ${AB_VARIANTS:-}; do
      echo "$which (run $r):"
      py=$PWD/python; [ $which != gpu ] && [ -d .$which/python ] && py=$PWD/.$which/python # the binding of its day
      env KDA_LIBRARY=$PWD/build-$which/libkda.so PYTHONPATH=$py PYTHONUNBUFFERED=1 python3 bench/stages.py --sets all \
        --shapes ${AB_SHAPES:-B2T8192H64 B1T8192H64 B8T4096H32 B1T512H64 B1T32768H32 V6 V8x1024 GVA} 2>&1 |
        grep --line-buffered -v Warn | tee -a "$OUT/ab.log"
    done; done
    ;;
  bench)
    fla_site
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:/tmp/site PYTHONUNBUFFERED=1 \
      python3 bench/bench_fla.py --out "$OUT" ${BENCH_ARGS:-} >"$OUT/bench_fla.log" 2>&1
    grep -vE "Warning|warn" "$OUT/bench_fla.log" | tail -20
    ;;
  fla)
    scripts/fla-tests.sh .fla build-gpu ${FLA_ARGS:-} >"$OUT/fla_tests.log" 2>&1
    grep -E "passed|failed" "$OUT/fla_tests.log" | tail -3
    grep -E "^FAILED" "$OUT/fla_tests.log" | cut -c1-160 | head -30
    ;;
  pytests)
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so $PYENV timeout 300 python3 -m pytest -q -x tests/python \
      >"$OUT/pytest.log" 2>&1; echo "python tests: $(tail -1 "$OUT/pytest.log")"
    ;;
  dev)
    build build-dev . -DKDA_DEV=ON || exit 1
    env KDA_LIBRARY=$PWD/build-dev/libkda.so $PYENV python3 bench/stages.py ${STAGE_ARGS:-} 2>&1 |
      tee "$OUT/stages.log" | grep --line-buffered -v Warn
    ;;
  devab) # stage timings of .base (a build that reads KDA_DEV_* variables, or a KDA_DEV build) and of this tree
    build build-dev . -DKDA_DEV=ON || exit 1
    [ -d build-base ] || build build-base .base || exit 1
    for r in 1 2; do
      echo "base:"; env KDA_LIBRARY=$PWD/build-base/libkda.so $PYENV python3 bench/stages.py --legacy-env ${STAGE_ARGS:-} 2>&1 | grep --line-buffered -v Warn
      echo "this:"; env KDA_LIBRARY=$PWD/build-dev/libkda.so $PYENV python3 bench/stages.py ${STAGE_ARGS:-} 2>&1 | grep --line-buffered -v Warn
    done
    ;;
  ncu)
    M=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
    for st in barrier long_scoreboard short_scoreboard wait mio_throttle math_pipe_throttle not_selected lg_throttle; do
      M=$M,smsp__average_warp_latency_issue_stalled_$st.ratio; done
    for kn in ${NCU_KERNELS:-prep recurrence}; do
      env KDA_LIBRARY=$PWD/build-gpu/libkda.so $PYENV ncu --clock-control none -k regex:$kn --launch-skip 2 \
        --launch-count 1 --metrics $M --csv python3 bench/stages.py --shapes ${NCU_SHAPE:-B2T8192H64} --sets all \
        --reps 1 >"$OUT/ncu_$kn.csv" 2>"$OUT/ncu.err"
      python3 - "$OUT/ncu_$kn.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, mi, vi = (hdr.index(x) for x in ("Kernel Name", "Metric Name", "Metric Value"))
print(rows[0][ki][:40] if rows else "no rows")
print("  " + "  ".join("%s=%s" % (r[mi].replace("smsp__average_warp_latency_issue_stalled_", "stall_").replace(".avg.pct_of_peak_sustained_active", "%").replace(".ratio", ""), r[vi]) for r in rows))
PY
    done
    ;;
  ncutime) # GPU duration of each kernel (ncu), .base and this tree, on NCU_SHAPES
    [ -d build-base ] || build build-base .base || exit 1
    for v in ${NCU_VARIANTS:-}; do build build-$v .$v || exit 1; done
    for shape in ${NCU_SHAPES:-B1T512H64 B1T32768H32}; do for which in base gpu ${NCU_VARIANTS:-}; do
      py=$PWD/python; [ $which != gpu ] && [ -d .$which/python ] && py=$PWD/.$which/python # its own package
      env KDA_LIBRARY=$PWD/build-$which/libkda.so PYTHONPATH=$py PYTHONUNBUFFERED=1 ncu --clock-control none -k regex:"prep|recurrence" \
        --launch-skip 4 --launch-count 4 --metrics gpu__time_duration.sum,launch__registers_per_thread --csv \
        python3 bench/stages.py --shapes $shape --sets all --reps 1 >"$LOG/ncu.csv" 2>"$LOG/ncu.err"
      python3 - "$LOG/ncu.csv" "$shape $which" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, mi, vi = (hdr.index(x) for x in ("Kernel Name", "Metric Name", "Metric Value"))
print(sys.argv[2] + ": " + "  ".join("%s %s=%s" % (r[ki].split("(")[0][-28:], r[mi].split("__")[1][:12], r[vi]) for r in rows))
PY
    done; done
    ;;
  decode)
    (cd build-gpu && ctest -R '^gpu_(decode|duplicate)' -V -j1 --timeout 600) >"$LOG/decode_tests.log" 2>&1
    grep -E "tests passed|tests failed" "$LOG/decode_tests.log"
    grep -E "CHECK|FAIL|Failed|timing" "$LOG/decode_tests.log" | head -20; cp "$LOG/decode_tests.log" "$OUT/"
    for tool in memcheck racecheck; do
      for t in ${DEC_SAN_TESTS:-gpu_decode_spec_2d gpu_decode_mtp_varlen gpu_decode_persistent_ctas}; do
        compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/test_gpu_decode $t >"$LOG/san_dec.log" 2>&1
        echo "decode $tool $t rc=$? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/san_dec.log" | head -1))"
      done
    done
    fla_site
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:/tmp/site PYTHONUNBUFFERED=1 \
      python3 bench/bench_decode.py --out "$OUT/decode" ${DEC_BENCH_ARGS:-} >"$LOG/bench_decode.log" 2>&1
    grep -vE "Warning|warn" "$LOG/bench_decode.log" | tail -20
    ;;
  cp)
    (cd build-gpu && ctest -R '^gpu_fwd_cp' -V -j1 --timeout 600) >"$LOG/cp_tests.log" 2>&1
    grep -E "tests passed|tests failed" "$LOG/cp_tests.log"
    grep -E "CHECK|FAIL|Failed" "$LOG/cp_tests.log" | head -20
    grep -E "case " "$LOG/cp_tests.log" | cut -c1-140 | head -40; cp "$LOG/cp_tests.log" "$OUT/"
    for tool in memcheck racecheck; do
      for t in ${CP_SAN_TESTS:-gpu_fwd_cp_graph_other_lengths gpu_fwd_cp_sanitize gpu_fwd_chunk_states}; do
        compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/test_gpu $t >"$LOG/san_cp.log" 2>&1
        echo "cp $tool $t rc=$? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOG/san_cp.log" | head -1))"
      done
    done
    if [ -z "${CP_NO_BENCH:-}" ]; then
      fla_site
      env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:/tmp/site:$PWD/bench PYTHONUNBUFFERED=1 \
        FLA_FLASH_KDA=0 timeout ${CP_BENCH_TIMEOUT:-400} python3 bench/bench_cp.py --out "$OUT/cp" ${CP_BENCH_ARGS:-} \
        >"$OUT/bench_cp.log" 2>&1
      grep -vE "Warning|warn" "$OUT/bench_cp.log" | tail -24
    fi
    ;;
  cpprof)
    fla_site # bench_cp.py, where the shapes are, imports FLA
    IFS=';' read -ra shapes <<< "${CPPROF_SHAPES:-single T65536 H8;single T131072 H4;B1 T32768 H32}"
    for lib in ${CPPROF_LIBS:-gpu}; do for sh in "${shapes[@]}"; do for pl in ${CPPROF_PIECES:-None 0}; do
      env KDA_LIBRARY=$PWD/build-$lib/libkda.so PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site PYTHONUNBUFFERED=1 \
        ncu --profile-from-start off --section SpeedOfLight python3 bench/cp_kernels.py "$sh" $pl >"$LOG/cpprof.txt" 2>&1
      echo "-- build-$lib: $sh piece_len=$pl"
      [ "$pl" = None ] && [ "$sh" = "${shapes[0]}" ] && cp "$LOG/cpprof.txt" "$OUT/cpprof_first.txt"
      grep -E "==PROF==|==ERROR==|Error" "$LOG/cpprof.txt" | head -3
      awk '/^  [a-z_A-Z].*\(.*Context/{k=$0; sub(/^ +/, "", k)} /Duration/{printf "   %-40s %s %s\n", substr(k,1,40), $NF, $(NF-1); t+=$NF*($(NF-1)=="ms"?1000:($(NF-1)=="us"?1:0.001))} END{printf "   total %.1f us\n", t}' "$LOG/cpprof.txt"
    done; done; done
    ;;
  bwdprof)
    build build-dev . -DKDA_DEV=ON || exit 1
    IFS=';' read -ra shapes <<< "${BWD_SHAPES:-B2 T8192 H32;B1 T32768 H16}"
    env KDA_LIBRARY=$PWD/build-dev/libkda.so PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1 \
      python3 bench/bwd_stages.py --shapes "${shapes[@]}" 2>&1 | grep --line-buffered -v Warn | tee "$OUT/bwd_stages.log"
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1 \
      ncu --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy \
      python3 bench/bwd_stages.py --profile "${shapes[0]}" >"$LOG/bwdprof.txt" 2>&1
    cp "$LOG/bwdprof.txt" "$OUT/bwdprof_ncu.txt"
    grep -E "==PROF==|==ERROR==|Error" "$LOG/bwdprof.txt" | head -3
    awk '/^  [a-z_A-Z].*\(.*Context/{k=$0; sub(/^ +/, "", k)} /Duration/{printf "   %-44s %s %s\n", substr(k,1,44), $NF, $(NF-1)} /Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Waves Per SM/{printf "      %s\n", $0}' "$LOG/bwdprof.txt" | cut -c1-110
    ;;
  bwdcheck | bwdsan) # the backward after a kernel change, in one call: gpu_bwd tests (errors kept), memcheck and
    # racecheck on BWD_SAN_TESTS; bwdcheck then per-stage ms of BWD_SHAPES twice (dev build) and libkda's gradients
    # against the fp64 oracle
    (cd build-gpu && ctest -R '^gpu_bwd' -j1 --timeout 300 -V >"$OUT/bwd_tests_full.log" 2>&1)
    grep -E "tests passed|tests failed" "$OUT/bwd_tests_full.log"; grep -E "^[0-9]+: bwd" "$OUT/bwd_tests_full.log" >"$OUT/bwd_tests.log"
    for tool in memcheck racecheck; do for t in ${BWD_SAN_TESTS:-gpu_bwd_varlen_empty_seq_gva4 gpu_bwd_fp32_fp16}; do
      timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/test_gpu_bwd $t >"$LOG/san_$tool.$t.log" 2>&1
      echo "$tool $t rc=$? $(tail -1 "$LOG/san_$tool.$t.log")"
    done; done | tee "$OUT/bwd_sanitizers.log"
    [ "$step" = bwdsan ] && continue
    build build-dev . -DKDA_DEV=ON || exit 1
    IFS=';' read -ra shapes <<< "${BWD_SHAPES:-B2 T8192 H32;B1 T32768 H16}"
    for r in 1 2; do env KDA_LIBRARY=$PWD/build-dev/libkda.so PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1 \
      python3 bench/bwd_stages.py --shapes "${shapes[@]}" 2>&1 | grep --line-buffered -v Warn | tee -a "$OUT/bwd_stages.log"; done
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1 timeout 150 \
      python3 bench/bwd_accuracy.py 2>&1 | grep --line-buffered -v Warn | tee "$OUT/bwd_accuracy_kda.log"
    ;;
  bwdbench) # the training step against FLA in one process (bench/bench_bwd.py BWD_BENCH_ARGS; FLA's wheels in .whl/)
    fla_site
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so FLA_FLASH_KDA=0 PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site \
      PYTHONUNBUFFERED=1 timeout "${BWD_BENCH_TIMEOUT:-0}" python3 bench/bench_bwd.py ${BWD_BENCH_ARGS---quick --only B2} --out "$OUT/bwdbench" 2>&1 |
      grep --line-buffered -v Warn | tail -30
    ;;
  cptimeline) # a single CP forward call: host time to enqueue, single vs back-to-back ms, runtime calls and kernels
    # (bench/experiments/cp_call_timeline.py; CP_TIMELINE_ARGS, e.g. --only "T65536 H8" --cprofile)
    fla_site
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so FLA_FLASH_KDA=0 PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site \
      PYTHONUNBUFFERED=1 python3 bench/experiments/cp_call_timeline.py ${CP_TIMELINE_ARGS:-} 2>&1 | grep --line-buffered -v Warn |
      tee "$OUT/cp_call_timeline.log" | head -120
    ;;
  hostprof) # the training step's host time (build-gpu: the library as shipped): enqueue times, single step against
    # steps back to back, the Python functions by own time (bench/step_timeline.py --cprofile)
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so $PYENV PYTHONPATH=$PWD/python:$PWD/bench \
      python3 bench/step_timeline.py --shape "${TIMELINE_SHAPE:-B2 T8192 H32}" --cprofile 2>&1 | grep --line-buffered -v Warn |
      tee "$OUT/host_profile.log" | head -20
    ;;
  hostbreak) # the training step's host time by function (bench/experiments/host_breakdown.py; HOSTBREAK_SHAPES)
    IFS=';' read -ra shapes <<< "${HOSTBREAK_SHAPES:-B2 T8192 H32}"
    for sh in "${shapes[@]}"; do env KDA_LIBRARY=$PWD/build-gpu/libkda.so $PYENV PYTHONPATH=$PWD/python:$PWD/bench \
      python3 bench/experiments/host_breakdown.py --shape "$sh" 2>&1 | grep --line-buffered -v Warn | tee -a "$OUT/host_breakdown.log"; done
    ;;
  hostab) # the training step's host time and single-step ms with .var1's Python package and this tree's, one library
    # (build-gpu), two rounds (bench/step_timeline.py; TIMELINE_SHAPE)
    for r in 1 2; do for which in var1 this; do py=$PWD/python; [ $which = var1 ] && py=$PWD/.var1/python
      echo "-- $which (round $r)"
      env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONUNBUFFERED=1 PYTHONPATH=$py:$PWD/bench \
        python3 bench/step_timeline.py --shape "${TIMELINE_SHAPE:-B2 T8192 H32}" 2>&1 | grep -E "host|step" | grep --line-buffered -v Warn
    done; done | tee "$OUT/host_ab.log"
    ;;
  acc) # gradients of libkda and FLA against the fp64 oracle, same inputs (bench/bwd_accuracy.py ACC_ARGS)
    fla_site
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so FLA_FLASH_KDA=0 PYTHONPATH=$PWD/python:$PWD/bench:/tmp/site \
      PYTHONUNBUFFERED=1 timeout ${ACC_TIMEOUT:-420} python3 bench/bwd_accuracy.py ${ACC_ARGS:-} 2>&1 | grep --line-buffered -v Warn |
      tee "$OUT/bwd_accuracy.log"
    ;;
  tritoncache) # Triton's cache (FLA's compiled kernels and autotuning results) as one file, to be carried next time
    # in pieces of 15 MB ($OUT's files come back up to 16 MiB each): `cat triton-cache.tgz.part-* | tar -xz -C .triton-cache`
    # only what Triton loads (the kernels' metadata and cubins, the launchers, the autotuning results): the
    # intermediates (.llir, .ptx, .ttir, .ttgir, .source) are ~80 % of the cache and over the carry limit
    tar -czf - -C .triton-cache --exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' --exclude='*.ttgir' \
      --exclude='*.source' . | split -b 15m - "$OUT/triton-cache.tgz.part-" && ls -la "$OUT"/triton-cache.tgz.part-*
    # and the autotuning results alone (a few KB: enough to skip the tuning; the chosen configs then compile in
    # seconds): `tar -xzf triton-autotune.tgz -C .triton-cache`, or carry it as .tc/triton-autotune.tgz
    (cd .triton-cache && find . -name '*.autotune.json' | tar -czf "$OUT/triton-autotune.tgz" -T -) &&
      echo "autotuning results: $(tar -tzf "$OUT/triton-autotune.tgz" | grep -c autotune.json) kernels"
    ;;
  bwdab)
    build build-dev . -DKDA_DEV=ON || exit 1
    build build-var1dev .var1 -DKDA_DEV=ON || exit 1
    vars="var1dev dev"
    if [ -d .var2 ]; then build build-var2dev .var2 -DKDA_DEV=ON || exit 1; vars="var1dev dev var2dev"; fi
    IFS=';' read -ra shapes <<< "${BWD_SHAPES:-B2 T8192 H32;B1 T32768 H16}"
    for r in 1 2; do for which in $vars; do
      if [ $which = var1dev ]; then g="--save-grads /tmp/ref_grads.pt"; py=$PWD/.var1/python
      elif [ $which = var2dev ]; then g="--ref-grads /tmp/ref_grads.pt"; py=$PWD/.var2/python
      else g="--ref-grads /tmp/ref_grads.pt"; py=$PWD/python; fi  # each library with its own package
      echo "-- $which (round $r)"
      env KDA_LIBRARY=$PWD/build-$which/libkda.so PYTHONPATH=$py:$PWD/bench PYTHONUNBUFFERED=1 \
        python3 bench/bwd_stages.py $g --shapes "${shapes[@]}" 2>&1 | grep --line-buffered -v Warn | tee -a "$OUT/bwd_ab.log"
    done; done
    ;;
  bwdskip) # this tree's backward with and without the development skip bits BWD_SKIP (dev build only), two rounds;
    # the skip runs' gradients are the reference of the others'
    IFS=';' read -ra shapes <<< "${BWD_SHAPES:-B2 T8192 H32}"
    for r in 1 2; do for sk in $BWD_SKIP 0; do
      if [ "$sk" != 0 ]; then g="--save-grads /tmp/skip_grads.pt --dev-skip $sk"; else g="--ref-grads /tmp/skip_grads.pt"; fi
      echo "-- dev_skip $sk (round $r)"
      env KDA_LIBRARY=$PWD/build-dev/libkda.so PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1 \
        python3 bench/bwd_stages.py $g --reps 15 --shapes "${shapes[@]}" 2>&1 | grep --line-buffered -v Warn | tee -a "$OUT/bwd_skip.log"
    done; done
    ;;
  timeline) # one training step's kernels, their gaps, and the host's time to enqueue (bench/step_timeline.py)
    build build-dev . -DKDA_DEV=ON || exit 1
    env KDA_LIBRARY=$PWD/build-dev/libkda.so $PYENV PYTHONPATH=$PWD/python:$PWD/bench \
      python3 bench/step_timeline.py --shape "${TIMELINE_SHAPE:-B2 T8192 H32}" $TIMELINE_ARGS 2>&1 | grep --line-buffered -v Warn | tee "$OUT/step_timeline.log"
    ;;
  ncuab) # one backward kernel (NCUAB_KERNEL) under ncu in .var1's build and this tree's, one training step of
    # BWD_SRC_SHAPE each: launch, occupancy (clusters too), scheduler and warp-state figures side by side; this
    # tree's source lines by stall samples
    build build-var1 .var1 || exit 1
    kn=${NCUAB_KERNEL:-kda_bwd_pairs_kernel}
    for which in var1 gpu; do py=$PWD/python; [ $which = var1 ] && py=$PWD/.var1/python
      env KDA_LIBRARY=$PWD/build-$which/libkda.so PYTHONPATH=$py:$PWD/bench PYTHONUNBUFFERED=1 \
        ncu --profile-from-start off -k regex:$kn --launch-count 1 --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --section SchedulerStats --section SourceCounters \
        -o "$LOG/${kn}_$which" -f python3 bench/bwd_stages.py --profile "${BWD_SRC_SHAPE:-B2 T8192 H32}" \
        >"$LOG/ncu_${kn}_$which.log" 2>&1 || tail -5 "$LOG/ncu_${kn}_$which.log"
      ncu --import "$LOG/${kn}_$which.ncu-rep" --page details >"$OUT/det_${kn}_$which.txt" 2>&1
    done
    paste <(grep -E "Duration|Cluster|Occupancy|Active Warps|Waves|Registers|Shared Memory Config|Issued Warp|No Eligible|Warp Cycles Per Issued|Block Limit" "$OUT/det_${kn}_var1.txt" | cut -c1-90) \
          <(grep -E "Duration|Cluster|Occupancy|Active Warps|Waves|Registers|Shared Memory Config|Issued Warp|No Eligible|Warp Cycles Per Issued|Block Limit" "$OUT/det_${kn}_gpu.txt" | awk '{print $NF}')
    cp "$LOG/${kn}_gpu.ncu-rep" "$LOG/$kn.ncu-rep" && ncu_src_report "$kn" >/dev/null
    ;;
  bwdsrc) # the backward kernels' source lines by warp-stall samples (ncu source counters, one training step)
    for kn in ${BWD_SRC_KERNELS:-kda_bwd_chunk_kernel kda_bwd_pairs_kernel kda_bwd_dstate_kernel}; do
      env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1 \
        ncu --profile-from-start off -k regex:$kn --launch-count 1 --section SourceCounters --section WarpStateStats \
        --section SpeedOfLight -o "$LOG/$kn" -f python3 bench/bwd_stages.py --profile "${BWD_SRC_SHAPE:-B2 T8192 H32}" \
        >"$LOG/ncu_$kn.log" 2>&1 || tail -5 "$LOG/ncu_$kn.log"
      ncu_src_report "$kn"
    done
    ;;
  fwdsrc) # a forward kernel's source lines by warp-stall samples (ncu source counters; FWD_SRC_KERNEL, FWD_SRC_SHAPE)
    kn=${FWD_SRC_KERNEL:-kda_prep_kernel}
    env KDA_LIBRARY=$PWD/build-gpu/libkda.so $PYENV ncu -k regex:$kn --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
      -o "$LOG/$kn" -f python3 bench/stages.py --shapes ${FWD_SRC_SHAPE:-B2T8192H64} --sets all --reps 1 \
      >"$LOG/ncu_$kn.log" 2>&1 || tail -5 "$LOG/ncu_$kn.log"
    ncu_src_report "$kn"
    grep -iE "shared (load|store)|bank" "$OUT/det_$kn.txt" | head -8 # wavefronts per request (the merge's question)
    ;;
  ncudec) # ncu of the decode kernel and FLA's on one shape (DEC_NCU_SHAPE)
    fla_site
    ncu --clock-control none -k regex:elementwise --launch-skip 12 --launch-count 1 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 bench/rmw_ceiling.py >"$OUT/ncu_rmw.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Grid Size|Block Size|L2 Hit|Mem Busy|Max Bandwidth" "$OUT/ncu_rmw.txt" | head -20
    for kn in kda_decode fused_recurrent_kda_fwd_kernel; do
      env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:/tmp/site PYTHONUNBUFFERED=1 \
        ncu --clock-control none -k regex:$kn --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
        --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis \
        python3 bench/bench_decode.py --out /tmp/ncu-bench --only "${DEC_NCU_SHAPE:-N256 H32 fp32 V-first}" \
        --no-crossover --quick >"$OUT/ncu_$kn.txt" 2>&1
      [ "$kn" = kda_decode ] && env KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:/tmp/site \
        ncu --clock-control none -k regex:$kn --launch-skip 3 --launch-count 1 --section WarpStateStats \
        --section SourceCounters --page source --print-source sass --csv \
        python3 bench/bench_decode.py --out /tmp/ncu-bench --only "${DEC_NCU_SHAPE:-N256 H32 fp32 V-first}" \
        --no-crossover --quick >"$OUT/ncu_src.csv" 2>&1
      grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Executed Ipc|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Instructions |Block Limit|Grid Size|Dynamic Shared|L2 Hit|Mem Busy|Max Bandwidth|One or More" "$OUT/ncu_$kn.txt" | head -40
    done
    ;;
  decvar) # the decode kernels' exact-size test and their variants timed side by side (C, graph replays)
    (cd build-gpu && ctest -R 'gpu_decode_(forced_kernels_exact|time_variants)' -V -j1 --timeout 600) \
      >"$OUT/decvar.log" 2>&1
    grep -E "tests passed|tests failed|CHECK|FAIL" "$OUT/decvar.log" | head; grep -E "timing" "$OUT/decvar.log" |
      sed -E 's/^[0-9]+: timing //; s/ us\/call back to back, / | /; s/ us\/call in a graph / us /'
    ;;
  rmw) # the in-place read-modify-write ceiling of a decode-sized pool (bench/rmw_ceiling.py, torch only)
    python3 bench/rmw_ceiling.py 2>&1 | tee "$OUT/rmw.log" | tail -14
    ;;
  decab) # the decode benchmark (no crossover) for this tree and for .$DEC_VAR (a variant, carried; default var1)
    dv=${DEC_VAR:-var1}
    build build-$dv .$dv || exit 1
    fla_site
    for which in gpu $dv; do
      py=$PWD/python; [ $which = $dv ] && py=$PWD/.$dv/python # each library with its own package
      env KDA_LIBRARY=$PWD/build-$which/libkda.so PYTHONPATH=$py:/tmp/site PYTHONUNBUFFERED=1 \
        python3 bench/bench_decode.py --out "$OUT/decode-$which" --no-crossover >"$LOG/bench_decode_$which.log" 2>&1
      echo "-- $which"; grep -E "ours" "$LOG/bench_decode_$which.log" | cut -c1-120
    done
    ;;
  *) echo "unknown step $step" ;;
  esac
done
