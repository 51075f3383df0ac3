/* A decode step's whole routed-experts block on the CPU, in one call: for x [T, H] (T small: decode),
 *
 *     logits = x @ router.T                          [T, E]  (in x's type, as a torch GEMM rounds it)
 *     p      = softmax(logits) in float32; the top-k experts of each token (ties: the lower id first),
 *              their probabilities renormalized to sum 1 where `norm_topk` (Qwen3-MoE, Mixtral, OLMoE /
 *              Qwen2-MoE with norm_topk_prob), each weight then rounded to x's type
 *     local  = expert_map[id] (expert parallel: this rank's index of a global expert, E_local for another
 *              rank's, whose pairs are dropped; no map: the id itself)
 *     pairs sorted by local expert (by token within one: a counting sort), their rows of x gathered
 *     gu     = xs @ gate_up[e].T per expert; h = silu(gu[:, :I]) * gu[:, I:]; ys = h @ down[e].T
 *     out[t] = sum over t's pairs in expert order of weight * ys[pair]
 *
 * (silu and the combine run eight lanes at a time; silu's exponential is vec8.h's, within a few float32
 * ulp of expf, the roundings to bfloat16 the same as the scalar tail's)
 *
 * With `lora` (NULL: none; pages of the call's dtype), each pair also adds its token's adapter's delta
 * for its expert to gu and to ys, as `ExpertLoRAStep.add` does op by op (engine/lora/expert_step.py; in
 * bfloat16 rounded where `add`'s ops round, moe_lora_rows.h):
 *
 *     gu[r] += s_a * (A_{a,e} @ xs[r]) @ B_{a,e}.T      per page of adapter a = token_adapter[t] on gate_up
 *     ys[r] += s_a * (A_{a,e} @ h[r]) @ B_{a,e}.T       likewise on down, after silu * up
 *
 * (moe_lora_rows.h's halves; a token whose adapter index is num_adapters, or whose adapter has no page
 * on a projection, adds nothing there). Pages are one layer's view of the adapter pool
 * (kernels/moe_lora_meta.py `ExpertLoRAWeights`): page p of expert e at `a + p * page_a + e * rank * in`.
 *
 * which is the torch path (engine/model/moe.py `route` + engine/model/moe_experts.py `experts_forward`)
 * step by step, with the same roundings for bfloat16 (each GEMM output, silu, the product with up, the
 * weighted row and each partial sum of the combine rounded to bfloat16, as the torch ops round them), so
 * a decode step's MoE block is one call instead of ~20 torch ops. The GEMMs are moe_gemm_block.h's
 * streaming blocks: each active expert's weights read once for all of its rows. Threads (OpenMP) split
 * each phase's work units (router / expert column blocks, tokens); every output is one thread's, so the
 * result does not depend on the thread count. Returns 0, or -1 when out of memory.
 *
 * Compiled once per ISA level like moe_gemm_cpu.c (kernels/native_build.py);
 * `moe_fused_isa_supported(level)` in the generic build says which the CPU runs.
 */
#include "cpu_isa.h"
#include "moe_gemm_block.h"
#include "moe_lora_rows.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOE_ISA
#define MOE_ISA generic
#define MOE_ISA_LEVEL 0
#endif
#define CAT3_(a, b, c) a##_##b##_##c
#define CAT3(a, b, c) CAT3_(a, b, c)
#define FUSED_ENTRY(t) CAT3(moe_fused, t, MOE_ISA)

/* One projection's expert LoRA for one layer (pages == NULL: no adapter of the step adapts it). */
typedef struct {
    const void *a;        /* A pages: page p, expert e at a + p * page_a + e * rank * in, [rank, in] */
    const void *b;        /* B pages: b + p * page_b + e * out * rank, [out, rank] */
    int64_t page_a, page_b; /* elements between consecutive pages */
    int64_t rank;         /* rows of one page */
    const int32_t *pages; /* [num_adapters, width]: each adapter's page ids, -1 where none */
    int64_t width;
    const float *scale;   /* [num_adapters] */
} moe_lora_proj;

/* A layer's expert LoRA for the step (the fused entries' `lora`). */
typedef struct {
    const int64_t *token_adapter; /* [T]: each token's adapter index, num_adapters for none */
    int64_t num_adapters;
    moe_lora_proj gate_up, down;
} moe_lora_layer;

