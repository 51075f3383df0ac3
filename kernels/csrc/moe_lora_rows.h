/* One row's expert-LoRA delta on the CPU, float32, in two halves, shared by moe_gemm_cpu.c (the decode
 * rows' pairs, `moe_lora_pairs`) and moe_fused_cpu.c (the whole decode MoE block with its LoRA):
 *
 *     lora_shrink:  v[0:pr]     = scale * (A @ x)      A: one page [pr, in], x: the row [in]
 *     lora_expand:  o[c0:c1]   += B[c0:c1] @ v         B: the page's [out, pr]
 *
 * A caller runs every row's shrink first, then splits the output columns among its threads for the
 * expand, so each output element is one thread's and results do not depend on the thread count.
 */
#ifndef LORAPLEX_MOE_LORA_ROWS_H
#define LORAPLEX_MOE_LORA_ROWS_H
#include "vec8.h"
#include <stdint.h>

/* res[j] = dot(rows + j * ld, vec) over `len` floats for j < n (n <= 8): eight accumulators side by side
 * (independent chains), their lane sums at once (v8_hsum8x8), the tail past a multiple of 8 scalar. */
static void dots8(const float *rows, int64_t ld, int n, const float *vec, int64_t len, float *res) {
    const float *r[8];
    for (int j = 0; j < 8; j++) r[j] = rows + (j < n ? j : n - 1) * ld;
    v8f s[8] = {{0}};
    int64_t len8 = len & ~(int64_t)7;
    for (int64_t i = 0; i < len8; i += 8) {
        v8f v = v8_load_f32(vec + i);
        for (int j = 0; j < 8; j++) s[j] += v8_load_f32(r[j] + i) * v;
    }
    v8f h = v8_hsum8x8(s);
    for (int j = 0; j < n; j++) {
        float d = h[j];
        for (int64_t i = len8; i < len; i++) d += r[j][i] * vec[i];
        res[j] = d;
    }
}

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

#endif
