/* The shrink for bfloat16 activations and bfloat16 pages with AVX-512 BF16 (included by lora_bgmv.c in
 * its avx512bf16 build): vdpbf16ps multiplies 32 bfloat16 pairs exactly and adds them, two at a time,
 * into 16 float32 lanes. The feature tail (n not a multiple of 32) is a masked load of zeros beyond n.
 * Same signatures and results (up to float32 summation order) as the generic bf16 x bf16 shrinks.
 */

static inline __m512bh dp_load(const uint16_t *p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

/* out[j] = dot(a[j, 0:n], x[0:n]) for j in [0, rows); rows of a are n elements apart; pa is prefetched. */
static void dp_shrink_bf16(const uint16_t *a, const uint16_t *pa, const uint16_t *x, int64_t rows, int64_t n,
                           float *out) {
    const __mmask32 all = ~(__mmask32)0, tail = (__mmask32)((1ull << (n & 31)) - 1);
    int64_t n32 = n & ~(int64_t)31, j = 0;
    for (; j + 4 <= rows; j += 4) {
        const uint16_t *a0 = a + j * n, *a1 = a0 + n, *a2 = a1 + n, *a3 = a2 + n;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < n32; i += 32) { /* 32 elements: one cache line of each row */
            __builtin_prefetch(pa + j * n + i);
            __builtin_prefetch(pa + (j + 1) * n + i);
            __builtin_prefetch(pa + (j + 2) * n + i);
            __builtin_prefetch(pa + (j + 3) * n + i);
            __m512bh xv = dp_load(x + i, all);
            s0 = _mm512_dpbf16_ps(s0, dp_load(a0 + i, all), xv);
            s1 = _mm512_dpbf16_ps(s1, dp_load(a1 + i, all), xv);
            s2 = _mm512_dpbf16_ps(s2, dp_load(a2 + i, all), xv);
            s3 = _mm512_dpbf16_ps(s3, dp_load(a3 + i, all), xv);
        }
        if (tail) {
            __m512bh xv = dp_load(x + n32, tail);
            s0 = _mm512_dpbf16_ps(s0, dp_load(a0 + n32, tail), xv);
            s1 = _mm512_dpbf16_ps(s1, dp_load(a1 + n32, tail), xv);
            s2 = _mm512_dpbf16_ps(s2, dp_load(a2 + n32, tail), xv);
            s3 = _mm512_dpbf16_ps(s3, dp_load(a3 + n32, tail), xv);
        }
        out[j] = _mm512_reduce_add_ps(s0), out[j + 1] = _mm512_reduce_add_ps(s1);
        out[j + 2] = _mm512_reduce_add_ps(s2), out[j + 3] = _mm512_reduce_add_ps(s3);
    }
    for (; j < rows; j++) {
        const uint16_t *aj = a + j * n;
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < n32; i += 32) s = _mm512_dpbf16_ps(s, dp_load(aj + i, all), dp_load(x + i, all));
        if (tail) s = _mm512_dpbf16_ps(s, dp_load(aj + n32, tail), dp_load(x + n32, tail));
        out[j] = _mm512_reduce_add_ps(s);
    }
}

/* Two rows at once (x0, x1 -> out0, out1): each page element loaded once for both. */
static void dp_shrink2_bf16(const uint16_t *a, const uint16_t *x0, const uint16_t *x1, int64_t rows, int64_t n,
                            float *out0, float *out1) {
    const __mmask32 all = ~(__mmask32)0, tail = (__mmask32)((1ull << (n & 31)) - 1);
    int64_t n32 = n & ~(int64_t)31, j = 0;
    for (; j + 2 <= rows; j += 2) {
        const uint16_t *a0 = a + j * n, *a1 = a0 + n;
        __m512 s00 = _mm512_setzero_ps(), s01 = s00, s10 = s00, s11 = s00;
        for (int64_t i = 0; i <= n; i += 32) {
            __mmask32 m = i < n32 ? all : tail;
            if (!m) break;
            __m512bh w0 = dp_load(a0 + i, m), w1 = dp_load(a1 + i, m);
            __m512bh u0 = dp_load(x0 + i, m), u1 = dp_load(x1 + i, m);
            s00 = _mm512_dpbf16_ps(s00, w0, u0), s01 = _mm512_dpbf16_ps(s01, w1, u0);
            s10 = _mm512_dpbf16_ps(s10, w0, u1), s11 = _mm512_dpbf16_ps(s11, w1, u1);
        }
        out0[j] = _mm512_reduce_add_ps(s00), out0[j + 1] = _mm512_reduce_add_ps(s01);
        out1[j] = _mm512_reduce_add_ps(s10), out1[j + 1] = _mm512_reduce_add_ps(s11);
    }
    if (j < rows) {
        dp_shrink_bf16(a + j * n, a + j * n, x0, rows - j, n, out0 + j);
        dp_shrink_bf16(a + j * n, a + j * n, x1, rows - j, n, out1 + j);
    }
}
