// The decoder layer's elementwise work, fused: each function replaces a chain of 5-20 small torch ops, whose
// per-op dispatch cost dominated the non-GEMM time of a decode step. Each computes the same formula as the torch
// code it replaces in model/llama.py (same operation order; the sums of squares differ in summation order only).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_formats.h"
#include "vec_exp.h"

#define PARALLEL_MIN_ELEMENTS 65536

// out = weight * (x * rsqrt(mean(x^2) + eps)) for one row (out may be x)
static inline void rms_norm_row(const float *x, const float *weight, float eps, float *out, int64_t cols) {
    float part[16] = {0};
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16)
        for (int i = 0; i < 16; ++i) part[i] += x[c + i] * x[c + i];
    for (int i = 0; c < cols; ++c, ++i) part[i] += x[c] * x[c];
    for (int width = 8; width > 0; width /= 2)
        for (int i = 0; i < width; ++i) part[i] += part[i + width];
    const float inv = 1.0f / sqrtf(part[0] / (float)cols + eps);
    for (c = 0; c < cols; ++c) out[c] = weight[c] * (x[c] * inv);
}

// residual += delta (when delta is given); out = weight * (residual * rsqrt(mean(residual^2) + eps)). Without
// delta, out may be residual (a norm in place: Gemma's sandwich norms).
void add_rms_norm(float *residual, const float *delta, int64_t delta_stride, const float *weight, float eps,
                  float *out, int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        float *x = residual + r * cols;
        if (delta)
            for (int64_t c = 0; c < cols; ++c) x[c] += delta[r * delta_stride + c];
        rms_norm_row(x, weight, eps, out + r * cols, cols);
    }
}

// QK-norm in place: each of the `heads` heads of head_dim floats at the start of every row of x (tokens rows of
// `stride` floats: the q or k part of the fused projection) through RMSNorm with `weight` [head_dim]
void rms_norm_heads(float *x, int64_t stride, int64_t tokens, int64_t heads, int64_t head_dim, const float *weight,
                    float eps) {
#pragma omp parallel for if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t i = 0; i < tokens * heads; ++i) {
        float *head = x + (i / heads) * stride + (i % heads) * head_dim;
        rms_norm_row(head, weight, eps, head, head_dim);
    }
}

// Rotate-half RoPE of one head: o[d] = x[d] cos[d] - x[d + half] sin[d], o[d + half] = x[d + half] cos + x[d] sin
static inline void rope(float *o, const float *x, const float *cos_row, const float *sin_row, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t d = 0; d < half; ++d) o[d] = x[d] * cos_row[d] - x[d + half] * sin_row[d];
    for (int64_t d = half; d < head_dim; ++d) o[d] = x[d] * cos_row[d] + x[d - half] * sin_row[d];
}

