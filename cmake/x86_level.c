/* CMakeLists.txt's KDA_CPU_ISAS=native: prints the configuring machine's x86-64 level (4, 3 or 0). */
#include <stdio.h>

#include "x86_level.h"

int main(void) {
    printf("%d\n", kda_cpu_x86_level());
    return 0;
}
