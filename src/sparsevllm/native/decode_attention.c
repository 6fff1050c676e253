/* Decode attention over a token-slot KV pool, read in place, for the CPU backend
 * (attention/cpu_backend.py via attention/cpu/decode.py; built and loaded by native/build.py).
 *
 * Every sequence s has one query per query head and a view: the slot ids
 * table[rows[s], 0 .. lens[s] - 1], its own new token last. A sliding-window layer
 * reads only the view's last `window` entries. A work item is (sequence, split of its
 * view). It reads each slot's whole row (every KV head: one contiguous run of memory),
 * converted to float32 in a small buffer, prefetching the rows a few keys ahead: the
 * slots of a view are scattered over the pool, and without the prefetches the loads
 * wait on memory one row at a time. It keeps its part's logits to take the softmax
 * exactly (max, then exp2 of the differences). With more than one split per view, the
 * parts' (max, sum, output) go to a workspace and are merged as in flash decoding.
 *
 * Queries and outputs are in the compute dtype (float32, bfloat16 or float16); the
 * queries are taken to float32 times the softmax scale times log2(e) first, so the
 * softmax is exp2 of logit differences, and the outputs are rounded to nearest even at
 * the end, as torch rounds. All arithmetic is float32. The compiler flags allow
 * reassociation (vectorized dot products and sums) but not finite-math assumptions.
 *
 * Where the queries and the pool are both bfloat16 and the processor has AVX512-BF16,
 * the logits come from its dot-product instruction over the raw bfloat16 values (exact
 * products, float32 sums; the scale after), 16 keys at a time, and the values are
 * widened to float32 a block of 16 rows at a time: a 16-sequence step of the default
 * model (~300 keys each) took 165 instead of 220 us a layer with its KV in the cache,
 * 255 instead of 285 us from memory, and whole decode steps 32.9 instead of 33.7 ms
 * (the two builds alternating in one engine; 2-core AMD EPYC, Zen 4). An earlier version
 * that prefetched into the first-level cache was no faster than the generic path from
 * memory.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elements.h"
#include "exp2.h"

/* Keys ahead whose rows are prefetched. */
#define PREFETCH_AHEAD 8
/* Value rows added to the accumulators per pass (part_values spells out four). */
#define VALUE_BLOCK 4

typedef struct {
    const float *q; /* [S, Hq, D] */
    /* The queries as given where they and the pool are bfloat16 (the dot-product path
     * below reads them as they are), else NULL; strides in elements. */
    const uint16_t *q_bf16;
    int64_t q_stride_s, q_stride_h;
    const void *k, *v;
    int64_t k_slot, v_slot; /* slot strides in elements; heads are contiguous rows */
    const int32_t *table;
    int64_t table_row;
    const int32_t *rows, *lens;
    int kv_dtype, elem_bytes, num_q_heads, num_kv_heads, head_dim, value_dim, window, splits;
    float scale; /* the softmax scale times log2(e) (the float32 queries carry it already) */
} Views;

/* One part's softmax state per query head: max and sum of exp2, and the unnormalised
 * output [Hq, Dv]. */
typedef struct {
    float *m, *l, *acc;
} Part;

/* `n` elements at element offset `off` of `base`, as float32 into `dst`. */
static void load_row(const void *base, int64_t off, int dtype, int n, float *restrict dst) {
    if (dtype == F32) {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        const _Float16 *src = (const _Float16 *)base + off;
        for (int i = 0; i < n; i++) dst[i] = (float)src[i];
    }
}

/* Every cache line of `bytes` bytes at `p`, into the cache ahead of use. */
static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}
/* The same into the level-2 cache only: the bfloat16 path's rows, a block ahead. With
 * prefetches into the first level, the 96 lines of a block's rows competed with the
 * block being read (a 16-sequence step of the default model read its KV at 10 GB/s;
 * 15 GB/s this way). */
static inline void prefetch_row_l2(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);
}

/* 2^x for x <= 0 (exp2.h; clamped at -125). */
static inline float exp2_nonpositive(float x) { return exp2_clamped(x, -125.0f); }

/* The largest of x[0 .. n-1]: MAX_LANES running maxima (a select per lane vectorizes,
 * a reduction over `>` does not without finite-math flags), then the lanes'. */
