/* Paged attention on the CPU for decode rows and short query runs, reading K/V blocks where they lie.
 *
 * Caches are [num_blocks, block_size, Hkv, D] (kernels/reference.py). For each listed sequence b
 * (`seqs`), with n = query_start[b+1] - query_start[b] query rows at positions L - n .. L - 1
 * (L = seq_lens[b]; a decode row has n = 1), every row i and query head h:
 *
 *     out[qs + i, h] = softmax_j(cap(scale * q[qs + i, h] . K_b[j, h / group])) . V_b[j, h / group],
 *                      j over lo .. L - n + i,   K_b[j] = k_cache[tables[b, j / bs], j % bs]
 *
 * lo = 0, or with a sliding window (window > 0) lo = max(0, L - n + i - window + 1): the row sees its
 * last `window` positions. cap(s) = s, or with soft-capping (softcap > 0) softcap * tanh(s / softcap).
 *
 * One work item is a (sequence, KV head): its `group` query heads of all n rows are processed together
 * (at most VMAX query vectors per pass), so each K and V row is read from memory once per pass. Keys go
 * by chunks of at most KCHUNK within a block, one online-softmax update per chunk: scores, running max
 * m, running sum l, and the output row rescaled by exp(m_old - m_new); all in float32. The next block's
 * rows are prefetched. Work items are split between OpenMP threads (dynamically: lengths are ragged);
 * each is computed by one thread alone, so results do not depend on the thread count.
 *
 * Query and output (type Q) and the caches (type KV) are each float32, bfloat16 or float16; one entry
 * point per pair: `paged_attention_<q>_<kv>_<isa>`. This file is compiled once per instruction-set
 * level (kernels/native_build.py, -DPA_ISA=<name>): generic, avx2 (AVX2, FMA, F16C), avx512 (AVX-512
 * F/BW/VL); `paged_attention_isa_supported(level)` (generic build) says which the CPU runs.
 */
#include "cpu_isa.h"
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "vec8.h"

#ifndef PA_ISA
#define PA_ISA generic
#define PA_ISA_LEVEL 0
#endif
#define CAT4_(a, b, c, d) a##_##b##_##c##_##d
#define CAT4(a, b, c, d) CAT4_(a, b, c, d)

#define VMAX 16   /* query vectors per pass */
#define KCHUNK 32 /* keys per online-softmax update */
#define DMAX 256  /* head dim */
#define PREFETCH_KEYS 256 /* keys of a work item prefetched ahead (64-128 KiB at D = 64) */
#define INLINE static inline __attribute__((always_inline))

/* Element access by type: 8 elements widened to float32, one element, and their rounding stores. */
typedef v8f (*load8_t)(const void *p, int64_t i);
typedef float (*load1_t)(const void *p, int64_t i);
typedef void (*store8_t)(void *p, int64_t i, v8f v);
typedef void (*store1_t)(void *p, int64_t i, float f);

INLINE v8f ld8_f32(const void *p, int64_t i) { return v8_load_f32((const float *)p + i); }
INLINE float ld1_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
INLINE void st8_f32(void *p, int64_t i, v8f v) { v8_store_f32((float *)p + i, v); }
INLINE void st1_f32(void *p, int64_t i, float f) { ((float *)p)[i] = f; }
INLINE v8f ld8_bf16(const void *p, int64_t i) { return v8_load_bf16((const uint16_t *)p + i); }
INLINE float ld1_bf16(const void *p, int64_t i) { return v1_load_bf16((const uint16_t *)p + i); }
INLINE void st8_bf16(void *p, int64_t i, v8f v) { v8_store_bf16((uint16_t *)p + i, v); }
INLINE void st1_bf16(void *p, int64_t i, float f) { v1_store_bf16((uint16_t *)p + i, f); }
#ifdef VEC8_HAS_F16
INLINE v8f ld8_f16(const void *p, int64_t i) { return v8_load_f16((const _Float16 *)p + i); }
INLINE float ld1_f16(const void *p, int64_t i) { return (float)((const _Float16 *)p)[i]; }
INLINE void st8_f16(void *p, int64_t i, v8f v) { v8_store_f16((_Float16 *)p + i, v); }
INLINE void st1_f16(void *p, int64_t i, float f) { ((_Float16 *)p)[i] = (_Float16)f; }
#endif

