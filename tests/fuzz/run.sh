#!/usr/bin/env bash
# Build the libFuzzer harness (clang; ASan + UBSan with float-cast-overflow, CUDA off) into build-fuzz/ and run it
# for SECONDS (default 60) in one process, starting from the seed corpus in tests/fuzz/corpus.
# New inputs go to build-fuzz/corpus (the seed directory is not modified). A report (crash, sanitizer error or
# contract violation) leaves its reproducer as build-fuzz/crash-* and makes this script fail.
#   tests/fuzz/run.sh            # CI: 60 s
#   tests/fuzz/run.sh 900        # the longer run (docs/ALGORITHM.md records its result)
#   build-fuzz/fuzz_args build-fuzz/crash-...   # replay one input
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
SECONDS_TO_RUN=${1:-60}
BUILD=${FUZZ_BUILD:-build-fuzz}
if ! command -v clang >/dev/null; then echo "fuzz: clang not found, skipped"; exit 0; fi
GEN=$(command -v ninja >/dev/null && echo "-G Ninja" || true)
# the same configuration as .ci/run's sanitizer build, so that CI builds the library once for both
CC=clang cmake -S . -B "$BUILD" $GEN -DKDA_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKDA_SANITIZE="address;undefined" -DKDA_FUZZ=ON >/dev/null
cmake --build "$BUILD" --target fuzz_args -j "${JOBS:-2}"
mkdir -p "$BUILD/corpus"
cd "$BUILD"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
    ./fuzz_args -max_total_time="$SECONDS_TO_RUN" -max_len=2048 -timeout=20 -rss_limit_mb=3072 -print_final_stats=1 \
    corpus "$ROOT/tests/fuzz/corpus"