#define MAX_LANES 16
static inline float max_of(const float *x, int n) {
    float lanes[MAX_LANES], m = -FLT_MAX;
    for (int t = 0; t < MAX_LANES; t++) lanes[t] = -FLT_MAX;
    int j = 0;
    for (; j + MAX_LANES <= n; j += MAX_LANES)
        for (int t = 0; t < MAX_LANES; t++) lanes[t] = x[j + t] > lanes[t] ? x[j + t] : lanes[t];
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    for (int t = 0; t < MAX_LANES; t++) m = lanes[t] > m ? lanes[t] : m;
    return m;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Logits of every query head `q` [Hq, D] for keys [a, b) of the view `slots`, into
 * `logits` [Hq, b - a]; `row` holds one slot's keys [Hkv, D] in float32. */
static inline __attribute__((always_inline)) void part_logits(
    const Views *w, const float *q, const int32_t *slots, int a, int b, float *restrict logits,
    float *restrict row, const int d) {
    const int group = w->num_q_heads / w->num_kv_heads, n = b - a;
    const int width = w->num_kv_heads * d;
    const char *k = (const char *)w->k;
    for (int j = a; j < b; j++) {
        if (j + PREFETCH_AHEAD < b)
            prefetch_row(k + (int64_t)slots[j + PREFETCH_AHEAD] * w->k_slot * w->elem_bytes,
                         (int64_t)width * w->elem_bytes);
        load_row(w->k, (int64_t)slots[j] * w->k_slot, w->kv_dtype, width, row);
        for (int hq = 0; hq < w->num_q_heads; hq++)
            logits[(int64_t)hq * n + (j - a)] = dot(q + (int64_t)hq * d, row + (hq / group) * d, d);
    }
}

/* Probability-weighted values of keys [a, b) (`probs` [Hq, b - a]) into `acc` [Hq, Dv].
 * Keys go VALUE_BLOCK at a time: each pass over `acc` adds that many rows, so the
 * accumulators are loaded and stored once per block rather than once per key (which
 * bound the loop). `rows` holds VALUE_BLOCK slots' values [Hkv, Dv] in float32. */
static inline __attribute__((always_inline)) void part_values(
    const Views *w, const int32_t *slots, int a, int b, const float *probs, float *restrict acc,
    float *restrict rows, const int dv) {
    const int group = w->num_q_heads / w->num_kv_heads, n = b - a;
    const int width = w->num_kv_heads * dv;
    const char *v = (const char *)w->v;
    for (int j = a; j < b; j += VALUE_BLOCK) {
        const int count = b - j < VALUE_BLOCK ? b - j : VALUE_BLOCK;
        for (int t = 0; t < count; t++) {
            if (j + t + PREFETCH_AHEAD < b)
                prefetch_row(v + (int64_t)slots[j + t + PREFETCH_AHEAD] * w->v_slot * w->elem_bytes,
                             (int64_t)width * w->elem_bytes);
            load_row(w->v, (int64_t)slots[j + t] * w->v_slot, w->kv_dtype, width,
                     rows + (int64_t)t * width);
        }
        for (int t = count; t < VALUE_BLOCK; t++)  /* a short last block adds zeros */
            memset(rows + (int64_t)t * width, 0, sizeof(float) * (size_t)width);
        for (int hq = 0; hq < w->num_q_heads; hq++) {
            const float *p = probs + (int64_t)hq * n + (j - a);
            const float p0 = p[0], p1 = count > 1 ? p[1] : 0.0f;
            const float p2 = count > 2 ? p[2] : 0.0f, p3 = count > 3 ? p[3] : 0.0f;
            const float *restrict r0 = rows + (hq / group) * dv;
            const float *restrict r1 = r0 + width, *restrict r2 = r1 + width;
            const float *restrict r3 = r2 + width;
            float *restrict out = acc + (int64_t)hq * dv;
            for (int e = 0; e < dv; e++) out[e] += p0 * r0[e] + p1 * r1[e] + p2 * r2[e] + p3 * r3[e];
        }
    }
}

/* The part of no keys yet: sums and outputs zero, maxima at the lowest float. */
static inline void empty_part(Part out, int hq_count, int dv) {
    memset(out.acc, 0, sizeof(float) * (size_t)hq_count * (size_t)dv);
    for (int hq = 0; hq < hq_count; hq++) {
        out.m[hq] = -FLT_MAX;
        out.l[hq] = 0.0f;
    }
}

/* Each query head's logits row [n] of `logits` [Hq, n] into exp2 of its differences
 * from the row's maximum, the maximum and the sum into the part. */
static inline void softmax_rows(int hq_count, int n, float *logits, Part out) {
    for (int hq = 0; hq < hq_count; hq++) {
        float *lg = logits + (int64_t)hq * n, sum = 0.0f;
        const float m = max_of(lg, n);
        for (int j = 0; j < n; j++) {
            lg[j] = exp2_nonpositive(lg[j] - m);
            sum += lg[j];
        }
        out.m[hq] = m;
        out.l[hq] = sum;
    }
}

/* Softmax state of sequence s's keys [a, b) for every query head; head dims `d` and
 * `dv` as arguments so that the callers below specialise it for constant ones. */
static inline __attribute__((always_inline)) void attend_part(
    const Views *w, int s, int a, int b, Part out, float *logits, float *row, const int d,
    const int dv) {
    const int hq_count = w->num_q_heads, n = b - a;
    const int32_t *slots = w->table + (int64_t)w->rows[s] * w->table_row;
    const float *q = w->q + (int64_t)s * hq_count * d;
    empty_part(out, hq_count, dv);
    if (n <= 0) return;
    part_logits(w, q, slots, a, b, logits, row, d);
    softmax_rows(hq_count, n, logits, out);
    part_values(w, slots, a, b, logits, out.acc, row, dv);
}

/* The common head dims as constants: fixed trip counts let the compiler unroll the
 * dot products and updates (1.35x at head_dim 64). */
static void attend_part_64(const Views *w, int s, int a, int b, Part out, float *lg, float *row) {
    attend_part(w, s, a, b, out, lg, row, 64, 64);
}

static void attend_part_128(const Views *w, int s, int a, int b, Part out, float *lg, float *row) {
    attend_part(w, s, a, b, out, lg, row, 128, 128);
}

static void attend_part_any(const Views *w, int s, int a, int b, Part out, float *lg, float *row) {
    attend_part(w, s, a, b, out, lg, row, w->head_dim, w->value_dim);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_BF16_PATH 1
/* Keys per block of the bfloat16 path: one 512-bit vector of float32 logits. */
#define BF16_KEYS 16

/* Lane t of the result: the sum of v[t]'s 16 lanes (a transposing tree: 45 shuffles and
 * adds for 16 sums, where a reduction per vector takes about 8 each). */
static inline __m512 lane_sums16(const __m512 v[BF16_KEYS]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: v[2i], v[2i+1], v[2i], v[2i+1] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: v[4i] .. v[4i+3] */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* then across the four 128-bit lanes */
    const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                    _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                    _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xdd));
}

