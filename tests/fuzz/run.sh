#!/usr/bin/env bash
# Build the libFuzzer harnesses (clang; ASan + UBSan with float-cast-overflow, CUDA off) into build-fuzz/ and run
# each for SECONDS (default 60) in one process, one after the other, from its seed corpus:
#   fuzz_args         kda_forward / kda_decode arguments and small problems     tests/fuzz/corpus
#   fuzz_decode_bwd   kda_decode pools (2-D indices, row strides, accepted-token counts) and kda_backward
#                     arguments (gradient dtypes, NULL and aliased gradients)    tests/fuzz/corpus_decode_bwd
# New inputs go to build-fuzz/corpus-<target> (the seed directories are not modified). A report (crash, sanitizer
# error or contract violation) leaves its reproducer as build-fuzz/crash-* and makes this script fail, after the
# other targets have run.
#   tests/fuzz/run.sh            # CI: 60 s each
#   tests/fuzz/run.sh 900        # the longer run (docs/ALGORITHM.md records its result)
#   FUZZ_TARGETS=fuzz_decode_bwd tests/fuzz/run.sh 60   # one target
#   build-fuzz/fuzz_args build-fuzz/crash-...           # replay one input
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
SECONDS_TO_RUN=${1:-60}
BUILD=${FUZZ_BUILD:-build-fuzz}
TARGETS=${FUZZ_TARGETS:-fuzz_args fuzz_decode_bwd}
if ! command -v clang >/dev/null; then echo "fuzz: clang not found, skipped"; exit 0; fi
GEN=$(command -v ninja >/dev/null && echo "-G Ninja" || true)
# the same configuration as .ci/run's sanitizer build, so that CI builds the library once for both
CC=clang cmake -S . -B "$BUILD" $GEN -DKDA_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKDA_SANITIZE="address;undefined" -DKDA_FUZZ=ON >/dev/null
# shellcheck disable=SC2086
cmake --build "$BUILD" --target $TARGETS -j "${JOBS:-2}"
cd "$BUILD"
failed=""
for t in $TARGETS; do
    seeds="$ROOT/tests/fuzz/corpus"
    [ "$t" = fuzz_args ] || seeds="$ROOT/tests/fuzz/corpus_${t#fuzz_}"
    mkdir -p "corpus-$t"
    echo "fuzz: $t for $SECONDS_TO_RUN s (seeds: ${seeds#"$ROOT"/})"
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
        "./$t" -max_total_time="$SECONDS_TO_RUN" -max_len=2048 -timeout=20 -rss_limit_mb=3072 \
        -print_final_stats=1 "corpus-$t" "$seeds" || failed="$failed $t"
done
if [ -n "$failed" ]; then echo "fuzz: reports from:$failed (reproducers: $BUILD/crash-*)" >&2; exit 1; fi
