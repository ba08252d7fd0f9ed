#!/usr/bin/env bash
# Device jobs longer than one call (10 minutes): a job runs in its own process session, so that it outlives the
# call that started it, as long as the machine stays warm (the next call within its idle time).
#   scripts/bg.sh start NAME CMD...   start CMD (in the repository root) as job NAME; its output in /tmp/bg/NAME.log
#   scripts/bg.sh wait NAME SECONDS   wait up to SECONDS for job NAME; print its log's last lines; exit 0 once
#                                     it has ended (its exit status in /tmp/bg/NAME.rc), 3 while it still runs
set -u
mkdir -p /tmp/bg
cmd=${1:-}; name=${2:-}
[ -n "$cmd" ] && [ -n "$name" ] || { sed -n 2,7p "$0"; exit 2; }
case "$cmd" in
  start)
    shift 2
    cd "$(dirname "$0")/.." || exit 1
    rm -f "/tmp/bg/$name.rc"
    setsid bash -c '"$@" >"/tmp/bg/'"$name"'.log" 2>&1; echo $? >"/tmp/bg/'"$name"'.rc"' bg "$@" </dev/null &
    echo "started $name (pid $!)"
    ;;
  wait)
    end=$(( $(date +%s) + ${3:-0} ))
    while [ ! -f "/tmp/bg/$name.rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    tail -n "${BG_TAIL:-40}" "/tmp/bg/$name.log" 2>/dev/null
    if [ -f "/tmp/bg/$name.rc" ]; then echo "job $name ended: rc $(cat "/tmp/bg/$name.rc")"; exit 0; fi
    echo "job $name still running"; exit 3
    ;;
  *) sed -n 2,7p "$0"; exit 2 ;;
esac
