#!/usr/bin/env bash
# One device call: build for sm_90a, run the GPU tests (accuracy table), then by mode
#   full   compute-sanitizer (memcheck, racecheck) + stage timings + ours vs FLA
#   check  compute-sanitizer + stage timings
#   bench  ours vs FLA (bench/bench_fla.py; the FLA wheels travel in .whl/, carried)
#   prof   stage timings (KDA_DEV_SKIP) and an ncu profile of two shapes
#   quick  tests only, plus CLI timings of the benchmark shapes
#   final  stage timings, an ncu stall profile of the recurrence, ours vs FLA
#   dev    stage timings in one process (bench/stages.py, STAGE_ARGS); ALT=dir also times a second build with
#          dir's .cu files swapped in, on the same card, ALT=file.patch one with the patch applied
#          (bench/experiments/ holds patches waiting for their A/B)
#   ncu    utilisation and stall reasons of the kernels of B2 T8192 H64 (NCU_KERNELS)
# Any mode: SANITIZE=1 adds memcheck + racecheck on two GPU tests, PYTESTS=1 the Python suite, SKIP_TESTS=1
# leaves the GPU tests out (a second mode in the same call).
# Logs and results go to $OUT; a short table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/kda-out}
mkdir -p "$OUT"
MODE=${1:-full}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DKDA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build build-gpu -j16 >"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"

if [ -z "${SKIP_TESTS:-}" ]; then
  (cd build-gpu && ctest -R '^gpu_' --output-on-failure -j1 --timeout 300) >"$OUT/gpu_tests.log" 2>&1
  grep -E "tests passed|tests failed" "$OUT/gpu_tests.log"
  grep -E "CHECK|FAIL" "$OUT/gpu_tests.log" | head -20
  echo "largest errors:"; grep -E "^case" "$OUT/gpu_tests.log" | sort -k4 -g | tail -3 | cut -c1-80
fi

if [ "$MODE" = full ] || [ "$MODE" = check ]; then
  for t in gpu_fwd_varlen_empty_seq gpu_fwd_state_pool_inplace; do
    compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/test_gpu $t >"$OUT/sanitizer.log" 2>&1
    echo "memcheck $t rc=$? ($(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log"))"
  done
  for t in gpu_fwd_gva_4x; do
    compute-sanitizer --tool racecheck --error-exitcode 9 build-gpu/tests/test_gpu $t >"$OUT/sanitizer.log" 2>&1
    echo "racecheck $t rc=$? ($(grep -E 'RACECHECK SUMMARY' "$OUT/sanitizer.log"))"
  done
fi

demo() { ./build-gpu/kda demo --backend cuda --no-check --state-v-first --json "$@" | tail -1 |
         python3 -c "import json,sys; print('%.3f' % json.loads(sys.stdin.read())['ms'])"; }

if [ "$MODE" = full ] || [ "$MODE" = prof ] || [ "$MODE" = check ] || [ "$MODE" = final ]; then
  echo "stage timings, ms (CLI, median of 10): all | -A/Aqk | -T_II | -W,U | recurrence only | prep only"
  for shape in "--B 2 --T 8192 --hqk 64 --hv 64" ${STAGE_SHAPES:-}; do
    line="$shape:"
    for m in 0 1 2 4 8 16; do line="$line $(KDA_DEV_SKIP=$m demo --iters 10 $shape)"; done
    echo "  $line"
  done
fi

if [ -n "${SANITIZE:-}" ]; then
  for bv in 32 64 128; do  # the recurrence's tilings: 32 mma.sync, 64 and 128 wgmma (sm_90)
  for tool in memcheck racecheck; do for t in gpu_fwd_varlen_empty_seq gpu_fwd_gva_4x; do
    KDA_DEV_BV=$bv compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/test_gpu $t >"$OUT/sanitizer.log" 2>&1
    echo "bv $bv $tool $t rc=$? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | head -1))"
  done; done; done
fi

if [ -n "${PYTESTS:-}" ]; then
  KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python timeout 300 python3 -m pytest -q -x tests/python \
    >"$OUT/pytest.log" 2>&1; echo "python tests: $(tail -1 "$OUT/pytest.log")"
fi

