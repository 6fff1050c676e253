/* RMSNorm on the CPU (layers/cpu_norm.py; built and loaded by native/build.py): one call
 * per norm instead of the ~8 torch operators of the reference form (the float32 copy,
 * square, mean, rsqrt, scale, cast and weight product), each of which costs microseconds
 * on a decode step's few rows.
 *
 * Rounding points as in layers/norm.py (Hugging Face's): the row in float32, times
 * 1 / sqrt(mean(x^2) + eps); then
 *   Llama-style: the normalised row rounded to the element type, times the weight, the
 *                product rounded (float32: no rounding);
 *   Gemma-style: times (1 + weight) in float32, then rounded.
 * Element types as in elements.h.
 * Rows are independent: a long chunk's go over OpenMP threads.
 */
#include <math.h>

#include "elements.h"

/* `f` rounded to the element type and back (the identity for float32). */
static inline float rounded(float f, int dtype) {
    if (dtype == BF16) return bf16_to_f32(f32_to_bf16(f));
    if (dtype == F16) return (float)(_Float16)f;
    return f;
}

/* One row: x (element offset `in`) -> out (offset `o`). The element types are constants
 * in each caller below, so the loops vectorize (a type switch per element kept a
 * 4,096-row prefill norm at ~5 ms instead of well under one). */
static inline __attribute__((always_inline)) void norm_row(const void *x, int64_t in, void *out,
                                                           int64_t o, const void *weight, int n,
                                                           float eps, int gemma, const int dtype,
                                                           const int w_dtype) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = load_element(x, in + i, dtype);
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) {
        const float normed = load_element(x, in + i, dtype) * inv;
        const float w = load_element(weight, i, w_dtype);
        const float y = gemma ? normed * (1.0f + w) : w * rounded(normed, dtype);
        store_element(out, o + i, y, dtype);
    }
}

/* x [rows, n] (row stride `stride` elements) -> out [rows, n] contiguous, both of
 * element type `dtype`; the weight [n] of element type `w_dtype`. */
void svllm_rms_norm(const void *x, int64_t stride, void *out, const void *weight, int dtype,
                    int w_dtype, int64_t rows, int n, float eps, int gemma, int num_threads) {
    /* A prefill chunk's thousands of rows over the threads; a decode step's few on one. */
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * stride, o = r * (int64_t)n;
        if (dtype == BF16 && w_dtype == BF16)
            norm_row(x, in, out, o, weight, n, eps, gemma, BF16, BF16);
        else if (dtype == F32 && w_dtype == F32)
            norm_row(x, in, out, o, weight, n, eps, gemma, F32, F32);
        else
            norm_row(x, in, out, o, weight, n, eps, gemma, dtype, w_dtype);
    }
}
