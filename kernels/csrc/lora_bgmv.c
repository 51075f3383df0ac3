/* LoRA on the CPU for a batch of runs (rows of the flat batch on one adapter: a decode token, a prefill
 * chunk): BGMV, gathered matrix-vector products read in place from the paged adapter pool.
 *
 * For every (run, page) pair k of one projection slice at one layer, with n = page_ranks[k] <= pr, and
 * every row t in [row_starts[k], row_starts[k] + row_counts[k]):
 *
 *     v[0:n]      = scale[k] * A[page_rows[k], 0:n, :] @ x[t]     A pages: [pr, fin]
 *     y[t, 0:fout] += B[page_rows[k], :, 0:n] @ v                 B pages: [fout, pr]
 *
 * with float32 accumulation. Pages are read where they lie, nothing is gathered into a workspace first:
 * for decode rows each byte of adapter weights is read once; a run's rows reuse its pages from cache.
 * Activations x, y (type X) and pool weights (type W) are each float32, bfloat16 or float16, one entry
 * point per pair of types: `lora_bgmv_<x>_<w>_<isa>`. Half-precision values are widened in registers;
 * a half-precision y row is read, the pair's float32 sum added, and rounded once (to nearest even) per
 * pair. Pairs are sorted by run, then page. Threads never write the same row: they split long runs'
 * rows and short runs' pairs (at run boundaries), and each row's pages are added in order, so results
 * do not depend on the thread count.
 *
 * Instruction sets: this file is compiled once per ISA level into one library (kernels/native_build.py)
 * with -DLORA_ISA=<name>: `generic` (the compiler's baseline), `avx2` (AVX2, FMA, F16C) and
 * `avx512bf16` (AVX-512 F/BW/VL + BF16: bfloat16 x bfloat16 shrinks use vdpbf16ps, 32 products per
 * instruction). `lora_bgmv_isa_supported(level)`, in the generic build, says which the CPU (and OS)
 * can run; the launcher picks the best one at load time.
 *
 * Semantics are those of kernels/reference.py: lora_shrink_ref, the scaling, then lora_expand_ref.
 */
#include "cpu_isa.h"
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#ifndef LORA_ISA
#define LORA_ISA generic
#define LORA_ISA_LEVEL 0
#endif
#define CAT3_(a, b, c) a##_##b##_##c
#define CAT3(a, b, c) CAT3_(a, b, c)
#define ENTRY(xw) CAT3(lora_bgmv, xw, LORA_ISA)

#define MAX_PAGE_RANK 256

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