if [ "$MODE" = dev ]; then
  # stage timings by the development skip bits (bench/stages.py), one process, CUDA events
  if [ -n "${ALT:-}" ]; then # A/B on the same card: a second build with the files under $ALT swapped in,
                            # or, when $ALT is a .patch file (git diff of the tree), with it applied
    rm -rf /tmp/alt && mkdir -p /tmp/alt && cp -r CMakeLists.txt kda.pc.in include src tools tests python /tmp/alt/ 2>/dev/null
    cp -r cmake /tmp/alt/ 2>/dev/null
    case "$ALT" in
      *.patch) here=$PWD; patch -s -d /tmp/alt -p1 <"$ALT" 2>/dev/null || (cd /tmp/alt && git apply "$here/$ALT") ||
                 echo "ALT patch did not apply" ;;
      *) cp "$ALT"/*.cu /tmp/alt/src/cuda/ ;;
    esac
    (cmake -S /tmp/alt -B /tmp/alt/b -G Ninja -DKDA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" && cmake --build /tmp/alt/b -j16) >"$OUT/alt.log" 2>&1 || tail -5 "$OUT/alt.log"
    echo "ALT ($ALT):"
    KDA_LIBRARY=/tmp/alt/b/libkda.so PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 python3 bench/stages.py ${STAGE_ARGS:-} 2>&1 | grep -v Warn
    echo "CURRENT:"
  fi
  KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 \
    python3 bench/stages.py ${STAGE_ARGS:-} 2>&1 | tee "$OUT/stages.log" | grep -v Warn
fi

if [ "$MODE" = ncu ]; then
  # one kernel of B2 T8192 H64 per name in NCU_KERNELS: utilisation and stall reasons
  M=gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed.sum,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active
  for st in barrier long_scoreboard short_scoreboard wait mio_throttle math_pipe_throttle not_selected lg_throttle no_instruction branch_resolving dispatch_stall; do
    M=$M,smsp__average_warp_latency_issue_stalled_$st.ratio; done
  for kn in ${NCU_KERNELS:-prep recurrence}; do
    KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python ncu --clock-control none -k regex:$kn --launch-skip 2 --launch-count 1 \
      --metrics $M --csv python3 bench/stages.py --shapes B2T8192H64 --sets all --reps 1 >"$OUT/ncu_$kn.csv" 2>"$OUT/ncu.err"
    python3 - "$OUT/ncu_$kn.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, mi, vi = (hdr.index(x) for x in ("Kernel Name", "Metric Name", "Metric Value"))
print(rows[0][ki][:40] if rows else "no rows")
print("  " + "  ".join("%s=%s" % (r[mi].replace("smsp__average_warp_latency_issue_stalled_", "stall_").replace(".avg.pct_of_peak_sustained_active", "%").replace(".ratio", ""), r[vi]) for r in rows))
PY
  done
fi

if [ "$MODE" = prof ] || [ "$MODE" = final ]; then
  M=gpu__time_duration.sum,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio,smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_tex_throttle.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio,smsp__average_warp_latency_issue_stalled_branch_resolving.ratio,smsp__average_warp_latency_issue_stalled_no_instruction.ratio,smsp__average_warp_latency_issue_stalled_drain.ratio,smsp__average_warp_latency_issue_stalled_imc_miss.ratio,smsp__average_warp_latency_issue_stalled_misc.ratio
  M_OLD=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  for shape in "--B 1 --T 32768 --hqk 32 --hv 32"; do
    ncu --clock-control none --launch-skip 2 --launch-count 2 --metrics $M --csv \
      ./build-gpu/kda demo --backend cuda --no-check --iters 1 $shape >"$OUT/ncu.csv" 2>"$OUT/ncu.err"
    echo "ncu $shape"
    python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, mi, vi, ui = (hdr.index(x) for x in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
short = {"gpu__time_duration.sum": "us", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
         "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%", "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
         "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tc%"}
out = {}
for r in rows:
    k = r[ki].split("(")[0].split("<")[0].replace("void ", "")
    v = float(r[vi].replace(",", ""))
    if r[mi] == "gpu__time_duration.sum": v *= {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(r[ui], 1.0)
    out.setdefault(k, {})[short.get(r[mi], r[mi])] = v
for k, d in out.items():
    print("  %-24s " % k + " ".join("%s %.1f" % (m, d[m]) for m in ["us", "dram%", "sm%", "occ%", "tc%"] if m in d))
    st = sorted(((v, m.replace("smsp__average_warp_latency_issue_stalled_", "").replace(".ratio", "")) for m, v in d.items() if "stalled" in m), reverse=True)
    print("    stalls (cycles per issued instruction): " + ", ".join("%s %.2f" % (n, v) for v, n in st[:7]))
PY
  done
fi

if [ -d .whl ] && { [ "$MODE" = full ] || [ "$MODE" = bench ] || [ "$MODE" = final ]; }; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python:/tmp/site PYTHONUNBUFFERED=1 \
    python3 bench/bench_fla.py --out "$OUT" ${BENCH_ARGS:-} >"$OUT/bench_fla.log" 2>&1
  grep -vE "Warning|warn" "$OUT/bench_fla.log" | tail -16
fi

if [ "$MODE" = quick ]; then
  echo "shape ms (CLI, median of 20)"
  for shape in "--B 2 --T 8192 --hqk 64 --hv 64" "--B 1 --T 32768 --hqk 32 --hv 32" "--B 1 --T 512 --hqk 64 --hv 64" \
               "--varlen 1024,1024,1024,1024,1024,1024,1024,1024 --hqk 64 --hv 64"; do
    echo "  $(demo --iters 20 $shape)  $(KDA_DEV_SKIP=8 demo --iters 20 $shape) (recurrence only)  $shape"
  done
fi
