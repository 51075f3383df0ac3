/* The routed experts' small GEMMs on the CPU: for the step's (token, expert) rows sorted by expert,
 *
 *     ys[r, o] = sum_k xs[r, k] * w[e, o, k]        for the counts[e] rows r of expert e (in expert order)
 *
 * for every expert with 1..max_rows rows (others are skipped: the caller multiplies them). Decode gives
 * each active expert a few rows, and a GEMM library then re-blocks the expert's weight inside each call
 * (or, MKL on AMD CPUs, runs an SSE path) at a fraction of the memory bandwidth; here each weight row is
 * streamed once for all of its expert's rows: 8 / n weight rows at a time against n <= 4 activation rows
 * (eight float32 accumulators of eight lanes), the sum of each accumulator's lanes once at the end.
 * Float32 accumulation; bfloat16 values are widened in registers and each output rounded once (to nearest
 * even), as a bfloat16 GEMM rounds. Threads split the (expert, block of output columns) units; each output
 * is one thread's single dot product, so results do not depend on the thread count.
 *
 * Compiled once per ISA level (kernels/native_build.py): generic, avx2 (AVX2 + FMA + F16C), avx512bf16
 * (AVX-512 F/BW/VL + BF16: bfloat16 products by vdpbf16ps, 32 per instruction);
 * `moe_gemm_isa_supported(level)` in the generic build says which the CPU runs.
 */
#include "cpu_isa.h"
#include "vec8.h"
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

#define COL_BLOCK 32 /* output columns of one work unit */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline float s_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float f) { *p = f; }

/* DEFINE_GEMM(T, LOAD, SCALAR, PUT): the kernels for element type T (activations and weights alike). */
#define DEFINE_GEMM(T, LOAD, SCALAR, PUT)                                                                    \
    /* ys[0:NR, o0:o1] for NR (1..4) rows x (row stride ldx) against weight rows w[o] (K elements each):  \
     * OB = 8 / NR weight rows at a time (OB x NR <= 8 independent accumulators, lane j = i * NR + r). */    \
    ALWAYS_INLINE void T##_block(const T *x, int64_t ldx, const T *w, int64_t K, int64_t o0, int64_t o1,     \
                                 T *y, int64_t ldy, const int NR) {                                          \
        const int OB = NR == 1 ? 8 : NR == 2 ? 4 : 2;                                                        \
        int64_t k8 = K & ~(int64_t)7;                                                                        \
        for (int64_t o = o0; o < o1; o += OB) {                                                              \
            const T *wr[8];                                                                                  \
            for (int i = 0; i < OB; i++) wr[i] = w + (o + i < o1 ? o + i : o1 - 1) * K;                      \
            v8f s[8] = {{0}};                                                                                \
            for (int64_t k = 0; k < k8; k += 8) {                                                            \
                v8f xv[4];                                                                                   \
                for (int r = 0; r < NR; r++) xv[r] = LOAD(x + r * ldx + k);                                  \
                for (int i = 0; i < OB; i++) {                                                               \
                    v8f a = LOAD(wr[i] + k);                                                                 \
                    for (int r = 0; r < NR; r++) s[i * NR + r] += a * xv[r];                                 \
                }                                                                                            \
            }                                                                                                \
            v8f h = v8_hsum8x8(s);                                                                           \
            for (int i = 0; i < OB && o + i < o1; i++) {                                                     \
                for (int r = 0; r < NR; r++) {                                                               \
                    float acc = h[i * NR + r];                                                               \
                    for (int64_t k = k8; k < K; k++) acc += SCALAR(wr[i] + k) * SCALAR(x + r * ldx + k);     \
                    PUT(y + r * ldy + o + i, acc);                                                           \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    /* One work unit: all n rows of one expert, output columns [o0, o1), four rows at a time (the weight   \
     * block stays in L1 across the row groups). */                                                          \
    static void T##_unit(const T *x, int64_t ldx, const T *w, int64_t K, int64_t o0, int64_t o1, T *y,     \
                         int64_t ldy, int64_t n) {                                                           \
        for (int64_t r = 0; r < n; r += 4) {                                                                 \
            const T *xr = x + r * ldx;                                                                       \
            T *yr = y + r * ldy;                                                                             \
            switch (n - r >= 4 ? 4 : (int)(n - r)) {                                                         \
            case 4: T##_BLOCK(xr, ldx, w, K, o0, o1, yr, ldy, 4); break;                                     \
            case 3: T##_BLOCK(xr, ldx, w, K, o0, o1, yr, ldy, 3); break;                                     \
            case 2: T##_BLOCK(xr, ldx, w, K, o0, o1, yr, ldy, 2); break;                                     \
            default: T##_BLOCK(xr, ldx, w, K, o0, o1, yr, ldy, 1); break;                                    \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
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

typedef uint16_t bf16;
#define float_BLOCK float_block
#ifdef __AVX512BF16__
#include <immintrin.h>
/* The bfloat16 block with AVX-512 BF16: vdpbf16ps multiplies 32 bfloat16 pairs exactly and adds them, two
 * at a time, into 16 float32 lanes; the tail (K not a multiple of 32) is a masked load of zeros. */
static inline __m512bh dp_load(const uint16_t *p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
ALWAYS_INLINE void bf16_dp_block(const bf16 *x, int64_t ldx, const bf16 *w, int64_t K, int64_t o0, int64_t o1,
                                 bf16 *y, int64_t ldy, const int NR) {
    const int OB = NR == 1 ? 8 : NR == 2 ? 4 : 2;
    const __mmask32 all = ~(__mmask32)0, tail = (__mmask32)((1ull << (K & 31)) - 1);
    int64_t k32 = K & ~(int64_t)31;
    for (int64_t o = o0; o < o1; o += OB) {
        const bf16 *wr[8];
        for (int i = 0; i < OB; i++) wr[i] = w + (o + i < o1 ? o + i : o1 - 1) * K;
        __m512 s[8];
        for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k <= K; k += 32) {
            __mmask32 m = k < k32 ? all : tail;
            if (!m) break;
            __m512bh xv[4];
            for (int r = 0; r < NR; r++) xv[r] = dp_load(x + r * ldx + k, m);
            for (int i = 0; i < OB; i++) {
                __m512bh a = dp_load(wr[i] + k, m);
                for (int r = 0; r < NR; r++) s[i * NR + r] = _mm512_dpbf16_ps(s[i * NR + r], a, xv[r]);
            }
        }
        for (int i = 0; i < OB && o + i < o1; i++)
            for (int r = 0; r < NR; r++) v1_store_bf16(y + r * ldy + o + i, _mm512_reduce_add_ps(s[i * NR + r]));
    }
}
#define bf16_BLOCK bf16_dp_block
#else
#define bf16_BLOCK bf16_block
#endif
DEFINE_GEMM(float, v8_load_f32, s_f32, put_f32)
DEFINE_GEMM(bf16, v8_load_bf16, v1_load_bf16, v1_store_bf16)

#if MOE_ISA_LEVEL == 0
int moe_gemm_isa_supported(int level) { return loraplex_isa_supported(level, 1); }
#endif