/* Logits of every query head for keys [a, b), into `logits` [Hq, b - a]: each key's dot
 * products with VDPBF16PS over the raw bfloat16 query and key (the products are exact in
 * float32), 16 keys' partial sums reduced together, then scaled. Block by block of 16
 * keys, every KV head of a block: a slot's row is one contiguous run, and reading it
 * whole (the next block's rows prefetched) streams from memory where a pass per head,
 * a third of every row at a time, read at half the rate. */
static inline __attribute__((always_inline)) void logits_bf16(
    const Views *w, const uint16_t *q, const int32_t *slots, int a, int b,
    float *restrict logits, const int d) {
    const int group = w->num_q_heads / w->num_kv_heads, n = b - a;
    const int64_t row_bytes = (int64_t)w->num_kv_heads * d * 2;
    const uint16_t *k = (const uint16_t *)w->k;
    const __m512 scale = _mm512_set1_ps(w->scale);
    for (int j0 = a; j0 < b; j0 += BF16_KEYS) {
        const int count = b - j0 < BF16_KEYS ? b - j0 : BF16_KEYS;
        const uint16_t *rows[BF16_KEYS];
        for (int t = 0; t < count; t++) {
            rows[t] = k + (int64_t)slots[j0 + t] * w->k_slot;
            if (j0 + BF16_KEYS + t < b) /* the next block's rows */
                prefetch_row_l2(
                    (const char *)(k + (int64_t)slots[j0 + BF16_KEYS + t] * w->k_slot), row_bytes);
        }
        const __mmask16 live =
            count == BF16_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
        for (int hq = 0; hq < w->num_q_heads; hq++) {
            const uint16_t *qh = q + (int64_t)hq * w->q_stride_h;
            const int64_t head = (int64_t)(hq / group) * d;
            __m512 sums[BF16_KEYS];
            for (int t = 0; t < BF16_KEYS; t++) {
                sums[t] = _mm512_setzero_ps();
                if (t >= count) continue;
                for (int c = 0; c < d; c += 32)
                    sums[t] = _mm512_dpbf16_ps(sums[t],
                                               (__m512bh)_mm512_loadu_si512(rows[t] + head + c),
                                               (__m512bh)_mm512_loadu_si512(qh + c));
            }
            _mm512_mask_storeu_ps(logits + (int64_t)hq * n + (j0 - a), live,
                                  _mm512_mul_ps(lane_sums16(sums), scale));
        }
    }
}