typedef struct {
    load8_t ld8;
    load1_t ld1;
    store8_t st8;
    store1_t st1;
    int64_t size; /* bytes per element */
} elem_t;

/* Everything a call shares between its work items. Strides are in elements. */
typedef struct {
    const char *q, *k, *v;
    char *out;
    int64_t q_row, q_head, o_row, o_head;
    const int32_t *tables, *seq_lens, *query_start, *seqs;
    int64_t table_stride, hq, hkv, d, bs;
    float scale;
    int64_t window; /* > 0: a query row sees its last `window` positions only */
    float softcap;  /* > 0: scores soft-capped to (-softcap, softcap) by tanh */
} args_t;

/* scores[v][j] = q_v . K_j for the chunk's cnt keys (rows k_rows[j]) and nv query vectors qbuf[v]. */
INLINE void chunk_scores(elem_t KV, const char *const *k_rows, int64_t cnt, const float (*qbuf)[DMAX],
                         int64_t nv, int64_t d, float (*scores)[KCHUNK]) {
    int64_t d8 = d & ~(int64_t)7, j = 0;
    for (; j + 8 <= cnt; j += 8)
        for (int64_t v = 0; v < nv; v++) {
            v8f s[8] = {{0}};
            for (int64_t e = 0; e < d8; e += 8) {
                v8f qv = v8_load_f32(qbuf[v] + e);
                for (int r = 0; r < 8; r++) s[r] += KV.ld8(k_rows[j + r], e) * qv;
            }
            v8f sum = v8_hsum8x8(s);
            for (int64_t e = d8; e < d; e++)
                for (int r = 0; r < 8; r++) sum[r] += KV.ld1(k_rows[j + r], e) * qbuf[v][e];
            v8_store_f32(scores[v] + j, sum);
        }
    for (; j < cnt; j++)
        for (int64_t v = 0; v < nv; v++) {
            v8f s = {0};
            for (int64_t e = 0; e < d8; e += 8) s += KV.ld8(k_rows[j], e) * v8_load_f32(qbuf[v] + e);
            float r = v8_hsum(s);
            for (int64_t e = d8; e < d; e++) r += KV.ld1(k_rows[j], e) * qbuf[v][e];
            scores[v][j] = r;
        }
}

/* One online-softmax update of the pass's nv query vectors with a chunk of cnt keys (first key k0),
 * rows k_rows / v_rows of element type RE: scores, running max m and sum l, acc rescaled and added to. */
