/* The x86-64 level of the running CPU, as the CPU chunked path's dispatch (chunk.c) and CMake's
 * KDA_CPU_ISAS=native probe (cmake/x86_level.c) both read it: one feature test for the two. x86-64, GCC or clang. */
#ifndef KDA_CPU_X86_LEVEL_H
#define KDA_CPU_X86_LEVEL_H

/* 4 (x86-64-v4), 3 (x86-64-v3) or 0 (below v3). */
static inline int kda_cpu_x86_level(void) {
    __builtin_cpu_init();
    /* v3 also has F16C, LZCNT, MOVBE: every CPU with AVX2, FMA and BMI2 has them (clang's __builtin_cpu_supports
     * cannot test F16C) */
    const int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
                   __builtin_cpu_supports("bmi2");
    const int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512cd");
    return v4 ? 4 : v3 ? 3 : 0;
}

#endif /* KDA_CPU_X86_LEVEL_H */
