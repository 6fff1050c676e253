/* 2^x in float32 for the native kernels' softmax and SiLU, written without calls so that
 * loops over it vectorize. */
#ifndef SVLLM_EXP2_H
#define SVLLM_EXP2_H

#include <stdint.h>
#include <string.h>

/* 2^x for x clamped to [lo, 127] (lo >= -126): 2^round(x) from the exponent bits times a
 * degree-6 polynomial of the remainder in [-0.5, 0.5] (Cephes' exp2f coefficients,
 * relative error ~2e-7). */
static inline float exp2_clamped(float x, float lo) {
    x = x < lo ? lo : (x > 127.0f ? 127.0f : x);
    const float whole = __builtin_floorf(x + 0.5f), f = x - whole;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)whole + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
