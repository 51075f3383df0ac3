/* Which instruction-set level of a native CPU kernel this CPU runs (the same levels for every kernel):
 * 0 generic, always; 1 AVX2 + FMA + F16C; 2 that + AVX-512 F/BW/VL, and AVX-512 BF16 when `need_bf16`.
 * Each kernel's generic build exports `<kernel>_isa_supported(level)` through this function.
 */
#ifndef LORAPLEX_CPU_ISA_H
#define LORAPLEX_CPU_ISA_H

static inline int loraplex_isa_supported(int level, int need_bf16) {
    if (level == 0) return 1;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (level == 1) return avx2 != 0;
    if (level == 2)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && (!need_bf16 || __builtin_cpu_supports("avx512bf16"));
#else
    (void)need_bf16;
#endif
    return 0;
}

#endif