/* src rows' LoRA deltas on one projection into dst (`rows` sorted pairs: row r of token tok[r] on local
 * expert rexp[r]; src rows of `in` elements, dst rows of `out`), inside the caller's parallel region. Every
 * pair has its own dst row, so the threads split the rows, each streaming its rows' pages whole (v: the
 * row's shrink, width * rank floats a row). One function per type (float, bf16). */
#define DEFINE_LORA_ROWS(T, SHRINK, EXPAND)                                                                  \
    static void T##_lora_rows(const moe_lora_layer *L, const moe_lora_proj *P, const T *src, int64_t in,     \
                              T *dst, int64_t out, int64_t rows, const int64_t *tok, const int64_t *rexp,    \
                              float *v) {                                                                    \
        int64_t vw = P->width * P->rank;                                                                     \
        const T *pa = P->a, *pb = P->b;                                                                      \
        _Pragma("omp for schedule(dynamic, 2)") for (int64_t r = 0; r < rows; r++) {                         \
            int64_t j = L->token_adapter[tok[r]];                                                            \
            if (j >= L->num_adapters) continue;                                                              \
            for (int64_t w = 0; w < P->width; w++) {                                                         \
                int64_t page = P->pages[j * P->width + w];                                                   \
                if (page < 0) continue; /* -1: no page here (as the reference and Triton read it) */        \
                float *vr = v + r * vw + w * P->rank;                                                        \
                const T *a = pa + page * P->page_a + rexp[r] * P->rank * in;                                 \
                const T *b = pb + page * P->page_b + rexp[r] * out * P->rank;                                \
                SHRINK;                                                                                      \
                EXPAND;                                                                                      \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_LORA_ROWS(float, lora_shrink(a, P->rank, in, src + r * in, P->scale[j], vr),
                 lora_expand(b, P->rank, 0, out, vr, dst + r * out))
DEFINE_LORA_ROWS(bf16, lora_shrink_bf16(a, P->rank, in, src + r * in, vr),
                 lora_expand_bf16(b, P->rank, 0, out, vr, P->scale[j], dst + r * out))

/* float32 values as the type stores them: unchanged, or rounded to bfloat16 */
static inline float r_float(float f) { return f; }
static inline float r_bf16(float f) {
    uint16_t h;
    v1_store_bf16(&h, f);
    return v1_load_bf16(&h);
}
static inline v8f v8_r_float(v8f v) { return v; }
static inline v8f v8_r_bf16(v8f v) {
    uint16_t h[8];
    v8_store_bf16(h, v);
    return v8_load_bf16(h);
}

/* silu(g) = g * sigmoid(g) in every lane, sigmoid from exp(-|g|) (so the exponent is never positive). */
static inline v8f v8_silu(v8f g) {
    v8i neg = g < 0.f;
    v8f e = v8_exp_nonpos((v8f)((v8i)g | (v8i)(v8f){-0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f}));
    v8f num = (v8f)(((v8i)e & neg) | ((v8i)(e * 0.f + 1.f) & ~neg)); /* e where g < 0, else 1 */
    return g * (num / (1.f + e));
}

/* Softmax over `e` float32 logits, the k largest (lower index first on ties) into ids / w, renormalized
 * where `norm`. */
static void route_token(const float *logit, int64_t e, int64_t k, int norm, int64_t *ids, float *w) {
    float mx = logit[0], sum = 0.f;
    for (int64_t i = 1; i < e; i++) mx = logit[i] > mx ? logit[i] : mx;
    for (int64_t i = 0; i < e; i++) sum += expf(logit[i] - mx);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++) {
            int taken = 0;
            for (int64_t q = 0; q < j; q++) taken |= ids[q] == i;
            if (!taken && (best < 0 || logit[i] > logit[best])) best = i;
        }
        ids[j] = best;
        w[j] = expf(logit[best] - mx) / sum;
    }
    if (norm) {
        float s = 0.f;
        for (int64_t j = 0; j < k; j++) s += w[j];
        for (int64_t j = 0; j < k; j++) w[j] /= s;
    }
}

#define DEFINE_FUSED(T, SCALAR, PUT, ROUND, LOADV, STOREV, ROUNDV)                                          \
    int FUSED_ENTRY(T)(const T *x, int64_t ldx, int64_t ntok, int64_t H, const T *router, int64_t E,        \
                       const int64_t *expert_map, const T *gate_up, const T *down, int64_t EL, int64_t I,   \
                       int64_t k, int norm, T *out, int64_t ldo, int64_t *ids_out, float *w_out,            \
                       const moe_lora_layer *lora, int nthreads) {                                           \
        int64_t P = ntok * k, hb = (H + COL_BLOCK - 1) / COL_BLOCK;                                          \
        int64_t gb = (2 * I + COL_BLOCK - 1) / COL_BLOCK, eb = (E + COL_BLOCK - 1) / COL_BLOCK;              \
        T *logits = malloc(sizeof(T) * (size_t)(ntok * E + P * (H + 3 * I + H)));                           \
        float *fl = malloc(sizeof(float) * (size_t)(ntok * E + 2 * P));                                      \
        int64_t *ip = malloc(sizeof(int64_t) * (size_t)(4 * P + 3 * EL + 1));                                \
        int64_t vw = !lora ? 0 : lora->gate_up.width * lora->gate_up.rank;                                   \
        if (lora && lora->down.width * lora->down.rank > vw) vw = lora->down.width * lora->down.rank;        \
        float *lv = malloc(sizeof(float) * (size_t)(P * vw > 0 ? P * vw : 1));                               \
        if (!logits || !fl || !ip || !lv) {                                                                  \
            free(logits), free(fl), free(ip), free(lv);                                                      \
            return -1;                                                                                       \
        }                                                                                                    \
        T *xs = logits + ntok * E, *gu = xs + P * H, *h = gu + P * 2 * I, *ys = h + P * I;                   \
        float *flog = fl, *wt = fl + ntok * E, *wsort = wt + P;                                              \
        int64_t *ids = ip, *pos = ids + P, *tok = pos + P, *rexp = tok + P, *start = rexp + P;              \
        int64_t *active = start + EL + 1;                                                                    \
        int64_t nact = 0;                                                                                    \
        (void)nthreads;                                                                                      \
        _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1)") {                                     \
            _Pragma("omp for schedule(static)") for (int64_t c = 0; c < eb; c++) {                           \
                int64_t o0 = c * COL_BLOCK, o1 = o0 + COL_BLOCK < E ? o0 + COL_BLOCK : E;                    \
                T##_unit(x, ldx, router, H, o0, o1, logits, E, ntok);                                        \
            }                                                                                                \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < ntok; t++) {                         \
                for (int64_t i = 0; i < E; i++) flog[t * E + i] = SCALAR(logits + t * E + i);                \
                route_token(flog + t * E, E, k, norm, ids + t * k, wt + t * k);                              \
                for (int64_t j = 0; j < k; j++) wt[t * k + j] = ROUND(wt[t * k + j]);                        \
            }                                                                                                \
            _Pragma("omp single") {                                                                          \
                memset(start, 0, sizeof(int64_t) * (size_t)(EL + 1));                                        \
                for (int64_t p = 0; p < P; p++) {                                                            \
                    int64_t e = expert_map ? expert_map[ids[p]] : ids[p];                                    \
                    pos[p] = e; /* the local expert for now; its sorted position below */                    \
                    if (e < EL) start[e + 1]++;                                                              \
                }                                                                                            \
                for (int64_t e = 0; e < EL; e++) {                                                           \
                    if (start[e + 1]) active[nact++] = e;                                                    \
                    start[e + 1] += start[e];                                                                \
                }                                                                                            \
                int64_t *fill = active + EL; /* each expert's next sorted row */                             \
                memcpy(fill, start, sizeof(int64_t) * (size_t)EL);                                           \
                for (int64_t p = 0; p < P; p++) { /* pairs in token order: stable by expert */               \
                    int64_t e = pos[p];                                                                      \
                    if (e >= EL) {                                                                           \
                        pos[p] = -1;                                                                         \
                        continue;                                                                            \
                    }                                                                                        \
                    pos[p] = fill[e]++;                                                                      \
                    tok[pos[p]] = p / k, rexp[pos[p]] = e, wsort[pos[p]] = wt[p];                            \
                }                                                                                            \
            }                                                                                                \
            int64_t rows = start[EL];                                                                        \
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++)                           \
                memcpy(xs + r * H, x + tok[r] * ldx, sizeof(T) * (size_t)H);                                 \
            _Pragma("omp for schedule(static)") for (int64_t u = 0; u < nact * gb; u++) {                    \
                int64_t e = active[u / gb], o0 = (u % gb) * COL_BLOCK;                                       \
                int64_t o1 = o0 + COL_BLOCK < 2 * I ? o0 + COL_BLOCK : 2 * I;                                \
                T##_unit(xs + start[e] * H, H, gate_up + e * 2 * I * H, H, o0, o1, gu + start[e] * 2 * I,    \
                         2 * I, start[e + 1] - start[e]);                                                    \
            }                                                                                                \
            if (lora && lora->gate_up.pages)                                                                 \
                T##_lora_rows(lora, &lora->gate_up, xs, H, gu, 2 * I, rows, tok, rexp, lv);                  \
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++) {                         \
                int64_t i = 0;                                                                               \
                for (; i + 8 <= I; i += 8) {                                                                 \
                    v8f g = LOADV(gu + r * 2 * I + i), up = LOADV(gu + r * 2 * I + I + i);                   \
                    STOREV(h + r * I + i, ROUNDV(v8_silu(g)) * up);                                          \
                }                                                                                            \
                for (; i < I; i++) {                                                                         \
                    float g = SCALAR(gu + r * 2 * I + i), up = SCALAR(gu + r * 2 * I + I + i);               \
                    PUT(h + r * I + i, ROUND(g / (1.f + expf(-g))) * up);                                    \
                }                                                                                            \
            }                                                                                                \
            _Pragma("omp for schedule(static)") for (int64_t u = 0; u < nact * hb; u++) {                    \
                int64_t e = active[u / hb], o0 = (u % hb) * COL_BLOCK;                                       \
                int64_t o1 = o0 + COL_BLOCK < H ? o0 + COL_BLOCK : H;                                        \
                T##_unit(h + start[e] * I, I, down + e * H * I, I, o0, o1, ys + start[e] * H, H,             \
                         start[e + 1] - start[e]);                                                           \
            }                                                                                                \
            if (lora && lora->down.pages)                                                                    \
                T##_lora_rows(lora, &lora->down, h, I, ys, H, rows, tok, rexp, lv);                          \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < ntok; t++) {                         \
                int64_t order[k > 0 ? k : 1], n = 0; /* t's pairs' sorted rows, ascending = expert order */  \
                for (int64_t j = 0; j < k; j++) {                                                            \
                    int64_t r = pos[t * k + j], m = n++;                                                     \
                    if (r < 0) {                                                                             \
                        n--;                                                                                 \
                        continue;                                                                            \
                    }                                                                                        \
                    for (; m > 0 && order[m - 1] > r; m--) order[m] = order[m - 1];                          \
                    order[m] = r;                                                                            \
                }                                                                                            \
                int64_t c = 0;                                                                               \
                for (; c + 8 <= H; c += 8) {                                                                 \
                    v8f acc = {0};                                                                           \
                    for (int64_t q = 0; q < n; q++)                                                          \
                        acc = ROUNDV(acc + ROUNDV(LOADV(ys + order[q] * H + c) * wsort[order[q]]));          \
                    STOREV(out + t * ldo + c, acc);                                                          \
                }                                                                                            \
                for (; c < H; c++) {                                                                         \
                    float acc = 0.f;                                                                         \
                    for (int64_t q = 0; q < n; q++)                                                          \
                        acc = ROUND(acc + ROUND(SCALAR(ys + order[q] * H + c) * wsort[order[q]]));           \
                    PUT(out + t * ldo + c, acc);                                                             \
                }                                                                                            \
                for (int64_t j = 0; j < k; j++) {                                                            \
                    if (ids_out) ids_out[t * k + j] = ids[t * k + j];                                        \
                    if (w_out) w_out[t * k + j] = wt[t * k + j];                                             \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        free(logits), free(fl), free(ip), free(lv);                                                          \
        return 0;                                                                                            \
    }

DEFINE_FUSED(float, s_f32, put_f32, r_float, v8_load_f32, v8_store_f32, v8_r_float)
DEFINE_FUSED(bf16, v1_load_bf16, v1_store_bf16, r_bf16, v8_load_bf16, v8_store_bf16, v8_r_bf16)

#if MOE_ISA_LEVEL == 0
int moe_fused_isa_supported(int level) { return loraplex_isa_supported(level, 1); }
#endif