INLINE void chunk_update(elem_t RE, const char *const *k_rows, const char *const *v_rows, int64_t cnt, int64_t k0,
                         const float (*qbuf)[DMAX], int64_t nv, int64_t d, const int64_t *lo, const int64_t *lim,
                         float softcap, float *m, float *l, float (*acc)[DMAX], float (*scores)[KCHUNK]) {
    const int64_t d8 = d & ~(int64_t)7;
    chunk_scores(RE, k_rows, cnt, (const float(*)[DMAX])qbuf, nv, d, scores);
    for (int64_t v = 0; v < nv; v++) {
        float *s = scores[v], mx = m[v];
        int64_t vis = lim[v] - k0 < cnt ? lim[v] - k0 : cnt; /* keys of this chunk v sees: first .. vis-1 */
        int64_t first = lo[v] - k0 > 0 ? lo[v] - k0 : 0;    /* (a sliding window hides the earlier ones) */
        if (first >= vis) continue;                          /* none: m, l and acc stay as they are */
        if (softcap > 0.0f)
            for (int64_t j = first; j < vis; j++) s[j] = softcap * tanhf(s[j] / softcap);
        for (int64_t j = first; j < vis; j++) mx = s[j] > mx ? s[j] : mx;
        for (int64_t j = 0; j < first; j++) s[j] = -INFINITY;
        for (int64_t j = vis; j < cnt; j++) s[j] = -INFINITY;
        float corr = m[v] == -INFINITY ? 0.0f : expf(m[v] - mx), sum = 0.0f;
        int64_t j = 0;
        for (; j + 8 <= cnt; j += 8) {
            v8f p = v8_exp_nonpos(v8_load_f32(s + j) - mx);
            v8_store_f32(s + j, p);
            sum += v8_hsum(p);
        }
        for (; j < cnt; j++) sum += (s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - mx));
        m[v] = mx, l[v] = l[v] * corr + sum;
        float *o = acc[v];
        int64_t e = 0;
        for (; e + 32 <= d8; e += 32) { /* four independent sums: FMA latency, not a chain, bounds it */
            v8f t0 = v8_load_f32(o + e) * corr, t1 = v8_load_f32(o + e + 8) * corr;
            v8f t2 = v8_load_f32(o + e + 16) * corr, t3 = v8_load_f32(o + e + 24) * corr;
            for (int64_t r = 0; r < cnt; r++) {
                const float pr = s[r];
                t0 += pr * RE.ld8(v_rows[r], e), t1 += pr * RE.ld8(v_rows[r], e + 8);
                t2 += pr * RE.ld8(v_rows[r], e + 16), t3 += pr * RE.ld8(v_rows[r], e + 24);
            }
            v8_store_f32(o + e, t0), v8_store_f32(o + e + 8, t1);
            v8_store_f32(o + e + 16, t2), v8_store_f32(o + e + 24, t3);
        }
        for (; e < d8; e += 8) {
            v8f t = v8_load_f32(o + e) * corr;
            for (int64_t r = 0; r < cnt; r++) t += s[r] * RE.ld8(v_rows[r], e);
            v8_store_f32(o + e, t);
        }
        for (int64_t e = d8; e < d; e++) {
            float t = o[e] * corr;
            for (int64_t r = 0; r < cnt; r++) t += s[r] * RE.ld1(v_rows[r], e);
            o[e] = t;
        }
    }
}

/* One pass: query vectors v0 .. v0 + nv - 1 of sequence b on KV head h (vector v is row v / group, head
 * h * group + v % group). */
