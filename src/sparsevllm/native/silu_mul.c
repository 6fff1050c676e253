/* The gated MLP's SiLU(gate) * up on the CPU (layers/cpu_silu_mul.py; built and loaded
 * by native/build.py): one pass over a layer's [T, I] halves instead of torch's two
 * operators (SiLU, then the product), each a pass over memory and, in bfloat16, a
 * conversion there and back. At prefill the two took ~9 ms a layer for 4,096 x 1,536
 * bfloat16 elements on a 2-core AMD EPYC.
 *
 * The rounding points of the torch form `F.silu(gate) * up` in the element type: SiLU
 * in float32, g / (1 + e^-g), rounded to the element type; the product in float32,
 * rounded. e^-g is 2^(-g log2 e) by exp2.h's polynomial (relative error ~2e-7), so a
 * float32 result may differ from torch's in the last bit.
 * Element types as in elements.h: float32 and bfloat16 (float16's conversions made the
 * kernel slower than torch's operators; layers/cpu_silu_mul.py keeps torch for it).
 */
#include <stdint.h>

#include "elements.h"
#include "exp2.h"

/* Where e^-g overflows float32 (g < -88.7) torch's quotient is -0 (NaN at -inf): the
 * clamped power is replaced by infinity there to give the same. */
static inline float silu(float g) {
    const float e = -1.4426950408889634f * g;
    const float power = e > 127.0f ? __builtin_inff() : exp2_clamped(e, -126.0f);
    return g / (1.0f + power);
}

/* One row of n: out = silu(gate) * up, with the element type's rounding points. The
 * element type is a constant in each caller, so the loop vectorizes. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate, int64_t g0,
                                                               const void *up, int64_t u0,
                                                               void *out, int64_t o0, int64_t n,
                                                               const int dtype) {
    for (int64_t i = 0; i < n; i++) {
        float s = silu(load_element(gate, g0 + i, dtype));
        if (dtype == BF16) s = bf16_to_f32(f32_to_bf16(s));
        store_element(out, o0 + i, s * load_element(up, u0 + i, dtype), dtype);
    }
}

/* gate, up [rows, n] (row strides in elements, contiguous within a row) -> out [rows, n]
 * contiguous, all of element type `dtype` (F32 or BF16). */
void svllm_silu_mul(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride,
                    void *out, int64_t rows, int64_t n, int dtype, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == BF16)
            silu_mul_row(gate, r * gate_stride, up, r * up_stride, out, r * n, n, BF16);
        else
            silu_mul_row(gate, r * gate_stride, up, r * up_stride, out, r * n, n, F32);
    }
}
