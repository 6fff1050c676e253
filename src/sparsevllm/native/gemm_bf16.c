/* bfloat16 linears for the CPU's few-row GEMMs (a decode step's), with AVX512-BF16's
 * dot-product instruction (layers/cpu_gemm.py; built and loaded by native/build.py).
 *
 * A decode step reads every weight once for a handful of rows: the GEMMs are bound by
 * memory at one row and close to the FMA units at sixteen. oneDNN's packed bfloat16
 * path read the default model's weights at 13-17 GB/s on a 2-core AMD EPYC (Zen 4)
 * that sums memory at 27 GB/s; this kernel streams them once in the order it uses them.
 *
 * Layout: the weight [n, k] (row-major, as torch keeps a linear's) is packed into
 * blocks of BLOCK_N = 32 output rows: block b holds, for each pair of input columns
 * p = 0 .. k/2 - 1, the 32 rows' two elements (2p, 2p + 1) side by side: 64 bf16 (128
 * bytes, two 512-bit vectors), which one VDPBF16PS per vector multiplies with the
 * broadcast pair (x[2p], x[2p + 1]) of one input row and adds into 16 float32 sums.
 * Rows past n (the last block's padding) are zeros; k must be even.
 *
 * Blocks are split over the OpenMP threads. Each block computes up to TILE_M = 12 input
 * rows at once, TILE_M_MANY = 10 in larger products (24 accumulators and the two weight
 * vectors in 32 registers: every weight vector loaded feeds 12 dot products); more rows
 * go tile by tile over the same block, which is in the cache by then. At 16 rows, tiles
 * of 12 and 4 took 11.4 ms for a decode step's layer GEMMs where tiles of 8 took 14.3
 * (the same Zen 4). The sums are float32; the bias (float32 or bfloat16) is added in
 * float32 and the outputs are rounded to nearest even (bfloat16) or stored as float32.
 * Products of two bfloat16 values are exact in float32; the instruction's additions
 * round to nearest even with denormals flushed, as oneDNN's bfloat16 GEMMs on the same
 * instruction do.
 */
#include <stdint.h>
#include <string.h>

#include "elements.h"

#define BLOCK_N 32
#define TILE_M 12
/* Rows per tile of larger products (a prefill chunk's), where the weights come from the
 * cache: 10 rows kept the instruction unit busier than 12 (the default model's linears
 * over 512 rows: 169 against 181 ms; at 16 rows from memory 12 stays ahead, 6.3 against
 * 6.6 ms, same Zen 4). */
#define TILE_M_MANY 10
/* Products of up to this many rows take TILE_M. */
#define FEW_ROWS 16
/* Pairs of input columns ahead whose weights are prefetched, into the level-2 cache: a
 * decode step streams the weights from memory, where 16 pairs ahead into the first level
 * (2 KB) left loads waiting. The default model's linears alone, from memory, at 16 rows:
 * 6.2 against 8.4 ms; its whole decode steps, the two builds alternating in one engine:
 * 31.1-31.5 against 31.6-32.4 ms at batch 16, 16.1 against 16.3 at batch 1 (Zen 4). */
#define PREFETCH_PAIRS 64

/* Whether this build has the kernel (compiled for a processor with AVX512-BF16). */
int svllm_gemm_bf16_supported(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}

/* Elements of the packed form of an [n, k] weight. */
int64_t svllm_gemm_bf16_packed_size(int64_t n, int64_t k) {
    return (n + BLOCK_N - 1) / BLOCK_N * BLOCK_N * k;
}

