/* LoRA on the CPU for a batch of runs (rows of the flat batch on one adapter: a decode token, a prefill
 * chunk): BGMV, gathered matrix-vector products read in place from the paged adapter pool.
 *
 * For every (run, page) pair k of one projection slice at one layer, with n = page_ranks[k] <= pr, and
 * every row t in [row_starts[k], row_starts[k] + row_counts[k]):
 *
 *     v[0:n]      = scale[k] * A[page_rows[k], 0:n, :] @ x[t]     A pages: [pr, fin]
 *     y[t, 0:fout] += B[page_rows[k], :, 0:n] @ v                 B pages: [fout, pr]
 *
 * in float32. Pages are read where they lie, nothing is gathered into a workspace first (the torch
 * path's index_select + bmm writes every page and reads it again): for decode rows each byte of adapter
 * weights is read once; a run's rows reuse its pages from cache. x and y are float32; the pool holds
 * float32, float16 or bfloat16 weights (widened in registers), one entry point each. Pairs are sorted by
 * run, then page. Threads never write the same row: they split long runs' rows and short runs' pairs
 * (at run boundaries), and each row's pages are added in order, so results do not depend on them.
 *
 * Semantics are those of kernels/reference.py: lora_shrink_ref, the scaling, then lora_expand_ref.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_PAGE_RANK 256

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load_f32(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline float scalar_f32(const float *p) { return *p; }

/* bfloat16 is the high half of a float32: widen and shift. */
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

#ifdef __FLT16_MAX__
#ifdef __F16C__
#include <immintrin.h>
static inline v8f load_f16(const _Float16 *p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
typedef _Float16 v8h __attribute__((vector_size(16)));
static inline v8f load_f16(const _Float16 *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v8f);
}
#endif
static inline float scalar_f16(const _Float16 *p) { return (float)*p; }
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