/* Probability-weighted values of keys [a, b) (`probs` [Hq, b - a]) added into `acc`
 * [Hq, Dv]: block by block of 16 keys (whole rows, as logits_bf16 reads them), each KV
 * head's 16 value rows widened to float32 once into `block` [16, Dv] (exact), then
 * float32 multiply-adds per query head, its Dv sums in registers over the block. */
static inline __attribute__((always_inline)) void values_bf16(
    const Views *w, const int32_t *slots, int a, int b, const float *probs,
    float *restrict acc, float *restrict block, const int dv) {
    const int group = w->num_q_heads / w->num_kv_heads, n = b - a;
    const int64_t row_bytes = (int64_t)w->num_kv_heads * dv * 2;
    const uint16_t *v = (const uint16_t *)w->v;
    for (int j0 = a; j0 < b; j0 += BF16_KEYS) {
        const int count = b - j0 < BF16_KEYS ? b - j0 : BF16_KEYS;
        for (int t = 0; t < count && j0 + BF16_KEYS + t < b; t++) /* the next block's */
            prefetch_row_l2((const char *)(v + (int64_t)slots[j0 + BF16_KEYS + t] * w->v_slot),
                            row_bytes);
        for (int h = 0; h < w->num_kv_heads; h++) {
            for (int t = 0; t < count; t++) {
                const uint16_t *row = v + (int64_t)slots[j0 + t] * w->v_slot + (int64_t)h * dv;
                for (int e = 0; e < dv; e += 16) /* bfloat16 is float32's top half */
                    _mm512_storeu_ps(block + t * dv + e,
                                     _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32(
                                             _mm256_loadu_si256((const __m256i *)(row + e))),
                                         16)));
            }
            for (int hq = h * group; hq < (h + 1) * group; hq++) {
                const float *p = probs + (int64_t)hq * n + (j0 - a);
                float *out = acc + (int64_t)hq * dv;
                __m512 sums[8]; /* Dv <= 128 (bf16_path) */
                for (int e = 0; e < dv / 16; e++) sums[e] = _mm512_loadu_ps(out + 16 * e);
                for (int t = 0; t < count; t++) {
                    const __m512 pt = _mm512_set1_ps(p[t]);
                    for (int e = 0; e < dv / 16; e++)
                        sums[e] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(block + t * dv + 16 * e),
                                                  sums[e]);
                }
                for (int e = 0; e < dv / 16; e++) _mm512_storeu_ps(out + 16 * e, sums[e]);
            }
        }
    }
}

/* attend_part for a bfloat16 pool and bfloat16 queries; `block` holds 16 widened value
 * rows. */
static inline __attribute__((always_inline)) void attend_part_bf16(
    const Views *w, int s, int a, int b, Part out, float *logits, float *block, const int d,
    const int dv) {
    const int n = b - a;
    const int32_t *slots = w->table + (int64_t)w->rows[s] * w->table_row;
    const uint16_t *q = w->q_bf16 + (int64_t)s * w->q_stride_s;
    empty_part(out, w->num_q_heads, dv);
    if (n <= 0) return;
    logits_bf16(w, q, slots, a, b, logits, d);
    softmax_rows(w->num_q_heads, n, logits, out);
    values_bf16(w, slots, a, b, logits, out.acc, block, dv);
}