// float32 -> bf16, rounding to nearest even (as torch's conversion); NaN stays NaN
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// From the fused qkv projection [tokens, (heads + 2 kv_heads) * head_dim] (rows of qkv_stride floats) and the
// cos/sin rows [tokens, head_dim] of each token's position: q with RoPE into q_out [tokens, heads * head_dim];
// k with RoPE and v written to their cache slots (layouts of model/attention.py: K [blocks, kv_heads, head_dim,
// block], V [blocks, kv_heads, block, head_dim]) in the cache's format (kv_formats.h): float32, bf16, or 8 bits
// with each head-vector's scale into k_scale / v_scale [blocks, kv_heads, block]. k_channel (int8 caches, else
// NULL): the keys' channel scales [kv_heads, head_dim], powers of two (model/key_smoothing.py): k is stored
// divided by them and q comes out multiplied by its KV head's, so q.k is unchanged.
void rope_and_cache(const float *qkv, int64_t qkv_stride, int64_t tokens, int64_t heads, int64_t kv_heads,
                    int64_t head_dim, const float *cos_table, const float *sin_table,
                    const int64_t *slots, int64_t block_size, void *k_cache, void *v_cache, uint16_t *k_scale,
                    uint16_t *v_scale, const float *k_channel, float *q_out, int64_t kv_kind) {
    const int64_t group = heads / kv_heads;
#pragma omp parallel for if (tokens * (heads + 2 * kv_heads) * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row = qkv + t * qkv_stride;
        const float *cos_row = cos_table + t * head_dim, *sin_row = sin_table + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            float *q = q_out + (t * heads + h) * head_dim;
            rope(q, row + h * head_dim, cos_row, sin_row, head_dim);
            if (k_channel)
                for (int64_t d = 0; d < head_dim; ++d) q[d] *= k_channel[h / group * head_dim + d];
        }
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        float k[512];
        for (int64_t h = 0; h < kv_heads; ++h) {
            rope(k, row + (heads + h) * head_dim, cos_row, sin_row, head_dim);
            if (k_channel)
                for (int64_t d = 0; d < head_dim; ++d) k[d] /= k_channel[h * head_dim + d];
            const float *v = row + (heads + kv_heads + h) * head_dim;
            const int64_t k_at = (block * kv_heads + h) * head_dim * block_size + offset;  // then + d * block
            const int64_t v_at = ((block * kv_heads + h) * block_size + offset) * head_dim;
            if (kv_scaled(kv_kind)) {
                const int64_t scale_at = (block * kv_heads + h) * block_size + offset;
                k_scale[scale_at] = quantize_kv(k, head_dim, kv_kind, (uint8_t *)k_cache + k_at, block_size);
                v_scale[scale_at] = quantize_kv(v, head_dim, kv_kind, (uint8_t *)v_cache + v_at, 1);
            } else if (kv_kind == KV_BF16) {
                uint16_t *k_dst = (uint16_t *)k_cache + k_at, *v_dst = (uint16_t *)v_cache + v_at;
                for (int64_t d = 0; d < head_dim; ++d) k_dst[d * block_size] = to_bf16(k[d]);
                for (int64_t d = 0; d < head_dim; ++d) v_dst[d] = to_bf16(v[d]);
            } else {
                float *k_dst = (float *)k_cache + k_at, *v_dst = (float *)v_cache + v_at;
                for (int64_t d = 0; d < head_dim; ++d) k_dst[d * block_size] = k[d];
                for (int64_t d = 0; d < head_dim; ++d) v_dst[d] = v[d];
            }
        }
    }
}

// out [rows, n] = silu(gate) * up for gate_up [rows, 2n] (gate first), silu(g) = g / (1 + exp(-g))
void silu_and_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
#pragma omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
#if defined(__AVX512F__)
        for (int64_t j = 0; j < n; j += 16) {  // the tail through a mask: every element takes the same path
            const __mmask16 mask = (__mmask16)(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1);
            const __m512 gv = _mm512_maskz_loadu_ps(mask, g + j), uv = _mm512_maskz_loadu_ps(mask, u + j);
            const __m512 e = exp512_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), uv);
            _mm512_mask_storeu_ps(o + j, mask, y);
        }
#else
        for (int64_t j = 0; j < n; ++j) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
#endif
    }
}

// out [rows, n] = gelu_tanh(gate) * up for gate_up [rows, 2n] (gate first): GeGLU (Gemma), with
// gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))) and tanh(z) = 1 - 2 / (1 + e^(2z))
void gelu_tanh_and_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
#pragma omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), half = _mm512_set1_ps(0.5f);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = (__mmask16)(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1);
            const __m512 gv = _mm512_maskz_loadu_ps(mask, g + j), uv = _mm512_maskz_loadu_ps(mask, u + j);
            const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv);
            const __m512 z = _mm512_mul_ps(_mm512_set1_ps(k), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, gv));
            const __m512 e = exp512_ps(_mm512_mul_ps(two, z));
            const __m512 tanh_z = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(one, e)));
            const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(half, gv), _mm512_add_ps(one, tanh_z)), uv);
            _mm512_mask_storeu_ps(o + j, mask, y);
        }
#else
        for (int64_t j = 0; j < n; ++j) {
            const float z = k * (g[j] + 0.044715f * g[j] * g[j] * g[j]);
            o[j] = 0.5f * g[j] * (1.0f + tanhf(z)) * u[j];
        }
#endif
    }
}