INLINE void attend_pass(elem_t Q, elem_t KV, const args_t *a, int64_t b, int64_t h, int64_t v0, int64_t nv) {
    float qbuf[VMAX][DMAX], acc[VMAX][DMAX], scores[VMAX][KCHUNK], m[VMAX], l[VMAX];
    float kw[KCHUNK][DMAX], vw[KCHUNK][DMAX]; /* a half-precision chunk widened to float32 */
    const elem_t F32 = {ld8_f32, ld1_f32, st8_f32, st1_f32, 4};
    int64_t lo[VMAX], lim[VMAX]; /* keys visible to vector v: lo[v] .. lim[v] - 1 */
    const char *k_rows[KCHUNK], *v_rows[KCHUNK];
    const int64_t d = a->d, d8 = d & ~(int64_t)7, group = a->hq / a->hkv, bs = a->bs;
    const int64_t n = a->query_start[b + 1] - a->query_start[b], len = a->seq_lens[b];
    const int32_t *table = a->tables + b * a->table_stride;
    int64_t kmax = 0, kmin = len;
    for (int64_t v = 0; v < nv; v++) {
        int64_t row = (v0 + v) / group, head = h * group + (v0 + v) % group;
        const char *qp = a->q + ((a->query_start[b] + row) * a->q_row + head * a->q_head) * Q.size;
        for (int64_t e = 0; e < d; e++) qbuf[v][e] = Q.ld1(qp, e) * a->scale, acc[v][e] = 0.0f;
        lim[v] = len - n + row + 1;
        lo[v] = a->window > 0 && lim[v] > a->window ? lim[v] - a->window : 0;
        kmax = lim[v] > kmax ? lim[v] : kmax;
        kmin = lo[v] < kmin ? lo[v] : kmin;
        m[v] = -INFINITY, l[v] = 0.0f;
    }
    const int64_t row_bytes = a->hkv * d * KV.size, head_off = h * d * KV.size;
    for (int64_t k0 = kmin; k0 < kmax;) {
        int64_t off = k0 % bs, cnt = bs - off;
        cnt = cnt < KCHUNK ? cnt : KCHUNK;
        cnt = cnt < kmax - k0 ? cnt : kmax - k0;
        int64_t first = ((int64_t)table[k0 / bs] * bs + off) * row_bytes + head_off;
        for (int64_t j = 0; j < cnt; j++) k_rows[j] = a->k + first + j * row_bytes, v_rows[j] = a->v + first + j * row_bytes;
        if (off + cnt == bs && k0 + cnt < kmax) { /* the next block's rows of this head, into L1 */
            int64_t next = (int64_t)table[(k0 + cnt) / bs] * bs * row_bytes + head_off;
            int64_t rows = bs < kmax - k0 - cnt ? bs : kmax - k0 - cnt;
            for (int64_t j = 0; j < rows; j++)
                for (int64_t c = 0; c < d * KV.size; c += 64) {
                    __builtin_prefetch(a->k + next + j * row_bytes + c);
                    __builtin_prefetch(a->v + next + j * row_bytes + c);
                }
        }
        if (KV.size == sizeof(float)) {
            chunk_update(KV, k_rows, v_rows, cnt, k0, (const float(*)[DMAX])qbuf, nv, d, lo, lim, a->softcap, m, l, acc,
                         scores);
        } else { /* half precision: widen the chunk once, not once per query vector */
            const char *kw_rows[KCHUNK], *vw_rows[KCHUNK];
            for (int64_t j = 0; j < cnt; j++) {
                int64_t e = 0;
                for (; e < d8; e += 8) v8_store_f32(kw[j] + e, KV.ld8(k_rows[j], e)), v8_store_f32(vw[j] + e, KV.ld8(v_rows[j], e));
                for (; e < d; e++) kw[j][e] = KV.ld1(k_rows[j], e), vw[j][e] = KV.ld1(v_rows[j], e);
                kw_rows[j] = (const char *)kw[j], vw_rows[j] = (const char *)vw[j];
            }
            chunk_update(F32, kw_rows, vw_rows, cnt, k0, (const float(*)[DMAX])qbuf, nv, d, lo, lim, a->softcap, m, l,
                         acc, scores);
        }
        k0 += cnt;
    }
    for (int64_t v = 0; v < nv; v++) {
        int64_t row = (v0 + v) / group, head = h * group + (v0 + v) % group;
        char *op = a->out + ((a->query_start[b] + row) * a->o_row + head * a->o_head) * Q.size;
        float inv = 1.0f / l[v];
        int64_t e = 0;
        for (; e < d8; e += 8) Q.st8(op, e, v8_load_f32(acc[v] + e) * inv);
        for (; e < d; e++) Q.st1(op, e, acc[v][e] * inv);
    }
}

/* Prefetch (into L2) the K and V rows of KV head h for keys start .. min(keys, start + PREFETCH_KEYS) - 1
 * of the sequence with block table `table` (start a block boundary): a bound, so a long context does not
 * flush what is being computed. */
static inline void prefetch_rows(const args_t *a, const int32_t *table, int64_t h, int64_t start, int64_t keys,
                                 int64_t kv_size) {
    const int64_t bs = a->bs, row_bytes = a->hkv * a->d * kv_size, head_off = h * a->d * kv_size;
    keys = keys < start + PREFETCH_KEYS ? keys : start + PREFETCH_KEYS;
    for (int64_t k0 = start; k0 < keys; k0 += bs) {
        const int64_t base = (int64_t)table[k0 / bs] * bs * row_bytes + head_off;
        const int64_t rows = bs < keys - k0 ? bs : keys - k0;
        for (int64_t j = 0; j < rows; j++)
            for (int64_t c = 0; c < a->d * kv_size; c += 64) {
                __builtin_prefetch(a->k + base + j * row_bytes + c, 0, 2);
                __builtin_prefetch(a->v + base + j * row_bytes + c, 0, 2);
            }
    }
}

/* Ask for item `it`'s first K and V rows (its sequence, its KV head) to be brought towards this core. */
static inline void prefetch_item(const args_t *a, int64_t it, int64_t kv_size) {
    const int64_t b = a->seqs[it / a->hkv], len = a->seq_lens[b];
    const int64_t first = len - (a->query_start[b + 1] - a->query_start[b]) + 1 - a->window; /* window start */
    const int64_t start = a->window > 0 && first > 0 ? first / a->bs * a->bs : 0;
    prefetch_rows(a, a->tables + b * a->table_stride, it % a->hkv, start, len, kv_size);
}