static void attend_part_bf16_64(const Views *w, int s, int a, int b, Part out, float *lg,
                                float *block) {
    attend_part_bf16(w, s, a, b, out, lg, block, 64, 64);
}

static void attend_part_bf16_128(const Views *w, int s, int a, int b, Part out, float *lg,
                                 float *block) {
    attend_part_bf16(w, s, a, b, out, lg, block, 128, 128);
}
#endif

/* Keys [a, b) of split `split` of sequence s's visible entries. */
static void split_range(const Views *w, int s, int split, int *a, int *b) {
    const int len = w->lens[s];
    const int first = (w->window > 0 && len > w->window) ? len - w->window : 0;
    const int chunk = (len - first + w->splits - 1) / w->splits;
    *a = first + split * chunk;
    if (*a > len) *a = len;
    *b = *a + chunk < len ? *a + chunk : len;
}

/* out [S, Hq, Dv] from the parts of every (sequence, query head), workspace rows in
 * [S, Hq, splits] order. */
static void merge_parts(const Views *w, int num_seqs, const float *m, const float *l,
                        const float *acc, float *out) {
    const int dv = w->value_dim, p_count = w->splits;
    for (int64_t r = 0; r < (int64_t)num_seqs * w->num_q_heads; r++) {
        float top = -FLT_MAX, total = 0.0f;
        for (int p = 0; p < p_count; p++) top = m[r * p_count + p] > top ? m[r * p_count + p] : top;
        float *o = out + r * dv;
        memset(o, 0, sizeof(float) * (size_t)dv);
        for (int p = 0; p < p_count; p++) {
            const float weight = exp2_nonpositive(m[r * p_count + p] - top);
            const float *part = acc + (r * p_count + p) * dv;
            total += weight * l[r * p_count + p];
            for (int e = 0; e < dv; e++) o[e] += weight * part[e];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int e = 0; e < dv; e++) o[e] *= inv;
    }
}

/* Floats of a thread's value rows: VALUE_BLOCK rows [Hkv, Dv] (generic path) or the
 * bfloat16 path's 16 rows of one head. */
static int64_t value_rows(const Views *w) {
    const int width = w->num_kv_heads * (w->head_dim > w->value_dim ? w->head_dim : w->value_dim);
    const int64_t generic = (int64_t)VALUE_BLOCK * width, bf16 = 16 * (int64_t)w->value_dim;
    return generic > bf16 ? generic : bf16;
}

/* Whether the bfloat16 path computes this batch: bfloat16 queries and pool, head dims it
 * specialises. */
static int bf16_path(const Views *w) {
#ifdef HAVE_BF16_PATH
    return w->q_bf16 != NULL && w->kv_dtype == BF16 && w->head_dim == w->value_dim &&
           (w->head_dim == 64 || w->head_dim == 128);
#else
    (void)w;
    return 0;
#endif
}

/* Work item `item` = (sequence, split): its part into the workspace; `buf` holds the
 * thread's logits [Hq, chunk], value rows and the part. */
static void attend_item(const Views *w, int64_t item, float *buf, int chunk, float *ws_m,
                        float *ws_l, float *ws_acc) {
    const int hq_count = w->num_q_heads, dv = w->value_dim, splits = w->splits;
    const int split = (int)(item % splits), s = (int)(item / splits);
    float *logits = buf, *row = buf + (int64_t)hq_count * chunk;
    float *after = row + value_rows(w);
    const Part part = {after, after + hq_count, after + 2 * hq_count};
    int a, b;
    split_range(w, s, split, &a, &b);
#ifdef HAVE_BF16_PATH
    if (bf16_path(w) && w->head_dim == 64)
        attend_part_bf16_64(w, s, a, b, part, logits, row);
    else if (bf16_path(w))
        attend_part_bf16_128(w, s, a, b, part, logits, row);
    else
#endif
    if (w->head_dim == 64 && dv == 64)
        attend_part_64(w, s, a, b, part, logits, row);
    else if (w->head_dim == 128 && dv == 128)
        attend_part_128(w, s, a, b, part, logits, row);
    else
        attend_part_any(w, s, a, b, part, logits, row);
    for (int hq = 0; hq < hq_count; hq++) {
        const int64_t r = ((int64_t)s * hq_count + hq) * splits + split;
        ws_m[r] = part.m[hq];
        ws_l[r] = part.l[hq];
        memcpy(ws_acc + r * dv, part.acc + (int64_t)hq * dv, sizeof(float) * (size_t)dv);
    }
}

