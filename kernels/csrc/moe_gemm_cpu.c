/* The routed experts' small GEMMs on the CPU: for the step's (token, expert) rows sorted by expert,
 *
 *     ys[r, o] = sum_k xs[r, k] * w[e, o, k]        for the counts[e] rows r of expert e (in expert order)
 *
 * for every expert with 1..max_rows rows (others are skipped: the caller multiplies them). Decode gives
 * each active expert a few rows, and a GEMM library then re-blocks the expert's weight inside each call
 * (or, MKL on AMD CPUs, runs an SSE path) at a fraction of the memory bandwidth; here each weight row is
 * streamed once for all of its expert's rows, one row at a time in address order against n <= 4
 * activation rows (up to four float32 accumulators, eight on plain SSE2: moe_gemm_block.h), the lanes summed
 * once at the end.
 * Float32 accumulation; bfloat16 values are widened in registers and each output rounded once (to nearest
 * even), as a bfloat16 GEMM rounds. Threads split the (expert, block of output columns) units; each output
 * is one thread's single dot product, so results do not depend on the thread count.
 *
 * The same library holds `moe_lora_pairs` (below): decode rows' expert-LoRA deltas, float32.
 *
 * Compiled once per ISA level (kernels/native_build.py): generic, avx2 (AVX2 + FMA + F16C), avx512bf16
 * (AVX-512 F/BW/VL + BF16: bfloat16 products by vdpbf16ps, 32 per instruction);
 * `moe_gemm_isa_supported(level)` in the generic build says which the CPU runs.
 */
#include "cpu_isa.h"
#include "moe_gemm_block.h"
#include "moe_lora_rows.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef MOE_ISA
#define MOE_ISA generic
#define MOE_ISA_LEVEL 0
#endif
#define CAT3_(a, b, c) a##_##b##_##c
#define CAT3(a, b, c) CAT3_(a, b, c)
#define ENTRY(t) CAT3(moe_gemm, t, MOE_ISA)

/* DEFINE_GEMM(T): the grouped GEMM entry for element type T. */
#define DEFINE_GEMM(T)                                                                                       \
    int ENTRY(T)(const T *xs, int64_t ldx, const T *w, int64_t stride_e, int64_t O, int64_t K,              \
                 const int64_t *counts, int64_t E, T *ys, int64_t ldy, int64_t max_rows, int nthreads) {     \
        int64_t *start = malloc(sizeof(int64_t) * (size_t)(E + 1));                                          \
        if (!start) return -1;                                                                               \
        int64_t units_per = (O + COL_BLOCK - 1) / COL_BLOCK, active = 0;                                     \
        start[0] = 0;                                                                                        \
        for (int64_t e = 0; e < E; e++) {                                                                    \
            start[e + 1] = start[e] + counts[e];                                                             \
            active += counts[e] > 0 && counts[e] <= max_rows;                                                \
        }                                                                                                    \
        int64_t *unit_expert = malloc(sizeof(int64_t) * (size_t)(active ? active : 1));                      \
        if (!unit_expert) {                                                                                  \
            free(start);                                                                                     \
            return -1;                                                                                       \
        }                                                                                                    \
        int64_t m = 0;                                                                                       \
        for (int64_t e = 0; e < E; e++)                                                                      \
            if (counts[e] > 0 && counts[e] <= max_rows) unit_expert[m++] = e;                                \
        int64_t units = active * units_per;                                                                  \
        (void)nthreads;                                                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && units > 1)")     \
        for (int64_t u = 0; u < units; u++) {                                                                \
            int64_t e = unit_expert[u / units_per], c = u % units_per;                                       \
            int64_t o0 = c * COL_BLOCK, o1 = o0 + COL_BLOCK < O ? o0 + COL_BLOCK : O;                        \
            T##_unit(xs + start[e] * ldx, ldx, w + e * stride_e, K, o0, o1, ys + start[e] * ldy, ldy,       \
                     counts[e]);                                                                             \
        }                                                                                                    \
        free(unit_expert);                                                                                   \
        free(start);                                                                                         \
        return 0;                                                                                            \
    }

DEFINE_GEMM(float)
DEFINE_GEMM(bf16)

/* Expert-LoRA deltas of single rows (decode's short (expert, adapter) runs), float32: for pairs k < P
 *
 *     v_k = scale[k] * (A_k @ x[row[k]])        A_k = a + page[k] * pr * in: one page, [pr, in]
 *     out[row[k]] += B_k @ v_k                  B_k = b + page[k] * out_f * pr: [out_f, pr]
 *
 * reading each pair's pages where they lie (no gathered copy). Pairs on one row add in pair order.
 * Threads split the v's by pair, then the output columns in blocks (each output element one thread's,
 * so results do not depend on the thread count). Returns 0, or -1 when out of memory. */
int CAT3(moe_lora_pairs, float, MOE_ISA)(const float *x, int64_t ldx, const float *a, const float *b,
                                         int64_t pr, int64_t in, int64_t out_f, const int64_t *page,
                                         const int64_t *row, const float *scale, int64_t P, float *out,
                                         int64_t ldo, int nthreads) {
    float *v = malloc(sizeof(float) * (size_t)(P * pr > 0 ? P * pr : 1));
    if (!v) return -1;
    int64_t blocks = (out_f + COL_BLOCK - 1) / COL_BLOCK;
    (void)nthreads;
    _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1)") {
        _Pragma("omp for schedule(static)") for (int64_t k = 0; k < P; k++)
            lora_shrink(a + page[k] * pr * in, pr, in, x + row[k] * ldx, scale[k], v + k * pr);
        _Pragma("omp for schedule(static)") for (int64_t c = 0; c < blocks; c++) {
            int64_t c0 = c * COL_BLOCK, c1 = c0 + COL_BLOCK < out_f ? c0 + COL_BLOCK : out_f;
            for (int64_t k = 0; k < P; k++)
                lora_expand(b + page[k] * out_f * pr, pr, c0, c1, v + k * pr, out + row[k] * ldo);
        }
    }
    free(v);
    return 0;
}

#if MOE_ISA_LEVEL == 0
int moe_gemm_isa_supported(int level) { return loraplex_isa_supported(level, 1); }
#endif
