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
#include "vec8.h"
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

/* 8-lane loads and stores of float32, bfloat16 and float16 and the horizontal sums: vec8.h. Here only
 * the scalar float32 and float16 ones it leaves out. */
static inline float scalar_f32(const float *p) { return *p; }
static inline void put_f32(float *p, float f) { *p = f; }
#ifdef VEC8_HAS_F16
static inline float scalar_f16(const _Float16 *p) { return (float)*p; }
static inline void put_f16(_Float16 *p, float f) { *p = (_Float16)f; }
#endif

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
#define W_F32 float, v8_load_f32, scalar_f32
#define W_BF16 uint16_t, v8_load_bf16, v1_load_bf16
#define X_F32 float, v8_load_f32, scalar_f32, v8_store_f32, put_f32
#define X_BF16 uint16_t, v8_load_bf16, v1_load_bf16, v8_store_bf16, v1_store_bf16
BGMV(f32_f32, ENTRY(f32_f32), W_F32, X_F32, f32_f32_shrink, f32_f32_shrink2)
BGMV(f32_bf16, ENTRY(f32_bf16), W_BF16, X_F32, f32_bf16_shrink, f32_bf16_shrink2)
BGMV(bf16_f32, ENTRY(bf16_f32), W_F32, X_BF16, bf16_f32_shrink, bf16_f32_shrink2)
BGMV(bf16_bf16, ENTRY(bf16_bf16), W_BF16, X_BF16, BF16_SHRINK, BF16_SHRINK2)
#ifdef __FLT16_MAX__
#define W_F16 _Float16, v8_load_f16, scalar_f16
#define X_F16 _Float16, v8_load_f16, scalar_f16, v8_store_f16, put_f16
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
