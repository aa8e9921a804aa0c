/* Scalar helpers shared by the C kernels: bf16 <-> fp32 conversions and a vectorisable exp. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f32_to_f32(float x) { return x; }

/* exp(x) as 2^(x log2 e): a degree-6 polynomial for the fraction, the integer part in the
 * exponent bits. Relative error ~1e-7, and unlike libm's expf the compiler vectorises it. */
static inline float fast_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f;
    const float fi = floorf(t), f = t - fi;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (uint32_t)(int32_t)fi << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
static inline uint16_t store_bf16(float x) { return f32_to_bf16(x); }
static inline float store_f32(float x) { return x; }

