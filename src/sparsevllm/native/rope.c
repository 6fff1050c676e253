/* Rotary position embedding on the CPU (layers/cpu_rope.py; built and loaded by
 * native/build.py): q and k of a forward in one call instead of ~10 torch operators
 * per tensor.
 *
 * Hugging Face's rotate-half form, with the rounding points of layers/rotary.py: the
 * element in float32, `x1 cos - x2 sin` and `x2 cos + x1 sin` as separate products and
 * sums (contraction into fused multiply-adds is off for this file's rotation, so the
 * bits equal torch's), rounded to the element type. cos and sin come from the float32
 * tables [max_position, D/2] at each token's position.
 * Element types as in elements.h.
 */
#include <stdint.h>

#include "elements.h"

/* No contraction into fused multiply-adds anywhere in this file (GCC contracts across
 * statements by default; clang only within one expression, which the rotation never
 * has), so that the bits equal torch's. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

/* One head's row of D at element offset `in` of `x` into offset `out` of `y`. The element
 * type is a constant in each caller below, so the loop vectorizes (a type switch per
 * element made a decode step's call of 16 tokens take 27 us). */
static inline __attribute__((always_inline)) void rotate_row(const void *x, int64_t in, void *y,
                                                             int64_t out, const float *cos,
                                                             const float *sin, int half,
                                                             const int dtype) {
    for (int i = 0; i < half; i++) {
        const float x1 = load_element(x, in + i, dtype), x2 = load_element(x, in + half + i, dtype);
        const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
        store_element(y, out + i, a - b, dtype);
        store_element(y, out + half + i, c + d, dtype);
    }
}

/* Token t's heads of q and k. */
static inline __attribute__((always_inline)) void rotate_token(
    const void *q, int64_t q_tok, int64_t q_head, const void *k, int64_t k_tok, int64_t k_head,
    int64_t t, const float *cos, const float *sin, int num_q_heads, int num_kv_heads,
    int head_dim, void *q_out, void *k_out, const int dtype) {
    const int half = head_dim / 2;
    for (int h = 0; h < num_q_heads; h++)
        rotate_row(q, t * q_tok + h * q_head, q_out, (t * num_q_heads + h) * head_dim, cos, sin,
                   half, dtype);
    for (int h = 0; h < num_kv_heads; h++)
        rotate_row(k, t * k_tok + h * k_head, k_out, (t * num_kv_heads + h) * head_dim, cos, sin,
                   half, dtype);
}

/* q [T, Hq, D] and k [T, Hkv, D] (token and head strides in elements; rows contiguous)
 * -> q_out, k_out contiguous, all of element type `dtype`. */
void svllm_rope(const void *q, int64_t q_tok, int64_t q_head, const void *k, int64_t k_tok,
                int64_t k_head, int dtype, const int64_t *positions, const float *cos_table,
                const float *sin_table, int64_t tokens, int num_q_heads, int num_kv_heads,
                int head_dim, void *q_out, void *k_out, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cos = cos_table + positions[t] * half, *sin = sin_table + positions[t] * half;
        if (dtype == BF16)
            rotate_token(q, q_tok, q_head, k, k_tok, k_head, t, cos, sin, num_q_heads,
                         num_kv_heads, head_dim, q_out, k_out, BF16);
        else if (dtype == F32)
            rotate_token(q, q_tok, q_head, k, k_tok, k_head, t, cos, sin, num_q_heads,
                         num_kv_heads, head_dim, q_out, k_out, F32);
        else
            rotate_token(q, q_tok, q_head, k, k_tok, k_head, t, cos, sin, num_q_heads,
                         num_kv_heads, head_dim, q_out, k_out, dtype);
    }
}
