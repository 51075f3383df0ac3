/* Fused elementwise ops of a Llama-family decoder step on the CPU: each replaces several torch ops (and
 * their dispatch and temporaries) by one pass over the rows.
 *
 *   add_rms_norm:  if delta: res[t] = round(res[t] + delta[t])            (the residual add, in place)
 *                  out[t]   = round(w * round(res[t] * inv))   inv = 1 / sqrt(mean(res[t]^2) + eps)
 *   rope:          for each head h < heads of row t (x[t, h*D : (h+1)*D], updated in place):
 *                    if qk_norm: x = round(w_h * round(x * inv))  (RMSNorm over the head; w_h: q or k)
 *                    c, s = cos[pos[t]], sin[pos[t]]   (float32 tables [P, R/2]; R = rotary_dim <= D)
 *                    x[:R/2], x[R/2:R] = round(x1*c - x2*s), round(x2*c + x1*s); x[R:] as is
 *   silu_mul:      out[t, i] = round(round(silu(g)) * u),  g = gu[t, i], u = gu[t, I + i],
 *                  silu(g) = g / (1 + exp(-g))
 *
 * Everything is computed in float32; `round` is the rounding to the element type (float32, bfloat16
 * or float16; to nearest even), done where the unfused torch formula rounds (engine/model/decoder.py,
 * engine/model/rope.py; HF's RMSNorm: float32 norm, cast, then the weight multiply in the element type).
 * Products and sums are separate operations (built with -ffp-contract=off, no FMA), so RoPE and the
 * residual add are bit-identical to torch; RMSNorm differs only in the order of the sum of squares, and
 * SiLU in the exp (a few float32 ulp).
 *
 * Vectors are the ISA's native width (GCC vector extensions: 4, 8 or 16 float32 lanes); every op is
 * lane-wise except the sum of squares, which keeps 16 partial sums at every width, so the generic, AVX2
 * and AVX-512 builds give bit-identical results; the row loops are split between OpenMP threads (torch's
 * runtime and count, passed in) when a call has more than GRAIN elements. GRAIN is a quarter of torch's
 * own elementwise grain: at a decode step's shapes (32 rows x 384..1024) two threads already win, e.g.
 * bfloat16 SiLU x up over 32 x 1024 took 25.6 us on one thread and 14.7 us on two (Zen 4, 2 cores).
 * Results do not depend on the thread count (rows are independent).
 */
#include "cpu_isa.h"
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef FUSED_ISA
#define FUSED_ISA generic
#define FUSED_ISA_LEVEL 0
#endif
#define CAT3_(a, b, c) a##_##b##_##c
#define CAT3(a, b, c) CAT3_(a, b, c)
#define ENTRY(op, t) CAT3(op, t, FUSED_ISA)

#define INLINE inline __attribute__((always_inline))
#define GRAIN 8192
#if defined(__AVX512F__)
#define L 16
#elif defined(__AVX2__)
#define L 8
#else
#define L 4
#endif
#define SUMS 16 /* partial sums of a row's squares, at every L */

typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef uint16_t vu16 __attribute__((vector_size(2 * L)));

static INLINE vf splat(float f) { return (vf){} + f; }

/* ---- loads (L lanes widened to float32) and stores (rounded to the element type), vector and scalar ---- */
static INLINE vf ld_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static INLINE void st_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }
static INLINE float lds_f32(const float *p) { return *p; }
static INLINE vf rnd_f32(vf v) { return v; }
static INLINE void sts_f32(float *p, float f) { *p = f; }

