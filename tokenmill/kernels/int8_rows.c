// Per-row int8 activation quantization for the int8 linear layers (model/quant.py), two levels deep:
//   x ~= q1 * s1 + q2 * s2, with q1 = round(x / s1), s1 = max|x| / 127, and q2 the residual quantized the same
// way. Both levels go through one int8 GEMM (stacked as 2 x rows) and are recombined in `dequantize_two_level`,
// so activations keep ~14 bits where one int8 level loses too much on this model (docs/ARCHITECTURE.md).
// Each row is handled on its own, with the same float operations as the torch fallback in model/quant.py.
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMENTS 65536

static inline float row_scale(float amax) { return fmaxf(amax, 1e-10f) / 127.0f; }

void quantize_two_level(const float *x, int64_t rows, int64_t cols, int64_t x_stride, int8_t *q, float *scales) {
#pragma omp parallel for if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        int8_t *q1 = q + r * cols, *q2 = q + (rows + r) * cols;
        float amax = 0.0f;
        for (int64_t c = 0; c < cols; ++c) amax = fmaxf(amax, fabsf(xr[c]));
        const float s1 = row_scale(amax);
        float residual_max = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
            const float level = nearbyintf(xr[c] / s1);
            q1[c] = (int8_t)level;
            residual_max = fmaxf(residual_max, fabsf(xr[c] - level * s1));
        }
        const float s2 = row_scale(residual_max);
        for (int64_t c = 0; c < cols; ++c) {
            const float residual = xr[c] - nearbyintf(xr[c] / s1) * s1;
            q2[c] = (int8_t)nearbyintf(residual / s2);
        }
        scales[r] = s1;
        scales[rows + r] = s2;
    }
}

// out[r, j] = (acc[r, j] * s1[r] + acc[rows + r, j] * s2[r]) * weight_scale[j] (+ bias[j])
void dequantize_two_level(const int32_t *acc, int64_t rows, int64_t n, const float *scales,
                          const float *weight_scale, const float *bias, float *out) {
#pragma omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const int32_t *a1 = acc + r * n, *a2 = acc + (rows + r) * n;
        const float s1 = scales[r], s2 = scales[rows + r];
        float *o = out + r * n;
        for (int64_t j = 0; j < n; ++j) {
            const float y = ((float)a1[j] * s1 + (float)a2[j] * s2) * weight_scale[j];
            o[j] = bias ? y + bias[j] : y;
        }
    }
}

// Exact int8 GEMM for a few rows: out[m, n] = sum_k q[m, k] * w[n, k] in int32. Decode steps at small batch
// are bound by streaming the weights once; oneDNN's `_int_mm` reaches about half the memory bandwidth there.
// Integer sums are exact, so this and `_int_mm` give identical results and can be chosen by row count.
// AVX512-VNNI's dot product is unsigned x signed: q is offset to q + 128 (xor 0x80) and 128 * sum_k w[n, k]
// (`w_sum128`, computed at load) is subtracted again.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

int int8_gemm_small_available(void) { return 1; }

void int8_gemm_small(const int8_t *q, const int8_t *w, const int32_t *w_sum128, int32_t *out, int64_t rows,
                     int64_t n, int64_t k) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < n; n0 += 4) {
        const int64_t count = n - n0 < 4 ? n - n0 : 4;
        for (int64_t r = 0; r < rows; ++r) {
            __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                              _mm512_setzero_si512()};
            for (int64_t c = 0; c < k; c += 64) {
                const __mmask64 mask = k - c >= 64 ? ~0ULL : ((1ULL << (k - c)) - 1);
                // masked-off lanes: q 0 -> 128, w 0: their product is 0
                const __m512i x = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, q + r * k + c), flip);
                for (int64_t j = 0; j < count; ++j)
                    acc[j] = _mm512_dpbusd_epi32(acc[j], x, _mm512_maskz_loadu_epi8(mask, w + (n0 + j) * k + c));
            }
            for (int64_t j = 0; j < count; ++j)
                out[r * n + n0 + j] = _mm512_reduce_add_epi32(acc[j]) - w_sum128[n0 + j];
        }
    }
}
#else
int int8_gemm_small_available(void) { return 0; }

void int8_gemm_small(const int8_t *q, const int8_t *w, const int32_t *w_sum128, int32_t *out, int64_t rows,
                     int64_t n, int64_t k) {
    (void)q, (void)w, (void)w_sum128, (void)out, (void)rows, (void)n, (void)k;
}
#endif
