/* Causal prefill attention over bfloat16 Q, K and V for the CPU backend (attention/cpu/
 * prefill.py; built and loaded by native/build.py), with AVX512-BF16's dot products.
 *
 * One chunk of one sequence: queries q [n, Hq, D] are the last n entries of a view of L
 * keys k, v [L, Hkv, D] (contiguous rows), so query i sees keys 0 .. L - n + i. GQA:
 * query head hq reads KV head hq / (Hq / Hkv).
 *
 * A work item is (KV head, block of QUERY_BLOCK queries): its rows are the block's
 * queries times the KV head's query heads. Keys go KEY_BLOCK = 16 at a time, as a flash
 * kernel walks them: the block's keys are repacked as pairs of head dims side by side
 * for 16 keys (one 512-bit vector per pair), so that one VDPBF16PS adds a pair of
 * products for 16 keys of one row, over the raw bfloat16 query (the products are exact
 * in float32; the scale comes after the sums). The block's values are widened to
 * float32 once and added with float32 multiply-adds, weighted by the float32
 * probabilities (torch's CPU flash kernel rounds them to bfloat16 first). The softmax is
 * online (a running maximum and sum per row, in exp2 of scaled logits), exact in float32
 * up to the polynomial 2^x (relative error ~2e-7).
 *
 * torch's SDPA took ~1.2 ms per 256-token prompt and layer of the default model on a
 * 2-core AMD EPYC (Zen 4), a sixth of a 16-prompt prefill.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elements.h"

/* Whether this build has the kernel (compiled for a processor with AVX512-BF16). */
int svllm_prefill_attention_supported(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define KEY_BLOCK 16
#define QUERY_BLOCK 32
#define MAX_DIM 256

typedef struct {
    const uint16_t *q, *k, *v;
    int64_t q_tok, q_head; /* q strides in elements (rows contiguous) */
    int64_t kv_tok;        /* k and v token strides (heads contiguous rows of D) */
    uint16_t *out;         /* [n, Hq, D] contiguous */
    int n, length, num_q_heads, num_kv_heads, dim;
    float scale; /* softmax scale times log2(e) */
} Chunk;

/* 2^x, x <= 0 (clamped at -125): 2^round(x) times a degree-6 polynomial of the
 * remainder (Cephes' exp2f coefficients), 16 lanes. */
static inline __m512 exp2_lanes(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, whole);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, whole);
}

/* Keys [j0, j0 + count) of KV head h: keys as [D/2 pairs][16 keys][2] (zero past count),
 * values widened to float32 [16][D]. */
static void pack_block(const Chunk *c, int h, int j0, int count, uint32_t *keys, float *values) {
    const int pairs = c->dim / 2;
    for (int t = 0; t < KEY_BLOCK; t++) {
        if (t < count) {
            const uint32_t *row = (const uint32_t *)(c->k + (int64_t)(j0 + t) * c->kv_tok +
                                                     (int64_t)h * c->dim);
            const uint16_t *vrow = c->v + (int64_t)(j0 + t) * c->kv_tok + (int64_t)h * c->dim;
            for (int p = 0; p < pairs; p++) keys[p * KEY_BLOCK + t] = row[p];
            for (int d = 0; d < c->dim; d += 16) /* exact: bfloat16 is float32's top half */
                _mm512_storeu_ps(values + t * c->dim + d,
                                 _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrow + d))),
                                     16)));
        } else {
            for (int p = 0; p < pairs; p++) keys[p * KEY_BLOCK + t] = 0;
            memset(values + t * c->dim, 0, sizeof(float) * (size_t)c->dim);
        }
    }
}

/* One row's step over a key block: logits s (16 lanes, masked past `visible` keys),
 * the running max m and sum l, and the accumulator acc [D] rescaled and added to. */
static inline void row_update(const Chunk *c, __m512 s, int visible, float *m, float *l,
                              float *acc, const float *values) {
    const __mmask16 live = visible >= KEY_BLOCK ? (__mmask16)0xffff
                                                : (__mmask16)((1u << visible) - 1);
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), live, s);
    const float top = _mm512_reduce_max_ps(s);
    const float m_new = top > *m ? top : *m;
    const float alpha = *m == m_new ? 1.0f : _mm512_cvtss_f32(exp2_lanes(_mm512_set1_ps(*m - m_new)));
    const __m512 p = _mm512_maskz_mov_ps(live, exp2_lanes(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
    *l = *l * alpha + _mm512_reduce_add_ps(p);
    *m = m_new;
    const int count = visible < KEY_BLOCK ? visible : KEY_BLOCK;
    for (int d0 = 0; d0 < c->dim; d0 += 64) {
        const int width = c->dim - d0 < 64 ? c->dim - d0 : 64; /* 32 or 64 */
        __m512 a[4];
        for (int e = 0; e < width / 16; e++)
            a[e] = _mm512_mul_ps(_mm512_loadu_ps(acc + d0 + 16 * e), _mm512_set1_ps(alpha));
        for (int t = 0; t < count; t++) {
            /* lane t of p, from the register (a store and 16 narrow reloads stalled) */
            const __m512 pt = _mm512_permutexvar_ps(_mm512_set1_epi32(t), p);
            const float *vr = values + t * c->dim + d0;
            for (int e = 0; e < width / 16; e++)
                a[e] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vr + 16 * e), a[e]);
        }
        for (int e = 0; e < width / 16; e++) _mm512_storeu_ps(acc + d0 + 16 * e, a[e]);
    }
}