/* One kernel per weight type W, with LOAD(p) (8 lanes) and SCALAR(p) reading W. */
#define DEFINE_BGMV(NAME, W, LOAD, SCALAR)                                                                    \
    /* dot(w[0:n], x[0:n]): eight lanes, then their sum, then the remainder in order. */                     \
    static inline float NAME##_dot(const W *w, const float *x, int64_t n) {                                  \
        int64_t n8 = n & ~(int64_t)7;                                                                         \
        v8f s = {0};                                                                                          \
        for (int64_t i = 0; i < n8; i += 8) s += LOAD(w + i) * load_f32(x + i);                              \
        float r = hsum8(s);                                                                                   \
        for (int64_t i = n8; i < n; i++) r += SCALAR(w + i) * x[i];                                           \
        return r;                                                                                             \
    }                                                                                                         \
    /* out[j] = dot(a[j, 0:n], x) for j in [0, rows); rows of a are n elements apart. */                      \
    static void NAME##_shrink(const W *a, const W *pa, const float *x, int64_t rows, int64_t n, float *out) { \
        int64_t n8 = n & ~(int64_t)7, j = 0; /* n: the slice's input features */                            \
        for (; j + 4 <= rows; j += 4) {                                                                       \
            const W *a0 = a + j * n, *a1 = a0 + n, *a2 = a1 + n, *a3 = a2 + n;                                \
            v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};                                                       \
            for (int64_t i = 0; i < n8; i += 8) {                                                             \
                if ((i & PF_MASK(W)) == 0) {                                                                  \
                    __builtin_prefetch(pa + j * n + i);                                                       \
                    __builtin_prefetch(pa + (j + 1) * n + i);                                                 \
                    __builtin_prefetch(pa + (j + 2) * n + i);                                                 \
                    __builtin_prefetch(pa + (j + 3) * n + i);                                                 \
                }                                                                                             \
                v8f xv = load_f32(x + i);                                                                     \
                s0 += LOAD(a0 + i) * xv;                                                                      \
                s1 += LOAD(a1 + i) * xv;                                                                      \
                s2 += LOAD(a2 + i) * xv;                                                                      \
                s3 += LOAD(a3 + i) * xv;                                                                      \
            }                                                                                                 \
            float r0 = hsum8(s0), r1 = hsum8(s1), r2 = hsum8(s2), r3 = hsum8(s3);                             \
            for (int64_t i = n8; i < n; i++) {                                                                \
                r0 += SCALAR(a0 + i) * x[i];                                                                  \
                r1 += SCALAR(a1 + i) * x[i];                                                                  \
                r2 += SCALAR(a2 + i) * x[i];                                                                  \
                r3 += SCALAR(a3 + i) * x[i];                                                                  \
            }                                                                                                 \
            out[j] = r0, out[j + 1] = r1, out[j + 2] = r2, out[j + 3] = r3;                                   \
        }                                                                                                     \
        for (; j < rows; j++) out[j] = NAME##_dot(a + j * n, x, n);                                           \
    }                                                                                                         \
    /* y[o] += dot(b[o, 0:n], v) for o in [0, fout); rows of b are pr elements apart. */                      \
    static void NAME##_expand(const W *b, const W *pb, const float *v, int64_t fout, int64_t pr, int64_t n,  \
                              float *y) {                                                                     \
        int64_t n8 = n & ~(int64_t)7, o = 0;                                                                  \
        if (n8 == n) { /* eight outputs at a time, their horizontal sums done together */                    \
            for (; o + 8 <= fout; o += 8) {                                                                   \
                v8f s[8];                                                                                     \
                for (int64_t l = 0; l < 8 * pr; l += PF_STEP(W)) __builtin_prefetch(pb + o * pr + l);        \
                for (int i = 0; i < 8; i++) {                                                                 \
                    const W *bo = b + (o + i) * pr;                                                           \
                    s[i] = LOAD(bo) * load_f32(v);                                                            \
                    for (int64_t j = 8; j < n; j += 8) s[i] += LOAD(bo + j) * load_f32(v + j);                \
                }                                                                                             \
                v8f acc = hsum8x8(s) + load_f32(y + o);                                                       \
                memcpy(y + o, &acc, sizeof acc);                                                              \
            }                                                                                                 \
        }                                                                                                     \
        for (; o < fout; o++) y[o] += NAME##_dot(b + o * pr, v, n);                                           \
    }                                                                                                         \
    /* Two rows at once (x0, x1 -> out0, out1): each page element loaded once for both. */                  \
    static void NAME##_shrink2(const W *a, const float *x0, const float *x1, int64_t rows, int64_t n,       \
                               float *out0, float *out1) {                                                   \
        int64_t n8 = n & ~(int64_t)7, j = 0;                                                                  \
        for (; j + 2 <= rows; j += 2) {                                                                       \
            const W *a0 = a + j * n, *a1 = a0 + n;                                                            \
            v8f s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0};                                                   \
            for (int64_t i = 0; i < n8; i += 8) {                                                             \
                v8f w0 = LOAD(a0 + i), w1 = LOAD(a1 + i), u0 = load_f32(x0 + i), u1 = load_f32(x1 + i);       \
                s00 += w0 * u0, s01 += w1 * u0, s10 += w0 * u1, s11 += w1 * u1;                               \
            }                                                                                                 \
            float r00 = hsum8(s00), r01 = hsum8(s01), r10 = hsum8(s10), r11 = hsum8(s11);                     \
            for (int64_t i = n8; i < n; i++) {                                                                \
                float w0 = SCALAR(a0 + i), w1 = SCALAR(a1 + i);                                               \
                r00 += w0 * x0[i], r01 += w1 * x0[i], r10 += w0 * x1[i], r11 += w1 * x1[i];                   \
            }                                                                                                 \
            out0[j] = r00, out0[j + 1] = r01, out1[j] = r10, out1[j + 1] = r11;                               \
        }                                                                                                     \
        if (j < rows) {                                                                                       \
            NAME##_shrink(a + j * n, a + j * n, x0, rows - j, n, out0 + j);                                   \
            NAME##_shrink(a + j * n, a + j * n, x1, rows - j, n, out1 + j);                                   \
        }                                                                                                     \
    }                                                                                                         \
    static void NAME##_expand2(const W *b, const float *v0, const float *v1, int64_t fout, int64_t pr,      \
                               int64_t n, float *y0, float *y1) {                                            \
        if ((n & 7) != 0) {                                                                                   \
            NAME##_expand(b, b, v0, fout, pr, n, y0);                                                         \
            NAME##_expand(b, b, v1, fout, pr, n, y1);                                                         \
            return;                                                                                           \
        }                                                                                                     \
        int64_t o = 0;                                                                                        \
        for (; o + 8 <= fout; o += 8) {                                                                       \
            v8f s0[8], s1[8];                                                                                 \
            for (int i = 0; i < 8; i++) {                                                                     \
                const W *bo = b + (o + i) * pr;                                                               \
                v8f w = LOAD(bo);                                                                             \
                s0[i] = w * load_f32(v0), s1[i] = w * load_f32(v1);                                           \
                for (int64_t j = 8; j < n; j += 8) {                                                          \
                    w = LOAD(bo + j);                                                                         \
                    s0[i] += w * load_f32(v0 + j), s1[i] += w * load_f32(v1 + j);                             \
                }                                                                                             \
            }                                                                                                 \
            v8f acc0 = hsum8x8(s0) + load_f32(y0 + o), acc1 = hsum8x8(s1) + load_f32(y1 + o);                 \
            memcpy(y0 + o, &acc0, sizeof acc0);                                                               \
            memcpy(y1 + o, &acc1, sizeof acc1);                                                               \
        }                                                                                                     \
        if (o < fout) {                                                                                       \
            NAME##_expand(b + o * pr, b + o * pr, v0, fout - o, pr, n, y0 + o);                               \
            NAME##_expand(b + o * pr, b + o * pr, v1, fout - o, pr, n, y1 + o);                               \
        }                                                                                                     \
    }                                                                                                         \
    /* Rows [lo, hi) of one pair: shrink, scale, expand, row by row (the page stays in cache). */          \
    static void NAME##_rows(const float *x, int64_t x_stride, float *y, int64_t y_stride, const W *ap,      \
                            const W *bp, const W *next_a, const W *next_b, int64_t r, float scale,          \
                            int64_t lo, int64_t hi, int64_t pr, int64_t fin, int64_t fout) {                \
        float v[MAX_PAGE_RANK], v1[MAX_PAGE_RANK];                                                            \
        int64_t row = lo;                                                                                     \
        for (; row + 2 < hi; row += 2) { /* pairs of rows; the last row (or two) prefetches below */          \
            const float *x0 = x + row * x_stride;                                                             \
            NAME##_shrink2(ap, x0, x0 + x_stride, r, fin, v, v1);                                             \
            for (int64_t j = 0; j < r; j++) v[j] *= scale, v1[j] *= scale;                                    \
            NAME##_expand2(bp, v, v1, fout, pr, r, y + row * y_stride, y + (row + 1) * y_stride);             \
        }                                                                                                     \
        for (; row < hi; row++) {                                                                             \
            int last = row + 1 == hi; /* the last row prefetches the next pair's pages */                    \
            NAME##_shrink(ap, last ? next_a : ap, x + row * x_stride, r, fin, v);                             \
            for (int64_t j = 0; j < r; j++) v[j] *= scale;                                                    \
            NAME##_expand(bp, last ? next_b : bp, v, fout, pr, r, y + row * y_stride);                        \
        }                                                                                                     \
    }                                                                                                         \
    /* Returns 0, or -1 when pr is out of range. */                                                           \
    int NAME(const float *x, int64_t x_stride, float *y, int64_t y_stride, const W *a, const W *b,           \
             const int64_t *page_rows, const int32_t *page_ranks, const int64_t *row_starts,                  \
             const int32_t *row_counts, const float *scale, int64_t num_pairs, int64_t pr, int64_t fin,      \
             int64_t fout, int num_threads) {                                                                 \
        if (pr < 1 || pr > MAX_PAGE_RANK) return -1;                                                          \
        int64_t total_rows = 0;                                                                               \
        for (int64_t k = 0; k < num_pairs; k++) total_rows += row_counts[k];                                  \
        if (num_threads < 1 || total_rows < 2 * num_threads) num_threads = 1;                                 \
        _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1)") {                               \
            int t = 0, nt = 1;                                                                                \
            SET_THREAD(t, nt);                                                                                \
            for (int pass = 0; pass < 2; pass++) {                                                            \
                /* pass 0: runs of >= 2 rows per thread, each thread an even share of every run's rows;      \
                 * pass 1: shorter runs, whole, the pairs split between threads at run boundaries */          \
                int64_t k = pass ? split_at_run(row_starts, num_pairs, t, nt) : 0;                            \
                int64_t end = pass ? split_at_run(row_starts, num_pairs, t + 1, nt) : num_pairs;              \
                for (; k < end; k++) {                                                                        \
                    int64_t r = page_ranks[k] < pr ? page_ranks[k] : pr; /* rank rows used in this page */    \
                    int64_t n = row_counts[k], split = n >= 2 * nt;                                           \
                    if (r <= 0 || split != (pass == 0)) continue;                                             \
                    int64_t lo = split ? n * t / nt : 0, hi = split ? n * (t + 1) / nt : n;                   \
                    int64_t next = page_rows[k + 1 < num_pairs ? k + 1 : k];                                  \
                    NAME##_rows(x, x_stride, y, y_stride, a + page_rows[k] * pr * fin,                        \
                                b + page_rows[k] * fout * pr, a + next * pr * fin, b + next * fout * pr, r,   \
                                scale[k], row_starts[k] + lo, row_starts[k] + hi, pr, fin, fout);             \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        return 0;                                                                                             \
    }

#ifdef _OPENMP
#define SET_THREAD(t, nt) (t = omp_get_thread_num(), nt = omp_get_num_threads())
#else
#define SET_THREAD(t, nt) ((void)0)
#endif

DEFINE_BGMV(lora_bgmv_f32, float, load_f32, scalar_f32)
DEFINE_BGMV(lora_bgmv_bf16, uint16_t, load_bf16, scalar_bf16)
#ifdef __FLT16_MAX__
DEFINE_BGMV(lora_bgmv_f16, _Float16, load_f16, scalar_f16)
int lora_bgmv_has_f16(void) { return 1; }
#else
int lora_bgmv_has_f16(void) { return 0; }
#endif
