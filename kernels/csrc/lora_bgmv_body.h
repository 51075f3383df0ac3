/* The BGMV kernel for one pair of types (included by lora_bgmv.c, which defines the loads and stores).
 *
 * DEFINE_BGMV(P, ENTRY, W, LOADW, SCALARW, X, LOADX, SCALARX, STOREX, PUTX, SHRINK, SHRINK2) defines
 * static helpers prefixed P, and the exported `int ENTRY(...)`. W is the page element type, X the
 * activations' (x and y); LOAD* read 8 lanes widened to float32, SCALAR* one element, STOREX / PUTX
 * round float32 back to X. SHRINK / SHRINK2 name the one-row and two-row shrinks to use: P##_shrink and
 * P##_shrink2 (defined here), or a specialized pair with the same signatures.
 *
 * A run's pages (consecutive pairs with the same row start) are applied together, row by row: the shrinks
 * of all pages fill one rank vector, one expand adds all pages' products to y, so y is read and rounded
 * once per row whatever the rank (the reference's single rounding for half-precision y).
 */
#define UNUSED __attribute__((unused))
#define MAX_RUN_PAGES 64   /* pages of one run's adapter on one module */
#define MAX_RUN_RANK 1024  /* their rank rows together */

#define DEFINE_BGMV(P, ENTRY_NAME, W, LOADW, SCALARW, X, LOADX, SCALARX, STOREX, PUTX, SHRINK, SHRINK2)      \
    /* dot(w[0:n], x[0:n]) for activations x: eight lanes, then their sum, then the remainder in order. */   \
    static inline float P##_dot(const W *w, const X *x, int64_t n) {                                          \
        int64_t n8 = n & ~(int64_t)7;                                                                         \
        v8f s = {0};                                                                                          \
        for (int64_t i = 0; i < n8; i += 8) s += LOADW(w + i) * LOADX(x + i);                                 \
        float r = v8_hsum(s);                                                                                   \
        for (int64_t i = n8; i < n; i++) r += SCALARW(w + i) * SCALARX(x + i);                                \
        return r;                                                                                             \
    }                                                                                                         \
    /* The same with a float32 vector v (the expand's rank vector). */                                        \
    static inline float P##_dotv(const W *w, const float *v, int64_t n) {                                     \
        int64_t n8 = n & ~(int64_t)7;                                                                         \
        v8f s = {0};                                                                                          \
        for (int64_t i = 0; i < n8; i += 8) s += LOADW(w + i) * v8_load_f32(v + i);                              \
        float r = v8_hsum(s);                                                                                   \
        for (int64_t i = n8; i < n; i++) r += SCALARW(w + i) * v[i];                                          \
        return r;                                                                                             \
    }                                                                                                         \
    /* out[j] = dot(a[j, 0:n], x) for j in [0, rows); rows of a are n elements apart; pa is prefetched. */   \
    static UNUSED void P##_shrink(const W *a, const W *pa, const X *x, int64_t rows, int64_t n, float *out) { \
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
                v8f xv = LOADX(x + i);                                                                        \
                s0 += LOADW(a0 + i) * xv;                                                                     \
                s1 += LOADW(a1 + i) * xv;                                                                     \
                s2 += LOADW(a2 + i) * xv;                                                                     \
                s3 += LOADW(a3 + i) * xv;                                                                     \
            }                                                                                                 \
            float r0 = v8_hsum(s0), r1 = v8_hsum(s1), r2 = v8_hsum(s2), r3 = v8_hsum(s3);                             \
            for (int64_t i = n8; i < n; i++) {                                                                \
                float xi = SCALARX(x + i);                                                                    \
                r0 += SCALARW(a0 + i) * xi;                                                                   \
                r1 += SCALARW(a1 + i) * xi;                                                                   \
                r2 += SCALARW(a2 + i) * xi;                                                                   \
                r3 += SCALARW(a3 + i) * xi;                                                                   \
            }                                                                                                 \
            out[j] = r0, out[j + 1] = r1, out[j + 2] = r2, out[j + 3] = r3;                                   \
        }                                                                                                     \
        for (; j < rows; j++) out[j] = P##_dot(a + j * n, x, n);                                              \
    }                                                                                                         \
    /* Two rows at once (x0, x1 -> out0, out1): each page element loaded once for both. */                  \
    static UNUSED void P##_shrink2(const W *a, const X *x0, const X *x1, int64_t rows, int64_t n,           \
                                   float *out0, float *out1) {                                               \
        int64_t n8 = n & ~(int64_t)7, j = 0;                                                                  \
        for (; j + 2 <= rows; j += 2) {                                                                       \
            const W *a0 = a + j * n, *a1 = a0 + n;                                                            \
            v8f s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0};                                                   \
            for (int64_t i = 0; i < n8; i += 8) {                                                             \
                v8f w0 = LOADW(a0 + i), w1 = LOADW(a1 + i), u0 = LOADX(x0 + i), u1 = LOADX(x1 + i);           \
                s00 += w0 * u0, s01 += w1 * u0, s10 += w0 * u1, s11 += w1 * u1;                               \
            }                                                                                                 \
            float r00 = v8_hsum(s00), r01 = v8_hsum(s01), r10 = v8_hsum(s10), r11 = v8_hsum(s11);                     \
            for (int64_t i = n8; i < n; i++) {                                                                \
                float w0 = SCALARW(a0 + i), w1 = SCALARW(a1 + i), u0 = SCALARX(x0 + i), u1 = SCALARX(x1 + i); \
                r00 += w0 * u0, r01 += w1 * u0, r10 += w0 * u1, r11 += w1 * u1;                               \
            }                                                                                                 \
            out0[j] = r00, out0[j + 1] = r01, out1[j] = r10, out1[j + 1] = r11;                               \
        }                                                                                                     \
        if (j < rows) {                                                                                       \
            SHRINK(a + j * n, a + j * n, x0, rows - j, n, out0 + j);                                          \
            SHRINK(a + j * n, a + j * n, x1, rows - j, n, out1 + j);                                          \
        }                                                                                                     \
    }                                                                                                         \
    /* y[o] = X(y[o] + sum_p dot(b_p[o, 0:r_p], v_p)) for o in [0, fout): the run's pages p < np, page p's  \
     * rows pr elements apart, v_p = v + off[p]; y rounded once. pf: B rows to prefetch (the next run's). */  \
    static void P##_expand(const W *const *bs, const int64_t *rs, const int64_t *off, int64_t np,             \
                           const W *pf, const float *v, int64_t fout, int64_t pr, X *y) {                     \
        int64_t o = 0, vec = 1;                                                                               \
        for (int64_t p = 0; p < np; p++) vec &= (rs[p] & 7) == 0;                                             \
        if (vec) { /* eight outputs at a time, their horizontal sums done together */                        \
            for (; o + 8 <= fout; o += 8) {                                                                   \
                v8f s[8] = {{0}};                                                                             \
                for (int64_t l = 0; l < 8 * pr; l += PF_STEP(W)) __builtin_prefetch(pf + o * pr + l);        \
                for (int64_t p = 0; p < np; p++)                                                              \
                    for (int i = 0; i < 8; i++) {                                                             \
                        const W *bo = bs[p] + (o + i) * pr;                                                   \
                        for (int64_t j = 0; j < rs[p]; j += 8) s[i] += LOADW(bo + j) * v8_load_f32(v + off[p] + j); \
                    }                                                                                         \
                STOREX(y + o, v8_hsum8x8(s) + LOADX(y + o));                                                     \
            }                                                                                                 \
        }                                                                                                     \
        for (; o < fout; o++) {                                                                               \
            float acc = 0.0f;                                                                                 \
            for (int64_t p = 0; p < np; p++) acc += P##_dotv(bs[p] + o * pr, v + off[p], rs[p]);              \
            PUTX(y + o, SCALARX(y + o) + acc);                                                                \
        }                                                                                                     \
    }                                                                                                         \
    /* The same for two rows (v0 -> y0, v1 -> y1), each page element loaded once for both. */               \
    static void P##_expand2(const W *const *bs, const int64_t *rs, const int64_t *off, int64_t np,            \
                            const float *v0, const float *v1, int64_t fout, int64_t pr, X *y0, X *y1) {      \
        int64_t o = 0, vec = 1;                                                                               \
        for (int64_t p = 0; p < np; p++) vec &= (rs[p] & 7) == 0;                                             \
        if (vec) {                                                                                            \
            for (; o + 8 <= fout; o += 8) {                                                                   \
                v8f s0[8] = {{0}}, s1[8] = {{0}};                                                             \
                for (int64_t p = 0; p < np; p++)                                                              \
                    for (int i = 0; i < 8; i++) {                                                             \
                        const W *bo = bs[p] + (o + i) * pr;                                                   \
                        for (int64_t j = 0; j < rs[p]; j += 8) {                                              \
                            v8f w = LOADW(bo + j);                                                            \
                            s0[i] += w * v8_load_f32(v0 + off[p] + j), s1[i] += w * v8_load_f32(v1 + off[p] + j);   \
                        }                                                                                     \
                    }                                                                                         \
                STOREX(y0 + o, v8_hsum8x8(s0) + LOADX(y0 + o));                                                  \
                STOREX(y1 + o, v8_hsum8x8(s1) + LOADX(y1 + o));                                                  \
            }                                                                                                 \
        }                                                                                                     \
        if (o < fout) {                                                                                       \
            const W *bt[MAX_RUN_PAGES];                                                                       \
            for (int64_t p = 0; p < np; p++) bt[p] = bs[p] + o * pr;                                          \
            P##_expand(bt, rs, off, np, bt[0], v0, fout - o, pr, y0 + o);                                     \
            P##_expand(bt, rs, off, np, bt[0], v1, fout - o, pr, y1 + o);                                     \
        }                                                                                                     \
    }                                                                                                         \
    /* Rows [lo, hi) of one run with pages k0 .. k0 + np - 1: per row (or two), the shrink of every page     \
     * into one rank vector (scaled), then one expand over all pages (the pages stay in cache). */           \
    static void P##_run(const X *x, int64_t x_stride, X *y, int64_t y_stride, const W *a, const W *b,       \
                        const int64_t *page_rows, const int32_t *page_ranks, const float *scale, int64_t k0,  \
                        int64_t np, const W *next_a, const W *next_b, int64_t lo, int64_t hi, int64_t pr,   \
                        int64_t fin, int64_t fout) {                                                          \
        const W *as[MAX_RUN_PAGES], *bs[MAX_RUN_PAGES];                                                       \
        int64_t rs[MAX_RUN_PAGES], off[MAX_RUN_PAGES], m = 0, total = 0;                                      \
        float sc[MAX_RUN_PAGES];                                                                              \
        for (int64_t p = 0; p < np; p++) { /* pages in use (rank rows > 0), their offsets in v */            \
            int64_t r = page_ranks[k0 + p] < pr ? page_ranks[k0 + p] : pr;                                    \
            if (r <= 0) continue;                                                                             \
            as[m] = a + page_rows[k0 + p] * pr * fin, bs[m] = b + page_rows[k0 + p] * fout * pr;              \
            rs[m] = r, off[m] = total, sc[m] = scale[k0 + p], total += r, m++;                                \
        }                                                                                                     \
        if (m == 0) return;                                                                                   \
        float v[MAX_RUN_RANK], v1[MAX_RUN_RANK];                                                              \
        int64_t row = lo;                                                                                     \
        for (; row + 2 < hi; row += 2) { /* pairs of rows; the last row (or two) prefetches below */          \
            const X *x0 = x + row * x_stride;                                                                 \
            for (int64_t p = 0; p < m; p++) {                                                                 \
                SHRINK2(as[p], x0, x0 + x_stride, rs[p], fin, v + off[p], v1 + off[p]);                       \
                for (int64_t j = off[p]; j < off[p] + rs[p]; j++) v[j] *= sc[p], v1[j] *= sc[p];              \
            }                                                                                                 \
            P##_expand2(bs, rs, off, m, v, v1, fout, pr, y + row * y_stride, y + (row + 1) * y_stride);       \
        }                                                                                                     \
        for (; row < hi; row++) {                                                                             \
            int last = row + 1 == hi; /* the last row prefetches the next run's first pages */               \
            for (int64_t p = 0; p < m; p++) {                                                                 \
                const W *pa = p + 1 < m ? as[p + 1] : last ? next_a : as[p];                                  \
                SHRINK(as[p], pa, x + row * x_stride, rs[p], fin, v + off[p]);                                \
                for (int64_t j = off[p]; j < off[p] + rs[p]; j++) v[j] *= sc[p];                              \
            }                                                                                                 \
            P##_expand(bs, rs, off, m, last ? next_b : bs[0], v, fout, pr, y + row * y_stride);               \
        }                                                                                                     \
    }                                                                                                         \
    /* Returns 0; -1 when pr is out of range, -2 when a run has more pages or rank than the kernel holds. */  \
    int ENTRY_NAME(const X *x, int64_t x_stride, X *y, int64_t y_stride, const W *a, const W *b,             \
                   const int64_t *page_rows, const int32_t *page_ranks, const int64_t *row_starts,            \
                   const int32_t *row_counts, const float *scale, int64_t num_pairs, int64_t pr,              \
                   int64_t fin, int64_t fout, int num_threads) {                                              \
        if (pr < 1 || pr > MAX_PAGE_RANK) return -1;                                                          \
        int64_t total_rows = 0;                                                                               \
        for (int64_t k = 0, np = 0; k < num_pairs; k++) {                                                     \
            np = k > 0 && row_starts[k] == row_starts[k - 1] ? np + 1 : 1;                                    \
            if (np > MAX_RUN_PAGES || np * pr > MAX_RUN_RANK) return -2;                                      \
            if (np == 1) total_rows += row_counts[k];                                                         \
        }                                                                                                     \
        if (num_threads < 1 || total_rows < 2 * num_threads) num_threads = 1;                                 \
        _Pragma("omp parallel num_threads(num_threads) if (num_threads > 1)") {                               \
            int t = 0, nt = 1;                                                                                \
            SET_THREAD(t, nt);                                                                                \
            for (int pass = 0; pass < 2; pass++) {                                                            \
                /* pass 0: runs of >= 2 rows per thread, each thread an even share of every run's rows;      \
                 * pass 1: shorter runs, whole, the runs split between threads */                             \
                int64_t k = pass ? split_at_run(row_starts, num_pairs, t, nt) : 0;                            \
                int64_t end = pass ? split_at_run(row_starts, num_pairs, t + 1, nt) : num_pairs;              \
                while (k < end) {                                                                             \
                    int64_t k1 = k + 1; /* the run's pairs: [k, k1) */                                       \
                    while (k1 < end && row_starts[k1] == row_starts[k]) k1++;                                 \
                    int64_t n = row_counts[k], split = n >= 2 * nt;                                           \
                    if (split == (pass == 0)) {                                                               \
                        int64_t lo = split ? n * t / nt : 0, hi = split ? n * (t + 1) / nt : n;               \
                        int64_t next = page_rows[k1 < num_pairs ? k1 : k];                                    \
                        P##_run(x, x_stride, y, y_stride, a, b, page_rows, page_ranks, scale, k, k1 - k,      \
                                a + next * pr * fin, b + next * fout * pr, row_starts[k] + lo,                \
                                row_starts[k] + hi, pr, fin, fout);                                           \
                    }                                                                                         \
                    k = k1;                                                                                   \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        return 0;                                                                                             \
    }
