// KV cache element formats (model/kv_quant.py): the codes the kernels take, the 8-bit write (a scale per token
// and KV head, rounded up to bf16, values rounded to the format) and the scalar decode of a stored byte.
// quantize_kv computes exactly what kv_quant.quantize does in torch (same float operations, same rounding).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };

static inline int kv_scaled(int64_t kind) { return kind >= KV_INT8; }
static inline int64_t kv_elem_bytes(int64_t kind) { return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1; }

static inline float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// the smallest bf16 >= x, for finite x >= 0
static inline uint16_t bf16_round_up(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0xFFFFu) >> 16);
}

// |y| <= the format's largest value -> its fp8 byte, rounding to nearest even (as torch converts); mant/bias: 3/7
// for e4m3, 2/15 for e5m2
static inline uint8_t fp8_encode(float y, int mant, int bias) {
    uint32_t u;
    memcpy(&u, &y, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(y);
    if (a < ldexpf(1.0f, 1 - bias))  // subnormal: multiples of 2^(1 - bias - mant); 2^mant is the least normal
        return sign | (uint8_t)nearbyintf(a * ldexpf(1.0f, bias - 1 + mant));
    uint32_t bits = u & 0x7fffffffu;
    const int shift = 23 - mant;
    bits += ((1u << (shift - 1)) - 1) + ((bits >> shift) & 1u);
    const int exponent = (int)(bits >> 23) - 127 + bias;
    return sign | (uint8_t)((exponent << mant) | ((bits >> shift) & ((1u << mant) - 1)));
}

// One head-vector x[0..n) -> its bytes at dst[d * stride]; returns the scale's bf16 bits.
static inline uint16_t quantize_kv(const float *x, int64_t n, int64_t kind, uint8_t *dst, int64_t stride) {
    const float qmax = kind == KV_INT8 ? 127.0f : kind == KV_E4M3 ? 448.0f : 57344.0f;
    float amax = 0.0f;
    for (int64_t d = 0; d < n; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const uint16_t scale_bits = bf16_round_up(amax / qmax);
    const float scale = bf16_value(scale_bits);
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t d = 0; d < n; ++d) {
        float y = x[d] * inverse;
        if (kind == KV_INT8) y = nearbyintf(y);
        y = y > qmax ? qmax : y < -qmax ? -qmax : y;
        dst[d * stride] = kind == KV_INT8 ? (uint8_t)(int8_t)y : fp8_encode(y, kind == KV_E4M3 ? 3 : 2,
                                                                          kind == KV_E4M3 ? 7 : 15);
    }
    return scale_bits;
}

// A stored 8-bit value as float, before its scale.
static inline float kv_byte_value(uint8_t b, int64_t kind) {
    if (kind == KV_INT8) return (float)(int8_t)b;
    const int mant = kind == KV_E4M3 ? 3 : 2, bias = kind == KV_E4M3 ? 7 : 15;
    const int exponent = (b & 0x7f) >> mant, m = b & ((1 << mant) - 1);
    const float v = exponent ? ldexpf((float)((1 << mant) + m), exponent - bias - mant)
                             : ldexpf((float)m, 1 - bias - mant);
    return (b & 0x80) ? -v : v;
}

// kv_byte_value of every byte of the two fp8 formats, for loops that decode many (filled when the library loads)
static float kv_fp8_values[2][256];
__attribute__((constructor)) static void kv_fill_fp8_values(void) {
    for (int b = 0; b < 256; ++b) {
        kv_fp8_values[0][b] = kv_byte_value((uint8_t)b, KV_E4M3);
        kv_fp8_values[1][b] = kv_byte_value((uint8_t)b, KV_E5M2);
    }
}

// n consecutive stored values as float, times scale in an 8-bit format (float32 and bf16 as stored)
static inline void kv_decode(const void *src, int64_t n, int64_t kind, float scale, float *out) {
    if (kind == KV_F32) {
        for (int64_t i = 0; i < n; ++i) out[i] = ((const float *)src)[i];
    } else if (kind == KV_BF16) {
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_value(((const uint16_t *)src)[i]);
    } else if (kind == KV_INT8) {
        for (int64_t i = 0; i < n; ++i) out[i] = (float)((const int8_t *)src)[i] * scale;
    } else {
        const float *table = kv_fp8_values[kind == KV_E4M3 ? 0 : 1];
        for (int64_t i = 0; i < n; ++i) out[i] = table[((const uint8_t *)src)[i]] * scale;
    }
}
