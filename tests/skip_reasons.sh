#!/bin/sh
# Lists the tests of the last `ctest` run in BUILD_DIR that were skipped, each with the reason it printed
# ("SKIPPED: ..."): CTest itself shows only "Skipped". `make test` runs it after ctest.
# usage: skip_reasons.sh BUILD_DIR
log=${1:-.}/Testing/Temporary/LastTest.log
[ -f "$log" ] || exit 0
awk '
/^[0-9]+\/[0-9]+ Testing: / { name = $3 }
/^SKIPPED: / { sub(/^SKIPPED: /, ""); reasons[name] = $0; n++ }
END {
    if (!n) exit
    printf "Skipped tests and why (%d):\n", n
    for (t in reasons) printf "  %-36s %s\n", t, reasons[t] | "sort"
}' "$log"
