/* Element types the native kernels read and write, and their conversions to and from
 * float32: 0 float32, 1 bfloat16 (rounded to nearest even, as torch rounds; a NaN stays
 * a NaN), 2 float16 (the compiler's conversion, nearest even). */
#ifndef SVLLM_ELEMENTS_H
#define SVLLM_ELEMENTS_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Element i of `p` as float32. */
static inline float load_element(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return (float)((const _Float16 *)p)[i];
}

/* `f` rounded into element i of `p`. */
static inline void store_element(void *p, int64_t i, float f, int dtype) {
    if (dtype == F32)
        ((float *)p)[i] = f;
    else if (dtype == BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else
        ((_Float16 *)p)[i] = (_Float16)f;
}

#endif
