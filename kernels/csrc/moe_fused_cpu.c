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

/* float32 values as the type stores them: unchanged, or rounded to bfloat16 */
static inline float r_float(float f) { return f; }
static inline float r_bf16(float f) {
    uint16_t h;
    v1_store_bf16(&h, f);
    return v1_load_bf16(&h);
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

#define DEFINE_FUSED(T, SCALAR, PUT, ROUND)                                                                  \
    int FUSED_ENTRY(T)(const T *x, int64_t ldx, int64_t ntok, int64_t H, const T *router, int64_t E,        \
                       const int64_t *expert_map, const T *gate_up, const T *down, int64_t EL, int64_t I,   \
                       int64_t k, int norm, T *out, int64_t ldo, int64_t *ids_out, float *w_out,            \
                       int nthreads) {                                                                       \
        int64_t P = ntok * k, hb = (H + COL_BLOCK - 1) / COL_BLOCK;                                          \
        int64_t gb = (2 * I + COL_BLOCK - 1) / COL_BLOCK, eb = (E + COL_BLOCK - 1) / COL_BLOCK;              \
        T *logits = malloc(sizeof(T) * (size_t)(ntok * E + P * (H + 3 * I + H)));                           \
        float *fl = malloc(sizeof(float) * (size_t)(ntok * E + 2 * P));                                      \
        int64_t *ip = malloc(sizeof(int64_t) * (size_t)(3 * P + 3 * EL + 1));                                \
        if (!logits || !fl || !ip) {                                                                         \
            free(logits), free(fl), free(ip);                                                                \
            return -1;                                                                                       \
        }                                                                                                    \
        T *xs = logits + ntok * E, *gu = xs + P * H, *h = gu + P * 2 * I, *ys = h + P * I;                   \
        float *flog = fl, *wt = fl + ntok * E, *wsort = wt + P;                                              \
        int64_t *ids = ip, *pos = ids + P, *tok = pos + P, *start = tok + P, *active = start + EL + 1;       \
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
                    tok[pos[p]] = p / k, wsort[pos[p]] = wt[p];                                              \
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
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++) {                         \
                for (int64_t i = 0; i < I; i++) {                                                            \
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
                for (int64_t c = 0; c < H; c++) {                                                            \
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
        free(logits), free(fl), free(ip);                                                                    \
        return 0;                                                                                            \
    }

DEFINE_FUSED(float, s_f32, put_f32, r_float)
DEFINE_FUSED(bf16, v1_load_bf16, v1_store_bf16, r_bf16)

#if MOE_ISA_LEVEL == 0
int moe_fused_isa_supported(int level) { return loraplex_isa_supported(level, 1); }
#endif
