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

/* Interleaved accumulator chains per activation row for NR rows (NR x chains <= 8). With AVX2 or AVX-512
 * the memory bounds the blocks and four accumulators are enough; on plain SSE2 (generic) the chains'
 * latency bounds them and more rows need two each. */
#ifdef __AVX2__
#define MOE_CHAINS(NR) ((NR) == 1 ? 4 : (NR) == 2 ? 2 : 1)
#else
#define MOE_CHAINS(NR) ((NR) == 1 ? 4 : 2)
#endif

/* DEFINE_MOE_BLOCK(T, LOAD, SCALAR, PUT): the blocks for element type T (activations and weights alike). */
#define DEFINE_MOE_BLOCK(T, LOAD, SCALAR, PUT)                                                                    \
    /* ys[0:NR, o0:o1] for NR (1..4) rows x (row stride ldx) against weight rows w[o] (K elements each):  \
     * one weight row at a time, in address order, its K split over U = MOE_CHAINS(NR) interleaved chains  \
     * per activation row, summed once per output. Streaming several weight rows side by side (2 KB apart, \
     * the earlier blocking) ran at about half the memory bandwidth on a Zen 4. */                          \
    ALWAYS_INLINE void T##_block(const T *x, int64_t ldx, const T *w, int64_t K, int64_t o0, int64_t o1,     \
                                 T *y, int64_t ldy, const int NR) {                                          \
        const int U = MOE_CHAINS(NR);                                                                        \
        int64_t k8 = K & ~(int64_t)7, step = 8 * U, kU = k8 - k8 % step;                                     \
        for (int64_t o = o0; o < o1; o++) {                                                                  \
            const T *wr = w + o * K;                                                                         \
            v8f s[8] = {{0}};                                                                                \
            for (int64_t k = 0; k < kU; k += step)                                                           \
                for (int u = 0; u < U; u++) {                                                                \
                    v8f a = LOAD(wr + k + 8 * u);                                                            \
                    for (int r = 0; r < NR; r++) s[r * U + u] += a * LOAD(x + r * ldx + k + 8 * u);          \
                }                                                                                            \
            for (int64_t k = kU; k < k8; k += 8) {                                                           \
                v8f a = LOAD(wr + k);                                                                        \
                for (int r = 0; r < NR; r++) s[r * U] += a * LOAD(x + r * ldx + k);                          \
            }                                                                                                \
            for (int r = 0; r < NR; r++) {                                                                   \
                v8f t = s[r * U];                                                                            \
                for (int u = 1; u < U; u++) t += s[r * U + u];                                               \
                float acc = v8_hsum(t);                                                                      \
                for (int64_t k = k8; k < K; k++) acc += SCALAR(wr + k) * SCALAR(x + r * ldx + k);            \
                PUT(y + r * ldy + o, acc);                                                                   \
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
/* The float32 block with AVX-512: T##_block's order (one weight row at a time, in address order,
 * MOE_CHAINS(NR) interleaved chains per activation row) with 16-lane accumulators. */
ALWAYS_INLINE void float_z_block(const float *x, int64_t ldx, const float *w, int64_t K, int64_t o0, int64_t o1,
                                 float *y, int64_t ldy, const int NR) {
    const int U = MOE_CHAINS(NR);
    const __mmask16 tail = (__mmask16)((1u << (K & 15)) - 1);
    int64_t k16 = K & ~(int64_t)15, step = 16 * U, kU = k16 - k16 % step;
    for (int64_t o = o0; o < o1; o++) {
        const float *wr = w + o * K;
        __m512 s[8]; /* NR x MOE_CHAINS(NR) <= 8 */
        for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < kU; k += step) {
            for (int u = 0; u < U; u++) {
                __m512 a = _mm512_loadu_ps(wr + k + 16 * u);
                for (int r = 0; r < NR; r++)
                    s[r * U + u] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + r * ldx + k + 16 * u), s[r * U + u]);
            }
        }
        for (int64_t k = kU; k < k16; k += 16) {
            __m512 a = _mm512_loadu_ps(wr + k);
            for (int r = 0; r < NR; r++) s[r * U] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x + r * ldx + k), s[r * U]);
        }
        if (tail) {
            __m512 a = _mm512_maskz_loadu_ps(tail, wr + k16);
            for (int r = 0; r < NR; r++)
                s[r * U] = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(tail, x + r * ldx + k16), s[r * U]);
        }
        for (int r = 0; r < NR; r++) {
            __m512 t = s[r * U];
            for (int u = 1; u < U; u++) t = _mm512_add_ps(t, s[r * U + u]);
            y[r * ldy + o] = _mm512_reduce_add_ps(t);
        }
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
    const int U = MOE_CHAINS(NR); /* as float_z_block: one weight row at a time */
    const __mmask32 all = ~(__mmask32)0, tail = (__mmask32)((1ull << (K & 31)) - 1);
    int64_t k32 = K & ~(int64_t)31, step = 32 * U, kU = k32 - k32 % step;
    for (int64_t o = o0; o < o1; o++) {
        const bf16 *wr = w + o * K;
        __m512 s[8]; /* NR x MOE_CHAINS(NR) <= 8 */
        for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < kU; k += step)
            for (int u = 0; u < U; u++) {
                __m512bh a = dp_load(wr + k + 32 * u, all);
                for (int r = 0; r < NR; r++)
                    s[r * U + u] = _mm512_dpbf16_ps(s[r * U + u], a, dp_load(x + r * ldx + k + 32 * u, all));
            }
        for (int64_t k = kU; k <= K; k += 32) {
            __mmask32 m = k < k32 ? all : tail;
            if (!m) break;
            __m512bh a = dp_load(wr + k, m);
            for (int r = 0; r < NR; r++) s[r * U] = _mm512_dpbf16_ps(s[r * U], a, dp_load(x + r * ldx + k, m));
        }
        for (int r = 0; r < NR; r++) {
            __m512 t = s[r * U];
            for (int u = 1; u < U; u++) t = _mm512_add_ps(t, s[r * U + u]);
            v1_store_bf16(y + r * ldy + o, _mm512_reduce_add_ps(t));
        }
    }
}
#define bf16_BLOCK bf16_dp_block
#else
#define bf16_BLOCK bf16_block
#endif
DEFINE_MOE_BLOCK(float, v8_load_f32, s_f32, put_f32)
DEFINE_MOE_BLOCK(bf16, v8_load_bf16, v1_load_bf16, v1_store_bf16)

#endif
