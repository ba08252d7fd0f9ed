#!/bin/bash
# phase 2: timing A/B, base and new alternated twice, then optional pytest on CUDA and compute-sanitizer
set -u
R=$PWD
BL=$(ls /tmp/abbase/build/libkda.so*| head -1); NL=$R/build-gpu/libkda.so
for r in 1 2; do
  KDA_LIBRARY=$BL PYTHONPATH=/tmp/abbase/python python3 dev/ab/ab.py time > /tmp/t_base_$r.txt 2>&1
  KDA_LIBRARY=$NL PYTHONPATH=/tmp/abbase/python python3 dev/ab/ab.py time > /tmp/t_new_$r.txt 2>&1
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
b1, b2, n1, n2 = (rd(f"/tmp/t_{w}_{r}.txt") for w, r in (("base",1),("base",2),("new",1),("new",2)))
print(f"{'shape':24s} {'base':>8s} {'new':>8s} {'new/base':>8s}")
for k in b1:
    b = min(b1[k], b2.get(k, 1e9)); n = min(n1.get(k, 1e9), n2.get(k, 1e9))
    print(f"{k:24s} {b:8.4f} {n:8.4f} {n/b:8.3f}")
PY
for f in /tmp/t_new_1.txt; do grep -v "^[a-z_0-9A-Z]* [0-9.]*$" $f | tail -5; done
mkdir -p $OUT; cp /tmp/t_*.txt $OUT/
if [ "${PHASE2_PYTEST:-0}" = 1 ]; then
  KDA_LIBRARY=$NL PYTHONPATH=$R/python timeout 200 python3 -m pytest -q -x tests/python 2>&1 | tail -8
fi
for t in ${PHASE2_SAN:-}; do
  exe=$(cd build-gpu && ctest -R "^$t\$" -N -V | grep "Test command" | sed 's/.*Test command: //')
  for tool in memcheck racecheck synccheck; do
    echo "== $t $tool"; timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $exe 2>&1 | tail -2
  done
done
