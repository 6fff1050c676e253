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
 * the end, as torch rounds. All arithmetic is float32. The compiler flags allow reassociation (vectorized dot products and
 * sums) but not finite-math assumptions.
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
    const void *k, *v;
    int64_t k_slot, v_slot; /* slot strides in elements; heads are contiguous rows */
    const int32_t *table;
    int64_t table_row;
    const int32_t *rows, *lens;
    int kv_dtype, elem_bytes, num_q_heads, num_kv_heads, head_dim, value_dim, window, splits;
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

/* Softmax state of sequence s's keys [a, b) for every query head; head dims `d` and
 * `dv` as arguments so that the callers below specialise it for constant ones. */
static inline __attribute__((always_inline)) void attend_part(
    const Views *w, int s, int a, int b, Part out, float *logits, float *row, const int d,
    const int dv) {
    const int hq_count = w->num_q_heads, n = b - a;
    const int32_t *slots = w->table + (int64_t)w->rows[s] * w->table_row;
    const float *q = w->q + (int64_t)s * hq_count * d;
    memset(out.acc, 0, sizeof(float) * (size_t)hq_count * (size_t)dv);
    for (int hq = 0; hq < hq_count; hq++) {
        out.m[hq] = -FLT_MAX;
        out.l[hq] = 0.0f;
    }
    if (n <= 0) return;
    part_logits(w, q, slots, a, b, logits, row, d);
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

/* Work item `item` = (sequence, split): its part into the workspace; `buf` holds the
 * thread's logits [Hq, chunk], a row and the part. */
static void attend_item(const Views *w, int64_t item, float *buf, int chunk, float *ws_m,
                        float *ws_l, float *ws_acc) {
    const int hq_count = w->num_q_heads, dv = w->value_dim, splits = w->splits;
    const int width = w->num_kv_heads * (w->head_dim > dv ? w->head_dim : dv);
    const int split = (int)(item % splits), s = (int)(item / splits);
    float *logits = buf, *row = buf + (int64_t)hq_count * chunk;
    float *after = row + (int64_t)VALUE_BLOCK * width;
    const Part part = {after, after + hq_count, after + 2 * hq_count};
    int a, b;
    split_range(w, s, split, &a, &b);
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
    const int width = num_kv_heads * (head_dim > value_dim ? head_dim : value_dim);
    const int chunk = (max_len + splits - 1) / splits;
    const int64_t rows_out = (int64_t)num_seqs * num_q_heads * splits;
    const int64_t items = (int64_t)num_seqs * splits;
    const int64_t q_count = (int64_t)num_seqs * num_q_heads * head_dim;
    const int64_t out_count = (int64_t)num_seqs * num_q_heads * value_dim;
    /* per thread: logits [Hq, chunk], VALUE_BLOCK rows [width], the part's m, l [Hq] and
     * acc [Hq, Dv] */
    const size_t per_thread = (size_t)num_q_heads * ((size_t)chunk + 2 + (size_t)value_dim) +
                              (size_t)VALUE_BLOCK * (size_t)width;
    /* the workspace: parts' m, l, acc; the scaled float32 queries; the float32 outputs */
    float *ws = malloc(sizeof(float) *
                       ((size_t)rows_out * (size_t)(2 + value_dim) + (size_t)(q_count + out_count)));
    if (!ws) return 1;
    float *ws_m = ws, *ws_l = ws + rows_out, *ws_acc = ws + 2 * rows_out;
    float *qf = ws_acc + rows_out * value_dim, *outf = qf + q_count;
    load_queries(q, q_dtype, q_stride_s, q_stride_h, num_seqs, num_q_heads, head_dim, scale, qf);
    const Views w = {qf, k, v, k_slot, v_slot, table, table_row, rows, lens, kv_dtype,
                     kv_dtype == F32 ? 4 : 2, num_q_heads, num_kv_heads, head_dim,
                     value_dim, window, splits};
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
