/* Eight-lane float32 vectors (GCC vector extensions), shared by the native CPU kernels, and the loads and
 * stores that widen float32, bfloat16 and float16 elements to them and round them back (to nearest even,
 * NaN kept a quiet NaN, as torch rounds). Compiled at every instruction-set level: with F16C the float16 conversions use it.
 * `VEC8_HAS_F16` is defined when the compiler has _Float16.
 */
#ifndef LORAPLEX_VEC8_H
#define LORAPLEX_VEC8_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f v8_load_f32(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void v8_store_f32(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* bfloat16 is the high half of a float32: widen by a shift; narrow by rounding to nearest even. */
static inline v8f v8_load_bf16(const uint16_t *p) {
#ifdef __AVX2__ /* one vpmovzxwd: GCC 12 splits the generic form below into two 128-bit halves */
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (v8f)_mm256_castsi256_ps(w);
#else
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;
    v8f v;
    memcpy(&v, &w, sizeof v);
    return v;
#endif
}
static inline float v1_load_bf16(const uint16_t *p) {
    uint32_t w = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}
static inline void v8_store_bf16(uint16_t *p, v8f v) {
    v8u32 w;
    memcpy(&w, &v, sizeof w);
    v8u32 r = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    v8u32 nan = (v8u32)(v != v);
    r = (r & ~nan) | (0x7FC0u & nan);
    v8u16 h = __builtin_convertvector(r, v8u16);
    memcpy(p, &h, sizeof h);
}
static inline void v1_store_bf16(uint16_t *p, float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    *p = f != f ? 0x7FC0u : (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

#ifdef __FLT16_MAX__
#define VEC8_HAS_F16 1
typedef _Float16 v8h __attribute__((vector_size(16)));
#ifdef __F16C__
static inline v8f v8_load_f16(const _Float16 *p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void v8_store_f16(_Float16 *p, v8f v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
}
#else
static inline v8f v8_load_f16(const _Float16 *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8f);
}
static inline void v8_store_f16(_Float16 *p, v8f v) {
    v8h h = __builtin_convertvector(v, v8h);
    memcpy(p, &h, sizeof h);
}
#endif
#endif

/* Lane i of the result is the sum of the lanes of s[i]: eight horizontal sums in seven shuffle-adds. */
static inline v8f v8_hsum8x8(const v8f s[8]) {
    const v8i even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f p[4], q[2];
    for (int i = 0; i < 4; i++)
        p[i] = __builtin_shuffle(s[2 * i], s[2 * i + 1], even) + __builtin_shuffle(s[2 * i], s[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        q[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo2) + __builtin_shuffle(p[2 * i], p[2 * i + 1], hi2);
    return __builtin_shuffle(q[0], q[1], lo4) + __builtin_shuffle(q[0], q[1], hi4);
}

static inline float v8_hsum(v8f v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

static inline float v8_hmax(v8f v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* exp(x) for x <= 0 in every lane (x = -inf gives 0): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its
 * Taylor series to r^7 (relative error below 1e-8 there), times 2^n built in the exponent bits. Inputs
 * below -87 (where 2^n would leave the normal range) are clamped to -87 and then zeroed. */
static inline v8f v8_exp_nonpos(v8f x) {
    const v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    v8i under = x < lo;
    x = (v8f)(((v8i)x & ~under) | ((v8i)lo & under));
    v8f t = x * 1.44269504088896341f;                    /* x / ln2 */
    v8f n = (t + 12582912.0f) - 12582912.0f;            /* round to nearest (1.5 * 2^23 trick) */
    v8f r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* ln2 split in two: x - n ln2, exactly-ish */
    v8f p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    p *= (v8f)e;
    return (v8f)((v8i)p & ~under);
}

#endif