/* Work item `it` of a call: sequence seqs[it / Hkv], KV head it % Hkv, all its query vectors. */
INLINE void attend_item(elem_t Q, elem_t KV, const args_t *a, int64_t it) {
    const int64_t group = a->hq / a->hkv, b = a->seqs[it / a->hkv], h = it % a->hkv;
    const int64_t nvec = (a->query_start[b + 1] - a->query_start[b]) * group;
    prefetch_item(a, it, KV.size); /* once per item, for all its passes: many misses in flight at once */
    for (int64_t v0 = 0; v0 < nvec; v0 += VMAX) attend_pass(Q, KV, a, b, h, v0, nvec - v0 < VMAX ? nvec - v0 : VMAX);
}

/* The entry point for one (Q, KV) pair of types, and its work-item function (each element access a
 * direct, inlined call). Returns 0, or -1 when D > DMAX, -2 when Hq is not a multiple of Hkv. */
#define DEFINE_ENTRY(QN, KVN)                                                                                 \
    static void CAT4(item, QN, KVN, PA_ISA)(const args_t *a, int64_t it) {                                   \
        const elem_t Q = {ld8_##QN, ld1_##QN, st8_##QN, st1_##QN, sizeof_##QN};                              \
        const elem_t KV = {ld8_##KVN, ld1_##KVN, st8_##KVN, st1_##KVN, sizeof_##KVN};                        \
        attend_item(Q, KV, a, it);                                                                            \
    }                                                                                                         \
    int CAT4(paged_attention, QN, KVN, PA_ISA)(                                                               \
        const void *q, int64_t q_row, int64_t q_head, const void *k_cache, const void *v_cache,              \
        const int32_t *tables, int64_t table_stride, const int32_t *seq_lens, const int32_t *query_start,    \
        const int32_t *seqs, int64_t num_seqs, void *out, int64_t o_row, int64_t o_head, int64_t hq,         \
        int64_t hkv, int64_t d, int64_t block_size, float scale, int64_t window, float softcap,              \
        int num_threads) {                                                                                    \
        if (d < 1 || d > DMAX) return -1;                                                                     \
        if (hkv < 1 || hq % hkv != 0) return -2;                                                              \
        const args_t a = {q, k_cache, v_cache, out, q_row, q_head, o_row, o_head, tables, seq_lens,          \
                          query_start, seqs, table_stride, hq, hkv, d, block_size, scale, window, softcap};   \
        const int64_t items = num_seqs * hkv;                                                                 \
        if (num_threads < 1 || items < 2) num_threads = 1;                                                    \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)")        \
        for (int64_t it = 0; it < items; it++) {                                                              \
            /* the item this thread most likely takes next: its rows arrive while this one computes */        \
            if (it + num_threads < items) prefetch_item(&a, it + num_threads, sizeof_##KVN);                  \
            CAT4(item, QN, KVN, PA_ISA)(&a, it);                                                              \
        }                                                                                                     \
        return 0;                                                                                             \
    }

#define sizeof_f32 4
#define sizeof_bf16 2
#define sizeof_f16 2
DEFINE_ENTRY(f32, f32)
DEFINE_ENTRY(f32, bf16)
DEFINE_ENTRY(bf16, f32)
DEFINE_ENTRY(bf16, bf16)
#ifdef VEC8_HAS_F16
DEFINE_ENTRY(f32, f16)
DEFINE_ENTRY(bf16, f16)
DEFINE_ENTRY(f16, f32)
DEFINE_ENTRY(f16, bf16)
DEFINE_ENTRY(f16, f16)
#endif

/* The generic build answers for all: 1 when float16 types exist, and which ISA levels the CPU runs. */
#if PA_ISA_LEVEL == 0
#ifdef VEC8_HAS_F16
int paged_attention_has_f16(void) { return 1; }
#else
int paged_attention_has_f16(void) { return 0; }
#endif

int paged_attention_isa_supported(int level) { return loraplex_isa_supported(level, 0); }
#endif
