/* The small-GEMM blocks of the routed experts on the CPU, shared by moe_gemm_cpu.c (the grouped GEMM) and
 * moe_fused_cpu.c (the whole decode MoE block): for n rows of activations (row stride ldx) and an expert's
 * weight rows w[o] (K elements each), `T##_unit` computes y[r, o] = sum_k x[r, k] * w[o, k] for the
 * output columns [o0, o1), streaming each weight row once for up to four rows (moe_gemm_cpu.c's comment
 * says how). Float32 accumulation, each bfloat16 output rounded once. Types: float and bf16 (uint16_t).
 * With AVX-512 (the avx512bf16 build) float32 takes 16-lane accumulators and bfloat16 vdpbf16ps.
 */
#ifndef LORAPLEX_MOE_GEMM_BLOCK_H
#define LORAPLEX_MOE_GEMM_BLOCK_H
#include "vec8.h"
#include <stdint.h>

#define COL_BLOCK 32 /* output columns of one work unit */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline float s_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float f) { *p = f; }

/* DEFINE_MOE_BLOCK(T, LOAD, SCALAR, PUT): the blocks for element type T (activations and weights alike). */
#define DEFINE_MOE_BLOCK(T, LOAD, SCALAR, PUT)                                                                    \
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
    }

typedef uint16_t bf16;
#ifdef __AVX512F__
#include <immintrin.h>
/* The float32 block with AVX-512: the same blocking as T##_block with 16-lane accumulators (half the
 * instructions a weight row costs; at 4 rows an expert the 8-lane block issues more than it streams). */
ALWAYS_INLINE void float_z_block(const float *x, int64_t ldx, const float *w, int64_t K, int64_t o0, int64_t o1,
                                 float *y, int64_t ldy, const int NR) {
    const int OB = NR == 1 ? 8 : NR == 2 ? 4 : 2;
    const __mmask16 tail = (__mmask16)((1u << (K & 15)) - 1);
    int64_t k16 = K & ~(int64_t)15;
    for (int64_t o = o0; o < o1; o += OB) {
        const float *wr[8];
        for (int i = 0; i < OB; i++) wr[i] = w + (o + i < o1 ? o + i : o1 - 1) * K;
        __m512 s[8];
        for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < k16; k += 16) {
            __m512 xv[4];
            for (int r = 0; r < NR; r++) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
            for (int i = 0; i < OB; i++) {
                __m512 a = _mm512_loadu_ps(wr[i] + k);
                for (int r = 0; r < NR; r++) s[i * NR + r] = _mm512_fmadd_ps(a, xv[r], s[i * NR + r]);
            }
        }
        if (tail) {
            __m512 xv[4];
            for (int r = 0; r < NR; r++) xv[r] = _mm512_maskz_loadu_ps(tail, x + r * ldx + k16);
            for (int i = 0; i < OB; i++) {
                __m512 a = _mm512_maskz_loadu_ps(tail, wr[i] + k16);
                for (int r = 0; r < NR; r++) s[i * NR + r] = _mm512_fmadd_ps(a, xv[r], s[i * NR + r]);
            }
        }
        for (int i = 0; i < OB && o + i < o1; i++)
            for (int r = 0; r < NR; r++) y[r * ldy + o + i] = _mm512_reduce_add_ps(s[i * NR + r]);
    }
}
#define float_BLOCK float_z_block
#else
#define float_BLOCK float_block
#endif
#ifdef __AVX512BF16__
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
DEFINE_MOE_BLOCK(float, v8_load_f32, s_f32, put_f32)
DEFINE_MOE_BLOCK(bf16, v8_load_bf16, v1_load_bf16, v1_store_bf16)

#endif