/* w [n, k] (row stride `w_stride` elements) -> packed (svllm_gemm_bf16_packed_size). */
void svllm_gemm_bf16_pack(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                          uint16_t *packed) {
    const int64_t blocks = (n + BLOCK_N - 1) / BLOCK_N, pairs = k / 2;
    for (int64_t b = 0; b < blocks; b++) {
        uint16_t *dst = packed + b * BLOCK_N * k;
        for (int64_t p = 0; p < pairs; p++) {
            for (int r = 0; r < BLOCK_N; r++) {
                const int64_t row = b * BLOCK_N + r;
                uint16_t *pair = dst + (p * BLOCK_N + r) * 2;
                pair[0] = row < n ? w[row * w_stride + 2 * p] : 0;
                pair[1] = row < n ? w[row * w_stride + 2 * p + 1] : 0;
            }
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

typedef struct {
    const uint16_t *x; /* [m, k], row stride x_stride */
    int64_t x_stride, m, n, k;
    const uint16_t *packed;
    const void *bias; /* [n] or NULL */
    int bias_dtype;
    void *out; /* [m, n], row stride out_stride */
    int64_t out_stride;
    int out_dtype;
} Gemm;

/* The 32 sums of `rows` (<= TILE_M) input rows from `x` against block `block`, plus the
 * bias, stored to the outputs' columns [col, col + valid). */
static inline __attribute__((always_inline)) void block_tile(const Gemm *g, const uint16_t *x,
                                                             void *out, int64_t block,
                                                             const int rows) {
    const int64_t pairs = g->k / 2, col = block * BLOCK_N;
    const uint16_t *w = g->packed + block * BLOCK_N * g->k;
    __m512 acc[TILE_M][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        _mm_prefetch((const char *)(w + (p + PREFETCH_PAIRS) * 2 * BLOCK_N), _MM_HINT_T1);
        _mm_prefetch((const char *)(w + (p + PREFETCH_PAIRS) * 2 * BLOCK_N) + 64, _MM_HINT_T1);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * BLOCK_N);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 2 * BLOCK_N + BLOCK_N);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * g->x_stride + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
        }
    }
    const int64_t valid = g->n - col < BLOCK_N ? g->n - col : BLOCK_N;
    for (int half = 0; half < 2; half++) {
        const int64_t first = col + 16 * half;
        const int64_t count = valid - 16 * half;
        if (count <= 0) break;
        const __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
        __m512 bias = _mm512_setzero_ps();
        if (g->bias != NULL && g->bias_dtype == F32)
            bias = _mm512_maskz_loadu_ps(mask, (const float *)g->bias + first);
        else if (g->bias != NULL)
            bias = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(mask, (const uint16_t *)g->bias + first)),
                16));
        for (int r = 0; r < rows; r++) {
            const __m512 y = _mm512_add_ps(acc[r][half], bias);
            if (g->out_dtype == F32)
                _mm512_mask_storeu_ps((float *)out + r * g->out_stride + first, mask, y);
            else
                _mm256_mask_storeu_epi16((uint16_t *)out + r * g->out_stride + first, mask,
                                         (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}

/* Every input row against block `block`, `tile` rows at a time (row counts as
 * constants, so that the accumulators stay in registers). */
static void block_rows(const Gemm *g, int64_t block) {
    const int64_t out_elem = g->out_dtype == F32 ? 4 : 2;
    const int tile = g->m > FEW_ROWS ? TILE_M_MANY : TILE_M;
    for (int64_t r0 = 0; r0 < g->m; r0 += tile) {
        const uint16_t *x = g->x + r0 * g->x_stride;
        void *out = (char *)g->out + r0 * g->out_stride * out_elem;
        switch (g->m - r0 < tile ? g->m - r0 : tile) {
            case 1: block_tile(g, x, out, block, 1); break;
            case 2: block_tile(g, x, out, block, 2); break;
            case 3: block_tile(g, x, out, block, 3); break;
            case 4: block_tile(g, x, out, block, 4); break;
            case 5: block_tile(g, x, out, block, 5); break;
            case 6: block_tile(g, x, out, block, 6); break;
            case 7: block_tile(g, x, out, block, 7); break;
            case 8: block_tile(g, x, out, block, 8); break;
            case 9: block_tile(g, x, out, block, 9); break;
            case 10: block_tile(g, x, out, block, 10); break;
            case 11: block_tile(g, x, out, block, 11); break;
            default: block_tile(g, x, out, block, 12); break;
        }
    }
}
#endif

/* out [m, n] = x [m, k] @ w.T (+ bias), w packed by svllm_gemm_bf16_pack. Returns 0, or
 * -1 where this build has no kernel. */
int svllm_gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    int64_t n, int64_t k, const void *bias, int bias_dtype, void *out,
                    int64_t out_stride, int out_dtype, int num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const Gemm g = {x, x_stride, m, n, k, packed, bias, bias_dtype, out, out_stride, out_dtype};
    const int64_t blocks = (n + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && blocks > 1)
    for (int64_t b = 0; b < blocks; b++) block_rows(&g, b);
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias;
    (void)bias_dtype, (void)out, (void)out_stride, (void)out_dtype, (void)num_threads;
    return -1;
#endif
}