#if L == 8 /* AVX2: one widening load, a blend for NaN and one pack + permute to narrow */
static INLINE vf ld_bf16(const uint16_t *p) {
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (vf)_mm256_castsi256_ps(w);
}
static INLINE void st_bf16(uint16_t *p, vf v) {
    __m256i w = _mm256_castps_si256((__m256)v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(w, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan); /* NaN stays a (quiet) NaN, as torch's */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#else
static INLINE vf ld_bf16(const uint16_t *p) {
    vu16 h;
    memcpy(&h, p, sizeof h);
    vu w = __builtin_convertvector(h, vu) << 16;
    vf v;
    memcpy(&v, &w, sizeof v);
    return v;
}
static INLINE void st_bf16(uint16_t *p, vf v) {
    vu w;
    memcpy(&w, &v, sizeof w);
    vu r = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    vu nan = (vu)(v != v); /* NaN stays a (quiet) NaN, as torch rounds it */
    r = (r & ~nan) | (0x7FC0u & nan);
    vu16 h = __builtin_convertvector(r, vu16);
    memcpy(p, &h, sizeof h);
}
#endif
/* v rounded to bfloat16 precision, kept as float32 lanes (the same value st_bf16 then ld_bf16 give). */
static INLINE vf rnd_bf16(vf v) {
    vu w;
    memcpy(&w, &v, sizeof w);
    vu r = (w + 0x7FFFu + ((w >> 16) & 1u)) & 0xFFFF0000u;
    vu nan = (vu)(v != v);
    r = (r & ~nan) | (0x7FC00000u & nan);
    vf f;
    memcpy(&f, &r, sizeof f);
    return f;
}
static INLINE float lds_bf16(const uint16_t *p) {
    uint32_t w = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}
static INLINE void sts_bf16(uint16_t *p, float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    *p = f != f ? 0x7FC0u : (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

#ifdef __FLT16_MAX__
typedef _Float16 vh __attribute__((vector_size(2 * L)));
#if defined(__AVX512F__)
static INLINE vf ld_f16(const _Float16 *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static INLINE void st_f16(_Float16 *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
}
#elif defined(__F16C__)
static INLINE vf ld_f16(const _Float16 *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static INLINE void st_f16(_Float16 *p, vf v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
}
#else
static INLINE vf ld_f16(const _Float16 *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vf);
}
static INLINE void st_f16(_Float16 *p, vf v) {
    vh h = __builtin_convertvector(v, vh);
    memcpy(p, &h, sizeof h);
}
#endif
static INLINE float lds_f16(const _Float16 *p) { return (float)*p; }
static INLINE vf rnd_f16(vf v) {
    _Float16 tmp[L];
    st_f16(tmp, v);
    return ld_f16(tmp);
}
static INLINE void sts_f16(_Float16 *p, float f) { *p = (_Float16)f; }
#endif

/* Lane-wise select: m ? a : b (m lanes all ones or all zeros, from a comparison). */
static INLINE vf vsel(vi m, vf a, vf b) {
    vi ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    vi r = (ia & m) | (ib & ~m);
    vf f;
    memcpy(&f, &r, sizeof f);
    return f;
}

/* p * 2^n for integral float lanes n in [-252, 254]: two multiplies by normal powers of two. */
static INLINE vf scale2(vf p, vf n) {
    vi k = __builtin_convertvector(n, vi), k1 = k >> 1, k2 = k - k1;
    vi b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
    vf f1, f2;
    memcpy(&f1, &b1, sizeof f1);
    memcpy(&f2, &b2, sizeof f2);
    return (p * f1) * f2;
}

/* exp(x) for float32 lanes: x = n ln2 + r, |r| <= ln2/2, a degree-7 polynomial for exp(r), times 2^n
 * (Cephes' expf); a few ulp; +inf above ln(FLT_MAX), 0 below ln(FLT_MIN) (no subnormal results). */
static INLINE vf vexp(vf x) {
    const vf hi = splat(88.72283905206835f), lo = splat(-87.33654475055310f);
    vi over = x > hi, under = x < lo;
    x = vsel(over, hi, vsel(under, lo, x));
    vf t = x * splat(1.44269504088896341f);
    vf n = (t + splat(12582912.0f)) - splat(12582912.0f); /* round to nearest (|t| < 2^22) */
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vf e = scale2(p, n);
    return vsel(over, splat(__builtin_inff()), vsel(under, splat(0.0f), e));
}

/* Sum of squares of n float32 values at p: SUMS partial sums (value i goes to sum i % SUMS, at every
 * vector width), added pairwise, then the values past the last multiple of SUMS in order. */
static INLINE float sumsq(const float *p, int64_t n) {
    vf acc[SUMS / L] = {};
    int64_t i = 0;
    for (; i + SUMS <= n; i += SUMS)
        for (int j = 0; j < SUMS / L; j++) {
            vf v = ld_f32(p + i + j * L);
            acc[j] += v * v;
        }
    float s[SUMS];
    memcpy(s, acc, sizeof s);
    for (int w = SUMS / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) s[k] += s[k + w];
    float total = s[0];
    for (; i < n; i++) total += p[i] * p[i];
    return total;
}

#define DEFINE_OPS(tn, T)                                                                                    \
    /* One row (or head) of n values, held in float32 in `buf`: rescale by inv, round, times w, round,  \
     * into dst (may alias the row buf was read from). */                                                \
    static void norm_row_##tn(const float *buf, T *dst, const T *w, int64_t n, float inv) {                  \
        int64_t i = 0;                                                                                       \
        for (; i + L <= n; i += L) {                                                                         \
            st_##tn(dst + i, rnd_##tn(ld_f32(buf + i) * splat(inv)) * ld_##tn(w + i));                       \
        }                                                                                                    \
        for (; i < n; i++) {                                                                                 \
            T tmp;                                                                                           \
            sts_##tn(&tmp, buf[i] * inv);                                                                    \
            sts_##tn(dst + i, lds_##tn(&tmp) * lds_##tn(w + i));                                             \
        }                                                                                                    \
    }                                                                                                        \
                                                                                                             \
    /* Widen n values of row p into buf (float32) after rounding them as the element type holds them. */    \
    static INLINE void widen_##tn(const T *p, float *buf, int64_t n) {                                       \
        int64_t i = 0;                                                                                       \
        for (; i + L <= n; i += L) st_f32(buf + i, ld_##tn(p + i));                                          \
        for (; i < n; i++) buf[i] = lds_##tn(p + i);                                                         \
    }                                                                                                        \
                                                                                                             \
    void ENTRY(fused_add_rms_norm, tn)(T *res, int64_t res_stride, const T *delta, int64_t delta_stride,     \
                                       T *out, int64_t out_stride, const T *w, int64_t rows, int64_t cols,   \
                                       float eps, int num_threads) {                                         \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * cols > GRAIN)")       \
        for (int64_t t = 0; t < rows; t++) {                                                                 \
            float buf[cols];                                                                                 \
            T *r = res + t * res_stride;                                                                     \
            if (delta) {                                                                                     \
                const T *d = delta + t * delta_stride;                                                       \
                int64_t i = 0;                                                                               \
                for (; i + L <= cols; i += L) {                                                              \
                    st_##tn(r + i, ld_##tn(r + i) + ld_##tn(d + i));                                         \
                }                                                                                            \
                for (; i < cols; i++) sts_##tn(r + i, lds_##tn(r + i) + lds_##tn(d + i));                    \
            }                                                                                                \
            widen_##tn(r, buf, cols);                                                                        \
            float inv = 1.0f / sqrtf(sumsq(buf, cols) / (float)cols + eps);                                  \
            norm_row_##tn(buf, out + t * out_stride, w, cols, inv);                                          \
        }                                                                                                    \
    }                                                                                                        \
                                                                                                             \
    int ENTRY(fused_rope, tn)(T *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,       \
                              int64_t rotary_dim, const int64_t *positions, int64_t num_positions,            \
                              const float *cos_t, const float *sin_t, int64_t q_heads, const T *q_w,          \
                              const T *k_w, float eps, int num_threads) {                                    \
        const int64_t half = rotary_dim / 2;                                                                 \
        for (int64_t t = 0; t < rows; t++)                                                                   \
            if (positions[t] < 0 || positions[t] >= num_positions) return -1;                                \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * heads * head_dim > GRAIN)") \
        for (int64_t t = 0; t < rows; t++) {                                                                 \
            float buf[head_dim];                                                                             \
            const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;                  \
            for (int64_t h = 0; h < heads; h++) {                                                            \
                T *p = x + t * row_stride + h * head_dim;                                                    \
                if (q_w) {                                                                                   \
                    widen_##tn(p, buf, head_dim);                                                            \
                    float inv = 1.0f / sqrtf(sumsq(buf, head_dim) / (float)head_dim + eps);                  \
                    norm_row_##tn(buf, p, h < q_heads ? q_w : k_w, head_dim, inv);                           \
                }                                                                                            \
                T *p2 = p + half;                                                                            \
                int64_t i = 0;                                                                               \
                for (; i + L <= half; i += L) {                                                              \
                    vf x1 = ld_##tn(p + i), x2 = ld_##tn(p2 + i), vc = ld_f32(c + i), vs = ld_f32(s + i);     \
                    vf a = x1 * vc, b = x2 * vs, e = x2 * vc, f = x1 * vs;                                   \
                    st_##tn(p + i, a - b);                                                                   \
                    st_##tn(p2 + i, e + f);                                                                  \
                }                                                                                            \
                for (; i < half; i++) {                                                                      \
                    float x1 = lds_##tn(p + i), x2 = lds_##tn(p2 + i);                                       \
                    float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];                        \
                    sts_##tn(p + i, a - b);                                                                  \
                    sts_##tn(p2 + i, e + f);                                                                 \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        return 0;                                                                                            \
    }                                                                                                        \
                                                                                                             \
    void ENTRY(fused_silu_mul, tn)(const T *gu, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows, \
                                   int64_t inter, int num_threads) {                                         \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(rows * inter > GRAIN)")      \
        for (int64_t t = 0; t < rows; t++) {                                                                 \
            const T *g = gu + t * gu_stride, *u = g + inter;                                                 \
            T *o = out + t * out_stride;                                                                     \
            int64_t i = 0;                                                                                   \
            for (; i + L <= inter; i += L) {                                                                 \
                vf vg = ld_##tn(g + i);                                                                      \
                st_##tn(o + i, rnd_##tn(vg / (splat(1.0f) + vexp(-vg))) * ld_##tn(u + i));                  \
            }                                                                                                \
            if (i < inter) { /* the tail through the vector code too (same exp): padded with zeros */     \
                T gt[L] = {0}, ut[L] = {0}, ot[L];                                                           \
                memcpy(gt, g + i, (inter - i) * sizeof(T));                                                  \
                memcpy(ut, u + i, (inter - i) * sizeof(T));                                                  \
                vf vg = ld_##tn(gt);                                                                         \
                st_##tn(ot, rnd_##tn(vg / (splat(1.0f) + vexp(-vg))) * ld_##tn(ut));                        \
                memcpy(o + i, ot, (inter - i) * sizeof(T));                                                  \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_OPS(f32, float)
DEFINE_OPS(bf16, uint16_t)
#ifdef __FLT16_MAX__
DEFINE_OPS(f16, _Float16)
#endif

/* The generic build answers for all: 1 when float16 types exist, and which ISA levels the CPU runs. */
#if FUSED_ISA_LEVEL == 0
#ifdef __FLT16_MAX__
int fused_has_f16(void) { return 1; }
#else
int fused_has_f16(void) { return 0; }
#endif

int fused_isa_supported(int level) { return loraplex_isa_supported(level, 0); }
#endif
