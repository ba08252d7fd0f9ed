#!/bin/sh
# install_check: `cmake --install` into a fresh prefix, then build examples/forward.c against the installed tree
# as a user would, four ways, and run each build on the CPU backend:
#   find_package(kda CONFIG)  -> kda::kda (libkda.so) and kda::kda_static (libkda.a)
#   pkg-config                -> `--libs kda` (libkda.so) and `--static --libs kda` (libkda.a)
# A shared build is checked to load libkda.so from the prefix through its RUNPATH (no LD_LIBRARY_PATH), a
# static one to need no libkda.so at all. The installed CLI must run from the prefix as it is.
# usage: install_check.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1
src=$2
cc=${CC:-cc}
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
unset LD_LIBRARY_PATH KDA_LIBRARY || true

cmake --install "$build" --prefix "$prefix" >/dev/null
pc=$(find "$prefix" -name kda.pc | head -n 1)
[ -n "$pc" ] || { echo "FAIL: kda.pc was not installed"; exit 1; }
cfg=$(find "$prefix" -name kda-config.cmake | head -n 1)
[ -n "$cfg" ] || { echo "FAIL: kda-config.cmake was not installed"; exit 1; }
libdir=$(dirname "$(dirname "$pc")")

"$prefix/bin/kda" --version || { echo "FAIL: the installed CLI does not run"; exit 1; }

needs_libkda() { # does the program $1 load libkda.so?
    readelf -d "$1" | grep -q 'NEEDED.*libkda\.so'
}
run() { # name, program: run it on the CPU backend, from another directory, with a clean environment
    (cd / && "$2" cpu) >"$prefix/$1.log" 2>&1 || { echo "FAIL: $1:"; cat "$prefix/$1.log"; exit 1; }
    echo "ok   $1: $(tail -n 1 "$prefix/$1.log")"
}

# ---- find_package(kda CONFIG) ---------------------------------------------------------------------------------
gen=""
command -v ninja >/dev/null 2>&1 && gen="-G Ninja"
for kind in shared static; do
    b="$prefix/build-cmake-$kind"
    static=OFF
    [ "$kind" = static ] && static=ON
    # shellcheck disable=SC2086
    cmake -S "$src/examples" -B "$b" $gen -DCMAKE_PREFIX_PATH="$prefix" -DKDA_EXAMPLE_STATIC=$static \
        -DCMAKE_BUILD_TYPE=Release >"$prefix/cmake-$kind.log" 2>&1 &&
        cmake --build "$b" >>"$prefix/cmake-$kind.log" 2>&1 ||
        { echo "FAIL: find_package build ($kind):"; cat "$prefix/cmake-$kind.log"; exit 1; }
    if [ "$kind" = shared ]; then needs_libkda "$b/forward" || { echo "FAIL: kda::kda did not link libkda.so"; exit 1; }
    else ! needs_libkda "$b/forward" || { echo "FAIL: kda::kda_static linked libkda.so"; exit 1; }; fi
    run "find_package-$kind" "$b/forward"
done

# ---- pkg-config -----------------------------------------------------------------------------------------------
if ! command -v pkg-config >/dev/null 2>&1; then
    echo "SKIPPED: the pkg-config builds (pkg-config is not installed); the find_package builds passed"
    exit 77
fi
export PKG_CONFIG_PATH="$(dirname "$pc")"
# shared: -lkda finds libkda.so; the RUNPATH tells the loader where it is (see README: Linking)
# shellcheck disable=SC2046
"$cc" "$src/examples/forward.c" $(pkg-config --cflags --libs kda) -lm -Wl,-rpath,"$libdir" \
    -o "$prefix/forward-pc-shared"
needs_libkda "$prefix/forward-pc-shared" || { echo "FAIL: pkg-config --libs did not link libkda.so"; exit 1; }
run pkg-config-shared "$prefix/forward-pc-shared"
# static: libkda.a by name (-l:libkda.a: beside libkda.so, -lkda would pick the shared one) and what it needs
libs=$(pkg-config --static --libs kda | sed 's/-lkda\( \|$\)/-l:libkda.a\1/')
# shellcheck disable=SC2046,SC2086
"$cc" "$src/examples/forward.c" $(pkg-config --cflags kda) $libs -lm -o "$prefix/forward-pc-static"
! needs_libkda "$prefix/forward-pc-static" || { echo "FAIL: the static pkg-config build loads libkda.so"; exit 1; }
run pkg-config-static "$prefix/forward-pc-static"
echo "installed library OK: find_package and pkg-config, shared and static"
