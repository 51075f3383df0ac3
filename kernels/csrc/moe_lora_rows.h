/* One row's expert-LoRA delta on the CPU, in two halves, shared by moe_gemm_cpu.c (the decode rows'
 * pairs, `moe_lora_pairs`) and moe_fused_cpu.c (the whole decode MoE block with its LoRA). Float32:
 *
 *     lora_shrink:  v[0:pr]     = scale * (A @ x)      A: one page [pr, in], x: the row [in]
 *     lora_expand:  o[c0:c1]   += B[c0:c1] @ v         B: the page's [out, pr]
 *
 * and bfloat16 pages and rows, rounded where `ExpertLoRAStep.add` (engine/lora/expert_step.py) rounds
 * (`v = x @ A.T` to bfloat16, then `o.addmm_(v, B.T, alpha=scale)`: one rounding of o per page; its
 * `add_pairs` for short runs rounds a little differently, each page's delta before the sum):
 *
 *     lora_shrink_bf16:  v[0:pr]    = bf16(A @ x)                       (float32 products and sums)
 *     lora_expand_bf16:  o[c0:c1]   = bf16(o + scale * (B[c0:c1] @ v))
 *
 * With AVX-512 BF16 the bfloat16 shrink and the expand of rank-16 pages use vdpbf16ps (exact products,
 * summed pairwise in float32), so their sums round in another order than the other builds'.
 * Each output element is one thread's in every caller, so results do not depend on the thread count.
 */
#ifndef LORAPLEX_MOE_LORA_ROWS_H
#define LORAPLEX_MOE_LORA_ROWS_H
#include "vec8.h"
#include <stdint.h>

static inline float lr_f32(const float *p) { return *p; }

/* NAME(rows, ld, n, vec, len, res): res[j] = dot(rows + j * ld, vec) over `len` elements for j < n (n <= 8),
 * rows of type TR and vec of type TV (float32 or bfloat16, widened as loaded): eight accumulators side by
 * side (independent chains), their lane sums at once (v8_hsum8x8), the tail past a multiple of 8 scalar. */
#define DEFINE_DOTS8(NAME, TR, LOADR, SCALARR, TV, LOADV, SCALARV)                                          \
    static void NAME(const TR *rows, int64_t ld, int n, const TV *vec, int64_t len, float *res) {            \
        const TR *r[8];                                                                                      \
        for (int j = 0; j < 8; j++) r[j] = rows + (j < n ? j : n - 1) * ld;                                  \
        v8f s[8] = {{0}};                                                                                    \
        int64_t len8 = len & ~(int64_t)7;                                                                    \
        for (int64_t i = 0; i < len8; i += 8) {                                                              \
            v8f v = LOADV(vec + i);                                                                          \
            for (int j = 0; j < 8; j++) s[j] += LOADR(r[j] + i) * v;                                         \
        }                                                                                                    \
        v8f h = v8_hsum8x8(s);                                                                               \
        for (int j = 0; j < n; j++) {                                                                        \
            float d = h[j];                                                                                  \
            for (int64_t i = len8; i < len; i++) d += SCALARR(r[j] + i) * SCALARV(vec + i);                  \
            res[j] = d;                                                                                      \
        }                                                                                                    \
    }

DEFINE_DOTS8(dots8, float, v8_load_f32, lr_f32, float, v8_load_f32, lr_f32)
DEFINE_DOTS8(dots8_bf16, uint16_t, v8_load_bf16, v1_load_bf16, uint16_t, v8_load_bf16, v1_load_bf16)
DEFINE_DOTS8(dots8_bf16_f32, uint16_t, v8_load_bf16, v1_load_bf16, float, v8_load_f32, lr_f32)

/* v[0:pr] = scale * (a @ x): a is one A page, pr rows of `in` floats. */
static inline void lora_shrink(const float *a, int64_t pr, int64_t in, const float *x, float scale, float *v) {
    for (int64_t p = 0; p < pr; p += 8) {
        int n = pr - p < 8 ? (int)(pr - p) : 8;
        dots8(a + p * in, in, n, x, in, v + p);
    }
    for (int64_t p = 0; p < pr; p++) v[p] *= scale;
}

/* o[c0:c1] += b[c0:c1] @ v: b is one B page, `out` rows of pr floats (row c at b + c * pr). */
static inline void lora_expand(const float *b, int64_t pr, int64_t c0, int64_t c1, const float *v, float *o) {
    float d[8];
    for (int64_t c = c0; c < c1; c += 8) {
        int n = c1 - c < 8 ? (int)(c1 - c) : 8;
        dots8(b + c * pr, pr, n, v, pr, d);
        for (int j = 0; j < n; j++) o[c + j] += d[j];
    }
}

