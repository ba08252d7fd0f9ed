#!/usr/bin/env bash
# FLA's tests/ops/test_kda.py with libkda swapped in (tests/fla/conftest.py), on a GPU machine.
#   scripts/fla-tests.sh FLA_SRC BUILD [pytest args...]
# FLA_SRC holds FLA's source tree (fla/ and tests/ops/test_kda.py; e.g. `git archive HEAD fla tests/ops/test_kda.py`
# of fla-org/flash-linear-attention unpacked into an ignored folder), BUILD a libkda build with CUDA.
set -uo pipefail
src=$(cd "$1" && pwd); build=$(cd "$2" && pwd); shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
cp -r "$src/fla" "$work/" && mkdir -p "$work/tests/ops" && cp "$src/tests/ops/test_kda.py" "$work/tests/ops/"
cp "$here/tests/fla/conftest.py" "$work/tests/ops/conftest.py"
cd "$work" && FLA_FLASH_KDA=0 KDA_LIBRARY="$build/libkda.so" PYTHONPATH="$work:$here/python" \
  python3 -m pytest -q -p no:cacheprovider tests/ops/test_kda.py -k "not flash_kda and not ascend" "$@"