/* Work item: KV head h, queries [i0, i1). `buf`: the packed keys and widened values of a
 * block, then per row its max, sum and accumulator. */
static void attend_item(const Chunk *c, int h, int i0, int i1, float *buf) {
    const int group = c->num_q_heads / c->num_kv_heads, d = c->dim, pairs = d / 2;
    const int rows = (i1 - i0) * group, offset = c->length - c->n;
    uint32_t *keys = (uint32_t *)buf;
    float *values = buf + pairs * KEY_BLOCK;
    float *m = values + KEY_BLOCK * d, *l = m + rows, *acc = l + rows;
    for (int r = 0; r < rows; r++) m[r] = -__builtin_inff(), l[r] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)rows * (size_t)d);
    const int last = offset + i1 - 1; /* the last query's last visible key */
    for (int j0 = 0; j0 <= last; j0 += KEY_BLOCK) {
        const int count = last + 1 - j0 < KEY_BLOCK ? last + 1 - j0 : KEY_BLOCK;
        pack_block(c, h, j0, count, keys, values);
        for (int i = i0; i < i1; i++) {
            const int visible = offset + i + 1 - j0; /* keys of this block query i sees */
            if (visible <= 0) continue;
            for (int g = 0; g < group; g++) {
                const uint32_t *qrow = (const uint32_t *)(c->q + (int64_t)i * c->q_tok +
                                                          (int64_t)(h * group + g) * c->q_head);
                /* four chains of dot products (one would wait on each sum's latency);
                 * D is a multiple of 32, so the pairs are a multiple of 16 */
                __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
                __m512 s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
                for (int p = 0; p < pairs; p += 4) {
                    const uint32_t *kp = keys + p * KEY_BLOCK;
                    s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_loadu_si512(kp),
                                          (__m512bh)_mm512_set1_epi32((int)qrow[p]));
                    s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_loadu_si512(kp + KEY_BLOCK),
                                          (__m512bh)_mm512_set1_epi32((int)qrow[p + 1]));
                    s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_loadu_si512(kp + 2 * KEY_BLOCK),
                                          (__m512bh)_mm512_set1_epi32((int)qrow[p + 2]));
                    s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_loadu_si512(kp + 3 * KEY_BLOCK),
                                          (__m512bh)_mm512_set1_epi32((int)qrow[p + 3]));
                }
                const __m512 s = _mm512_mul_ps(
                    _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)),
                    _mm512_set1_ps(c->scale));
                const int r = (i - i0) * group + g;
                row_update(c, s, visible, m + r, l + r, acc + (int64_t)r * d, values);
            }
        }
    }
    for (int i = i0; i < i1; i++)
        for (int g = 0; g < group; g++) {
            const int r = (i - i0) * group + g;
            const float inv = 1.0f / l[r];
            uint16_t *o = c->out + ((int64_t)i * c->num_q_heads + h * group + g) * d;
            for (int e = 0; e < d; e++) o[e] = f32_to_bf16(acc[(int64_t)r * d + e] * inv);
        }
}
#endif

/* out [n, Hq, D] (contiguous) = causal attention of q [n, Hq, D] (token and head strides
 * in elements) over k, v [L, Hkv, D] (token stride `kv_tok`, heads contiguous), all
 * bfloat16; `scale` includes log2(e). Returns 0; -1 where this build has no kernel or the
 * head dim is not a multiple of 32 (at most 256); 1 when memory ran out. */
int svllm_prefill_attention(const uint16_t *q, int64_t q_tok, int64_t q_head, const uint16_t *k,
                            const uint16_t *v, int64_t kv_tok, uint16_t *out, int n, int length,
                            int num_q_heads, int num_kv_heads, int dim, float scale,
                            int num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (dim % 32 != 0 || dim > MAX_DIM || n > length || num_q_heads % num_kv_heads != 0) return -1;
    const Chunk c = {.q = q, .k = k, .v = v, .q_tok = q_tok, .q_head = q_head, .kv_tok = kv_tok,
                     .out = out, .n = n, .length = length, .num_q_heads = num_q_heads,
                     .num_kv_heads = num_kv_heads, .dim = dim, .scale = scale};
    const int blocks = (n + QUERY_BLOCK - 1) / QUERY_BLOCK, group = num_q_heads / num_kv_heads;
    const int64_t items = (int64_t)blocks * num_kv_heads;
    const size_t per_thread = (size_t)(dim / 2) * KEY_BLOCK + (size_t)KEY_BLOCK * (size_t)dim +
                              (size_t)QUERY_BLOCK * (size_t)group * (size_t)(2 + dim);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
    {
        float *buf = aligned_alloc(64, (per_thread * sizeof(float) + 63) / 64 * 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        /* Later query blocks see more keys: the largest items first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int block = blocks - 1 - (int)(item / num_kv_heads);
            const int h = (int)(item % num_kv_heads);
            const int i0 = block * QUERY_BLOCK;
            const int i1 = i0 + QUERY_BLOCK < n ? i0 + QUERY_BLOCK : n;
            if (buf) attend_item(&c, h, i0, i1, buf);
        }
        free(buf);
    }
    return failed;
#else
    (void)q, (void)q_tok, (void)q_head, (void)k, (void)v, (void)kv_tok, (void)out, (void)n;
    (void)length, (void)num_q_heads, (void)num_kv_heads, (void)dim, (void)scale;
    (void)num_threads;
    return -1;
#endif
}
