#!/bin/sh
# mpi_run.sh MPIEXEC NP PROGRAM [ARGS...]: PROGRAM over NP ranks on this host. With Open MPI, --oversubscribe (it
# refuses more ranks than cores otherwise) and, when run as root (containers, CI), --allow-run-as-root.
set -eu
mpiexec=$1
np=$2
shift 2
flags=""
if "$mpiexec" --version 2>/dev/null | grep -q 'Open MPI\|OpenRTE'; then
    flags="--oversubscribe"
    [ "$(id -u)" != 0 ] || flags="$flags --allow-run-as-root"
fi
# shellcheck disable=SC2086
exec "$mpiexec" $flags -np "$np" "$@"
