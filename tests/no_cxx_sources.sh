#!/bin/sh
# no_cxx_sources: the project is C11 and CUDA C ("No C++ anywhere"): no C++ source or header (*.cpp, *.cc, *.cxx,
# *.c++, *.hpp, *.hh, *.hxx, *.h++) may be tracked in git, nor lie untracked outside the ignored folders (a file
# about to be added). The host emulation of the kernels (dev/bwd_emu) is compiled by g++ for the kernels' template
# tile sizes, but its files are *.emu.cu written as C. Skipped (77) when SOURCE_DIR is not a git work tree.
# usage: no_cxx_sources.sh SOURCE_DIR
set -u
src=${1:-.}
if ! command -v git >/dev/null 2>&1 || ! git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    echo "SKIPPED: $src is not a git work tree (or git is missing): the tracked files cannot be listed"
    exit 77
fi
files=$(git -C "$src" ls-files --cached --others --exclude-standard) || { echo "FAIL: git ls-files failed"; exit 1; }
n=$(printf '%s\n' "$files" | grep -c .)
[ "$n" -gt 0 ] || { echo "FAIL: git lists no files in $src"; exit 1; }
cxx=$(printf '%s\n' "$files" | grep -iE '\.(cpp|cc|cxx|c\+\+|hpp|hh|hxx|h\+\+)$')
if [ -n "$cxx" ]; then
    echo "FAIL: C++ sources in the tree (the project is C11 and CUDA C):"
    printf '%s\n' "$cxx"
    exit 1
fi
echo "no C++ sources among the $n files of the tree"
