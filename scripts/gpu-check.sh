#!/usr/bin/env bash
# One device call: build for sm_90a, run the GPU tests (accuracy table), compute-sanitizer, and time the
# benchmark shapes with the CLI; a short table last. Logs go to $OUT.
#   usage: bash scripts/gpu-check.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/kda-out}
mkdir -p "$OUT"
MODE=${1:-full}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo none)$(git diff --quiet 2>/dev/null || echo +dirty)" | tee -a "$OUT/gpu.txt"

t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DKDA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
cmake --build build-gpu -j16 >"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"

# GPU tests
(cd build-gpu && ctest -R '^gpu_' --output-on-failure -j1 --timeout 300) >"$OUT/gpu_tests.log" 2>&1
grep -E "tests passed|tests failed" "$OUT/gpu_tests.log"
grep -E "CHECK|FAIL" "$OUT/gpu_tests.log" | head -20
grep -E "^case" "$OUT/gpu_tests.log" | sort -k4 -g | tail -5

if [ "$MODE" = full ]; then
  for t in gpu_fwd_varlen_empty_seq gpu_fwd_state_pool_inplace; do
    compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/test_gpu $t >"$OUT/memcheck_$t.log" 2>&1
    echo "memcheck $t rc=$? $(grep -c 'Invalid' "$OUT/memcheck_$t.log") invalid"
  done
  compute-sanitizer --tool racecheck --error-exitcode 9 build-gpu/tests/test_gpu gpu_fwd_gva_4x >"$OUT/racecheck.log" 2>&1
  echo "racecheck rc=$? $(grep -ci 'hazard' "$OUT/racecheck.log") hazards"
fi

# per-kernel profile of two shapes (ncu replays each kernel; clocks left alone)
if [ "$MODE" = full ] || [ "$MODE" = prof ]; then
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  for shape in "--B 2 --T 8192 --hqk 64 --hv 64" "--B 1 --T 32768 --hqk 32 --hv 32"; do
    ncu --clock-control none --launch-skip 3 --launch-count 3 --metrics $M --csv \
      ./build-gpu/kda demo --backend cuda --no-check --iters 1 $shape >"$OUT/ncu.csv" 2>"$OUT/ncu.err"
    echo "ncu $shape"
    python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; rows = rows[1:]
ki, mi, vi, ui = hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
short = {"gpu__time_duration.sum": "us", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
         "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%", "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
         "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tc%"}
out = {}
for r in rows:
    k = r[ki].split("(")[0].split("<")[0]
    v = r[vi].replace(",", "")
    try: v = float(v)
    except ValueError: pass
    if r[mi] == "gpu__time_duration.sum": v = v * {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r[ui], 1.0)
    out.setdefault(k, {})[short.get(r[mi], r[mi])] = v
for k, d in out.items():
    print("  %-26s " % k + " ".join("%s %.1f" % (m, d[m]) for m in ["us", "dram%", "sm%", "occ%", "tc%"] if m in d))
PY
  done
fi

# timings of ours (CLI, median of 20, host-timed around a synchronised call)
run() { ./build-gpu/kda demo --backend cuda --no-check --iters 20 --state-v-first --json "$@" | tail -1; }
{
  echo "B1_T8192_H64 $(run --B 1 --T 8192 --hqk 64 --hv 64)"
  echo "B2_T8192_H64 $(run --B 2 --T 8192 --hqk 64 --hv 64)"
  echo "B8_T4096_H32 $(run --B 8 --T 4096 --hqk 32 --hv 32)"
  echo "B1_T512_H64 $(run --B 1 --T 512 --hqk 64 --hv 64)"
  echo "B1_T32768_H32 $(run --B 1 --T 32768 --hqk 32 --hv 32)"
  echo "varlen6_H64 $(run --varlen 1300,547,2048,963,271,3063 --hqk 64 --hv 64)"
  echo "varlen8x1024_H64 $(run --varlen 1024,1024,1024,1024,1024,1024,1024,1024 --hqk 64 --hv 64)"
  echo "GVA_B2_T8192_16_64 $(run --B 2 --T 8192 --hqk 16 --hv 64)"
} >"$OUT/cli_bench.log" 2>&1
echo "shape ms"
python3 - "$OUT/cli_bench.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    name, _, js = line.partition(" ")
    try:
        print(f"{name:22s} {json.loads(js)['ms']:.3f}")
    except Exception:
        print(name, js.strip()[:200])
PY