/* ---- loads (8 lanes widened to float32) and stores (8 lanes rounded to the element type) ---- */
static inline v8f load_f32(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline float scalar_f32(const float *p) { return *p; }
static inline void store_f32(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline void put_f32(float *p, float f) { *p = f; }

/* bfloat16 is the high half of a float32: widen and shift; narrow by rounding to nearest even. */
static inline v8f load_bf16(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 w = __builtin_convertvector(h, v8u32) << 16;
    v8f v;
    memcpy(&v, &w, sizeof v);
    return v;
}
static inline float scalar_bf16(const uint16_t *p) {
    uint32_t w = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}
static inline void store_bf16(uint16_t *p, v8f v) {
    v8u32 w;
    memcpy(&w, &v, sizeof w);
    v8u32 r = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    v8u32 nan = (v8u32)(v != v); /* NaN stays a (quiet) NaN, as torch rounds it */
    r = (r & ~nan) | (0x7FC0u & nan);
    v8u16 h = __builtin_convertvector(r, v8u16);
    memcpy(p, &h, sizeof h);
}
static inline void put_bf16(uint16_t *p, float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    *p = f != f ? 0x7FC0u : (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

#ifdef __FLT16_MAX__
typedef _Float16 v8h __attribute__((vector_size(16)));
#ifdef __F16C__
static inline v8f load_f16(const _Float16 *p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void store_f16(_Float16 *p, v8f v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
}
#else
static inline v8f load_f16(const _Float16 *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8f);
}
static inline void store_f16(_Float16 *p, v8f v) {
    v8h h = __builtin_convertvector(v, v8h);
    memcpy(p, &h, sizeof h);
}
#endif
static inline float scalar_f16(const _Float16 *p) { return (float)*p; }
static inline void put_f16(_Float16 *p, float f) { *p = (_Float16)f; }
#endif

static inline float hsum8(v8f v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

/* Lane i of the result is the sum of the lanes of s[i]: eight horizontal sums in seven shuffle-adds. */
static inline v8f hsum8x8(const v8f s[8]) {
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

/* First pair index of thread `t` of `nt`: an even split of [0, num_pairs), moved forward to the start of
 * a run so that each run's pairs belong to one thread. */
static int64_t split_at_run(const int64_t *row_starts, int64_t num_pairs, int t, int nt) {
    int64_t k = num_pairs * t / nt;
    while (k > 0 && k < num_pairs && row_starts[k] == row_starts[k - 1]) k++;
    return k;
}

/* Software prefetch of the next pair's pages, one cache line (64 bytes) at a time: pages are short
 * streams, and the hardware prefetcher would start over on each. */
#define PF_STEP(W) ((int64_t)(64 / sizeof(W)))
#define PF_MASK(W) (PF_STEP(W) - 1)

#include "lora_bgmv_body.h"
#ifdef __AVX512BF16__
#include "lora_bgmv_dpbf16.h"
#define BF16_SHRINK dp_shrink_bf16
#define BF16_SHRINK2 dp_shrink2_bf16
#else
#define BF16_SHRINK bf16_bf16_shrink
#define BF16_SHRINK2 bf16_bf16_shrink2
#endif

#ifdef _OPENMP
#define SET_THREAD(t, nt) (t = omp_get_thread_num(), nt = omp_get_num_threads())
#else
#define SET_THREAD(t, nt) ((void)0)
#endif

/* The entry points: BGMV(prefix, entry, W pages..., X activations..., shrink, two-row shrink); the
 * wrapper expands the type lists into DEFINE_BGMV's arguments. */
#define BGMV(...) DEFINE_BGMV(__VA_ARGS__)
#define W_F32 float, load_f32, scalar_f32
#define W_BF16 uint16_t, load_bf16, scalar_bf16
#define X_F32 float, load_f32, scalar_f32, store_f32, put_f32
#define X_BF16 uint16_t, load_bf16, scalar_bf16, store_bf16, put_bf16
BGMV(f32_f32, ENTRY(f32_f32), W_F32, X_F32, f32_f32_shrink, f32_f32_shrink2)
BGMV(f32_bf16, ENTRY(f32_bf16), W_BF16, X_F32, f32_bf16_shrink, f32_bf16_shrink2)
BGMV(bf16_f32, ENTRY(bf16_f32), W_F32, X_BF16, bf16_f32_shrink, bf16_f32_shrink2)
BGMV(bf16_bf16, ENTRY(bf16_bf16), W_BF16, X_BF16, BF16_SHRINK, BF16_SHRINK2)
#ifdef __FLT16_MAX__
#define W_F16 _Float16, load_f16, scalar_f16
#define X_F16 _Float16, load_f16, scalar_f16, store_f16, put_f16
BGMV(f32_f16, ENTRY(f32_f16), W_F16, X_F32, f32_f16_shrink, f32_f16_shrink2)
BGMV(bf16_f16, ENTRY(bf16_f16), W_F16, X_BF16, bf16_f16_shrink, bf16_f16_shrink2)
BGMV(f16_f32, ENTRY(f16_f32), W_F32, X_F16, f16_f32_shrink, f16_f32_shrink2)
BGMV(f16_bf16, ENTRY(f16_bf16), W_BF16, X_F16, f16_bf16_shrink, f16_bf16_shrink2)
BGMV(f16_f16, ENTRY(f16_f16), W_F16, X_F16, f16_f16_shrink, f16_f16_shrink2)
#endif

/* The generic build answers for all: 1 when float16 types exist, and which ISA levels the CPU runs. */
#if LORA_ISA_LEVEL == 0
#ifdef __FLT16_MAX__
int lora_bgmv_has_f16(void) { return 1; }
#else
int lora_bgmv_has_f16(void) { return 0; }
#endif

int lora_bgmv_isa_supported(int level) { return loraplex_isa_supported(level, 1); }
#endif
