#!/usr/bin/env bash
# Development: where prep's instructions, stalls and shared-memory wavefronts go, per SASS instruction (ncu source
# counters of one prep launch of B1 T8192 H64), next to the stage timings of B2 T8192 H64. Files in $OUT.
set -u
OUT=${OUT:-/tmp/kda-out}
KDA_LIBRARY=$PWD/build-gpu/libkda.so PYTHONPATH=$PWD/python ncu --clock-control none -k regex:prep --launch-skip 3 \
  --launch-count 1 --section SourceCounters --section WarpStateStats -o "$OUT/prep" -f \
  python3 bench/stages.py --shapes B1T8192H64 --sets all --reps 1 >"$OUT/ncu.log" 2>&1
ncu --import "$OUT/prep.ncu-rep" --page source --csv --print-source sass >"$OUT/prep_sass.csv" 2>>"$OUT/ncu.log"
rm -f "$OUT/prep.ncu-rep"
echo "prep_sass.csv: $(wc -l <"$OUT/prep_sass.csv") lines"; head -2 "$OUT/prep_sass.csv" | cut -c1-400