#ifdef __AVX512BF16__
#include <immintrin.h>
/* dots8_bf16 with vdpbf16ps: res[j] = dot(rows + j * ld, vec) over `len` bfloat16 elements for j < n
 * (n <= 8; rows past n repeat the last), 32 products a step summed pairwise in float32, a masked tail. */
static inline void dots8_dp_bf16(const uint16_t *rows, int64_t ld, int n, const uint16_t *vec, int64_t len,
                                 float *res) {
    const uint16_t *r[8];
    for (int j = 0; j < 8; j++) r[j] = rows + (j < n ? j : n - 1) * ld;
    __m512 s[8];
    for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 32) {
        __mmask32 m = len - i >= 32 ? ~(__mmask32)0 : (__mmask32)((1ull << (len - i)) - 1);
        __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(m, vec + i);
        for (int j = 0; j < 8; j++)
            s[j] = _mm512_dpbf16_ps(s[j], (__m512bh)_mm512_maskz_loadu_epi16(m, r[j] + i), v);
    }
    for (int j = 0; j < n; j++) res[j] = _mm512_reduce_add_ps(s[j]);
}
#define SHRINK_DOTS8_BF16 dots8_dp_bf16

/* o[c0:c1] = bfloat16(o + scale * (b[c0:c1] @ v)) for page rank 16 with vdpbf16ps: one step holds two B
 * rows (32 elements) against v twice, in bfloat16 (v's values are bfloat16 already: the shrink rounded
 * them), and eight rows' lane sums finish at once (v8_hsum8x8). Returns the first row not done (a tail of
 * fewer than eight rows, for the caller). */
static inline int64_t lora_expand_bf16_r16(const uint16_t *b, int64_t c0, int64_t c1, const float *v, float scale,
                                           uint16_t *o) {
    uint16_t vb[32];
    for (int i = 0; i < 16; i++) v1_store_bf16(vb + i, v[i]), vb[16 + i] = vb[i];
    const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb);
    const v8f sc = {scale, scale, scale, scale, scale, scale, scale, scale};
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
        v8f h[8];
        for (int j = 0; j < 4; j++) {
            __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(b + (c + 2 * j) * 16), vv);
            __m256 lo = _mm512_castps512_ps256(p), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
            memcpy(&h[2 * j], &lo, sizeof lo);
            memcpy(&h[2 * j + 1], &hi, sizeof hi);
        }
        v8_store_bf16(o + c, v8_load_bf16(o + c) + sc * v8_hsum8x8(h));
    }
    return c;
}
#else
#define SHRINK_DOTS8_BF16 dots8_bf16
#endif

/* v[0:pr] = bfloat16-rounded a @ x (a: one bfloat16 A page, pr rows of `in`; x: a bfloat16 row). */
static inline void lora_shrink_bf16(const uint16_t *a, int64_t pr, int64_t in, const uint16_t *x, float *v) {
    for (int64_t p = 0; p < pr; p += 8) {
        int n = pr - p < 8 ? (int)(pr - p) : 8;
        SHRINK_DOTS8_BF16(a + p * in, in, n, x, in, v + p);
    }
    for (int64_t p = 0; p < pr; p++) {
        uint16_t h;
        v1_store_bf16(&h, v[p]);
        v[p] = v1_load_bf16(&h);
    }
}

/* o[c0:c1] = bfloat16(o + scale * (b[c0:c1] @ v)) (b: one bfloat16 B page, `out` rows of pr). */
static inline void lora_expand_bf16(const uint16_t *b, int64_t pr, int64_t c0, int64_t c1, const float *v, float scale,
                                    uint16_t *o) {
    float d[8];
#ifdef __AVX512BF16__
    if (pr == 16) c0 = lora_expand_bf16_r16(b, c0, c1, v, scale, o);
#endif
    for (int64_t c = c0; c < c1; c += 8) {
        int n = c1 - c < 8 ? (int)(c1 - c) : 8;
        dots8_bf16_f32(b + c * pr, pr, n, v, pr, d);
        for (int j = 0; j < n; j++) v1_store_bf16(o + c + j, v1_load_bf16(o + c + j) + scale * d[j]);
    }
}

#endif
