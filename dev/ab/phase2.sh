#!/bin/bash
# phase 2: timing A/B, base and new alternated AB_ROUNDS times (default 3) into .ab/t/, then the fastest of each over
# every round there (a later call on the same warm machine, not carrying .ab again, adds rounds: .ab/ is in
# .gitignore, so the machine keeps it), then optional pytest on CUDA and compute-sanitizer
set -u
R=$PWD
BL=$(ls $R/.ab/base/build/libkda.so*| head -1); NL=$R/build-gpu/libkda.so
mkdir -p .ab/t; r0=$(ls .ab/t | grep -c '^base_' || true)
for r in $(seq $((r0 + 1)) $((r0 + ${AB_ROUNDS:-3}))); do
  KDA_LIBRARY=$BL PYTHONPATH=$R/.ab/base/python python3 dev/ab/ab.py time > .ab/t/base_$r.txt 2>&1
  KDA_LIBRARY=$NL PYTHONPATH=$R/.ab/base/python python3 dev/ab/ab.py time > .ab/t/new_$r.txt 2>&1
done
python3 - <<'PY'
def rd(p):
    d = {}
    for l in open(p):
        s = l.split()
        if len(s) == 2:
            try: d[s[0]] = float(s[1])
            except ValueError: pass
    return d
import glob
B = [rd(f) for f in sorted(glob.glob(".ab/t/base_*.txt"))]; N = [rd(f) for f in sorted(glob.glob(".ab/t/new_*.txt"))]
print(f"{len(B)} rounds")
print(f"{'shape':24s} {'base':>8s} {'new':>8s} {'new/base':>8s}")
for k in B[0]:
    b = min(x.get(k, 1e9) for x in B); n = min(x.get(k, 1e9) for x in N)
    print(f"{k:24s} {b:8.4f} {n:8.4f} {n/b:8.3f}")
PY
for f in .ab/t/new_1.txt; do grep -v "^[a-z_0-9A-Z]* [0-9.]*$" $f | tail -5; done
mkdir -p $OUT; cp .ab/t/*.txt $OUT/
if [ "${PHASE2_PYTEST:-0}" = 1 ]; then
  KDA_LIBRARY=$NL PYTHONPATH=$R/python timeout 200 python3 -m pytest -q -p no:logging tests/python 2>&1 | grep -E 'passed|failed|FAILED|Error' | tail -12
fi
for t in ${PHASE2_SAN:-}; do
  exe=$(cd build-gpu && ctest -R "^$t\$" -N -V | grep "Test command" | sed 's/.*Test command: //' | tr -d '"')
  for tool in memcheck racecheck synccheck; do
    echo "== $t $tool"; timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $exe 2>&1 | tail -2
  done
done