/* Queries [S, Hq, D] of any element type and row strides as float32 times `scale`. */
static void load_queries(const void *q, int dtype, int64_t stride_s, int64_t stride_h, int num_seqs,
                         int num_q_heads, int head_dim, float scale, float *dst) {
    for (int s = 0; s < num_seqs; s++)
        for (int h = 0; h < num_q_heads; h++) {
            float *row = dst + ((int64_t)s * num_q_heads + h) * head_dim;
            load_row(q, s * stride_s + h * stride_h, dtype, head_dim, row);
            for (int d = 0; d < head_dim; d++) row[d] *= scale;
        }
}

/* `n` float32 outputs into `out` (contiguous) in element type `dtype`. */
static void store_outputs(const float *src, void *out, int dtype, int64_t n) {
    for (int64_t i = 0; i < n; i++) store_element(out, i, src[i], dtype);
}

/* Exported: see attention/cpu/decode.py. `q` [S, Hq, D] and `out` [S, Hq, Dv] (contiguous)
 * in element type `q_dtype`; `k`, `v` [slots, Hkv, D | Dv] in `kv_dtype`. Returns 0, or 1
 * when memory ran out. */
int svllm_decode_attention(const void *q, int q_dtype, int64_t q_stride_s, int64_t q_stride_h,
                           float scale, const void *k, const void *v, int kv_dtype,
                           int64_t k_slot, int64_t v_slot, const int32_t *table,
                           int64_t table_row, const int32_t *rows, const int32_t *lens,
                           void *out, int num_seqs, int num_q_heads, int num_kv_heads,
                           int head_dim, int value_dim, int window, int splits, int max_len,
                           int num_threads) {
    const int chunk = (max_len + splits - 1) / splits;
    const int64_t rows_out = (int64_t)num_seqs * num_q_heads * splits;
    const int64_t items = (int64_t)num_seqs * splits;
    const int64_t q_count = (int64_t)num_seqs * num_q_heads * head_dim;
    const int64_t out_count = (int64_t)num_seqs * num_q_heads * value_dim;
    /* the workspace: parts' m, l, acc; the scaled float32 queries; the float32 outputs */
    float *ws = malloc(sizeof(float) *
                       ((size_t)rows_out * (size_t)(2 + value_dim) + (size_t)(q_count + out_count)));
    if (!ws) return 1;
    float *ws_m = ws, *ws_l = ws + rows_out, *ws_acc = ws + 2 * rows_out;
    float *qf = ws_acc + rows_out * value_dim, *outf = qf + q_count;
    const Views w = {qf, q_dtype == BF16 ? (const uint16_t *)q : NULL, q_stride_s, q_stride_h,
                     k, v, k_slot, v_slot, table, table_row, rows, lens, kv_dtype,
                     kv_dtype == F32 ? 4 : 2, num_q_heads, num_kv_heads, head_dim,
                     value_dim, window, splits, scale};
    if (!bf16_path(&w)) /* the bfloat16 path reads the queries as given */
        load_queries(q, q_dtype, q_stride_s, q_stride_h, num_seqs, num_q_heads, head_dim,
                     scale, qf);
    /* per thread: logits [Hq, chunk], value rows, the part's m, l [Hq] and acc [Hq, Dv] */
    const size_t per_thread =
        (size_t)num_q_heads * ((size_t)chunk + 2 + (size_t)value_dim) + (size_t)value_rows(&w);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
    {
        float *buf = malloc(sizeof(float) * per_thread);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (buf) attend_item(&w, item, buf, chunk, ws_m, ws_l, ws_acc);
        }
        free(buf);
    }
    if (!failed) {
        merge_parts(&w, num_seqs, ws_m, ws_l, ws_acc, outf);
        store_outputs(outf, out, q_dtype, out_count);
    }
    free(ws);
    return failed;
}
