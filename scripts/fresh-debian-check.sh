#!/usr/bin/env bash
# The newcomer's path on a fresh Debian 12, as README says it: a debootstrap chroot with only the packages the
# README names, a clean clone of this repository's HEAD in it, then
#   1. make demo; make test          (system Python with PEP 668 marking: make test makes build/venv)
#   2. pip install ./python          in a fresh venv (build isolation: setuptools from PyPI)
#   3. pip install --no-build-isolation ./python   in a fresh venv with the build requirements installed first
#   4. the installed package imports and computes
# (make test includes install_check: examples/forward.c against the installed tree via find_package and
# pkg-config, shared and static.) Needs root, debootstrap and Debian's and PyPI's package servers.
# usage: scripts/fresh-debian-check.sh [ROOT_DIR]     (default /tmp/kda-debian; reused when it exists)
set -euo pipefail
root=${1:-/tmp/kda-debian}
repo=$(cd "$(dirname "$0")/.." && pwd)
# the README's packages, and git + ca-certificates to clone and reach PyPI
packages=build-essential,cmake,python3,python3-venv,pkg-config,git,ca-certificates
if [ ! -x "$root/usr/bin/cmake" ]; then
    debootstrap --variant=minbase --include=$packages bookworm "$root" http://deb.debian.org/debian
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# (a root made earlier with other packages gets these too; no Recommends, as debootstrap)
chroot "$root" /bin/sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends ${packages//,/ }" \
    >/dev/null
# a machine behind a TLS-inspecting proxy trusts its CA through /usr/local/share/ca-certificates: the chroot too
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi
rm -rf "$root/src/libkda"
git clone -q "$repo" "$root/src/libkda"
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
trap 'umount "$root/proc" 2>/dev/null || true' EXIT
chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 /bin/bash -euo pipefail -c '
cd /src/libkda
test -f /usr/lib/python3.11/EXTERNALLY-MANAGED && echo "== system Python is marked externally managed (PEP 668)"
! command -v nvcc >/dev/null && echo "== no nvcc: the CPU backends only"
echo "== make demo";  make demo DEMO_ARGS="--T 512" 2>&1 | tail -n 12
echo "== make test"
make test >/tmp/make-test.log 2>&1 || { tail -n 60 /tmp/make-test.log; exit 1; }
grep -E "tests passed|Skipped tests|install_check|example_forward|make test:|passed.*skipped" /tmp/make-test.log
echo "== pip install ./python (build isolation)"
rm -rf /tmp/v1 && python3 -m venv /tmp/v1 && /tmp/v1/bin/pip install -q ./python
(cd / && /tmp/v1/bin/python -c "import kda; print(\"imports\", kda.library_path())")
echo "== pip install --no-build-isolation ./python (build requirements installed first)"
rm -rf /tmp/v2 && python3 -m venv /tmp/v2 && /tmp/v2/bin/pip install -q "setuptools>=70.1" numpy
/tmp/v2/bin/pip install -q --no-build-isolation ./python
(cd / && /tmp/v2/bin/python -c "
import numpy as np, kda
x = np.random.default_rng(0).standard_normal((1, 16, 1, 32)).astype(np.float32)
o, _ = kda.chunk_kda(x, x, x, -np.ones((1, 16, 1, 32), np.float32), np.full((1, 16, 1), 0.5, np.float32))
print(\"computes\", o.shape, kda.library_path())")
ls /tmp/v2/lib/python3.11/site-packages | grep -i "^kda"
echo "== all passed"
'
