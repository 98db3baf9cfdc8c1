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
