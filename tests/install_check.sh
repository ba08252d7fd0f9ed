#!/bin/sh
# install_pkg_config: `cmake --install` into a fresh prefix, then build and run a program against it through
# pkg-config, as a user of the installed library would.
set -eu
build=$1
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
pc=$(find "$prefix" -name kda.pc | head -n 1)
[ -n "$pc" ] || { echo "kda.pc was not installed"; exit 1; }
cat >"$prefix/example.c" <<'C'
#include <kda.h>
#include <stdio.h>
int main(void) {
    kda_context_t *ctx;
    if (kda_create(&ctx, KDA_BACKEND_CPU, 0) != KDA_STATUS_SUCCESS) return 1;
    kda_args_t a;
    kda_args_init(&a);
    a.head_dim_k = 0; /* invalid on purpose: the installed library must name the argument */
    size_t ws;
    kda_status_t st = kda_forward_workspace_size(ctx, &a, &ws);
    printf("%s: %s\n", kda_status_string(st), kda_last_error());
    kda_destroy(ctx);
    return kda_version() == KDA_VERSION && st == KDA_STATUS_INVALID_VALUE ? 0 : 1;
}
C
PKG_CONFIG_PATH=$(dirname "$pc") cc "$prefix/example.c" $(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags --libs kda) \
  -Wl,-rpath,"$(dirname "$(dirname "$pc")")" -o "$prefix/example"
"$prefix/example" | grep -q "'head_dim_k'"
echo "installed library OK"
