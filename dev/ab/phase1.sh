#!/bin/bash
# phase 1: build the base (.ab/base.tar.gz, dev/ab/prepare.sh) and this tree for sm_90a, hash outputs, run the GPU CTests
set -u
R=$PWD
rm -rf $R/.ab/base && mkdir -p $R/.ab/base && tar xzf .ab/base.tar.gz -C $R/.ab/base
( cd $R/.ab/base && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_WITH_CUDA=ON -DKDA_CUDA_ARCHS=90a >/dev/null && ninja -C build -j8 libkda.so >/tmp/base_build.log 2>&1; echo "base build rc $?"; tail -3 /tmp/base_build.log ) &
( cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_WITH_CUDA=ON -DKDA_CUDA_ARCHS=90a >/dev/null && ninja -C build-gpu -j8 >/tmp/new_build.log 2>&1; echo "new build rc $?" ) &
wait
grep -i "spill\|error" /tmp/new_build.log | grep -v "0 bytes spill" | head -20
tail -3 /tmp/new_build.log
BL=$(ls $R/.ab/base/build/libkda.so*| head -1); NL=$R/build-gpu/libkda.so
KDA_LIBRARY=$BL PYTHONPATH=$R/.ab/base/python python3 dev/ab/ab.py hash > /tmp/h_base.txt 2>/tmp/h_base.err; echo "hash base rc $?"
KDA_LIBRARY=$NL PYTHONPATH=$R/.ab/base/python python3 dev/ab/ab.py hash > /tmp/h_newlib.txt 2>/tmp/h_newlib.err; echo "hash newlib rc $?"
KDA_LIBRARY=$NL PYTHONPATH=$R/python python3 dev/ab/ab.py hash > /tmp/h_new.txt 2>/tmp/h_new.err; echo "hash new rc $?"
tail -3 /tmp/h_base.err /tmp/h_newlib.err /tmp/h_new.err
echo "cases: $(wc -l < /tmp/h_base.txt)"
echo "== newlib vs base:"; diff /tmp/h_base.txt /tmp/h_newlib.txt && echo IDENTICAL
echo "== new pkg vs base:"; diff /tmp/h_base.txt /tmp/h_new.txt && echo IDENTICAL
mkdir -p $OUT; cp /tmp/h_*.txt $OUT/ 2>/dev/null
( cd build-gpu && timeout 240 ctest -R gpu_ -j4 --output-on-failure 2>&1 | tail -15 )
