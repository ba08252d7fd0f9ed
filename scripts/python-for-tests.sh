#!/bin/sh
# Prints the Python that `make test` runs the Python tests with: $1 itself when it imports numpy and pytest;
# else $1 after `pip install numpy pytest`; else, where that Python refuses installs (PEP 668's
# "externally-managed-environment", as Debian's and Ubuntu's system Pythons do) or has no pip, a virtual
# environment in $2 (the build folder's venv/) made from $1, with numpy and pytest installed in it. The virtual
# environment sees $1's own packages (--system-site-packages: a torch installed there is tested too).
# Messages go to stderr; only the chosen Python's path goes to stdout.
# usage: python-for-tests.sh PYTHON VENV_DIR
set -eu
py=$1
venv=$2
has_deps() { "$1" -c "import numpy, pytest" 2>/dev/null; }

if has_deps "$py"; then command -v "$py"; exit 0; fi
if [ -x "$venv/bin/python" ] && has_deps "$venv/bin/python"; then echo "$venv/bin/python"; exit 0; fi
if [ ! -x "$venv/bin/python" ]; then
    log=$(mktemp)
    if "$py" -m pip install --quiet numpy pytest >"$log" 2>&1 && has_deps "$py"; then
        rm -f "$log"
        echo "make test: installed numpy and pytest for $py" >&2
        command -v "$py"
        exit 0
    fi
    if grep -q "externally-managed-environment" "$log"; then
        echo "make test: $py refuses pip installs (PEP 668): using a virtual environment in $venv" >&2
    else
        echo "make test: could not pip install numpy and pytest for $py: using a virtual environment in $venv" >&2
    fi
    rm -f "$log"
    if ! "$py" -m venv --system-site-packages "$venv" >&2; then
        rm -rf "$venv"
        echo "make test: could not create a virtual environment with $py -m venv: install it (Debian, Ubuntu: apt-get install python3-venv), or numpy and pytest for $py (apt-get install python3-numpy python3-pytest)" >&2
        exit 1
    fi
fi
"$venv/bin/python" -m pip install --quiet numpy pytest >&2 ||
    { echo "make test: could not install numpy and pytest into $venv" >&2; exit 1; }
echo "$venv/bin/python"
