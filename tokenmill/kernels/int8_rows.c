// Per-row int8 activation quantization for the int8 linear layers (model/quant.py), two levels deep:
//   x ~= q1 * s1 + q2 * s2, with q1 = round(x / s1), s1 = max|x| / 127, and q2 the residual quantized the same
// way. Both levels go through one int8 GEMM (stacked as 2 x rows) and are recombined in `dequantize_two_level`,
// so activations keep ~14 bits where one int8 level loses too much on this model (docs/ARCHITECTURE.md).
// Each row is handled on its own, with the same float operations as the torch fallback in model/quant.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

// Exact int8 GEMM for up to a few dozen rows: out[r, j] = sum_c q[r, c] * w[j, c] in int32. Decode steps at
// small batch are bound by streaming the weights; oneDNN's `_int_mm` reaches about half the memory bandwidth
// there, this kernel nearly all of it (benchmarks/bench_kernels.py). Integer sums are exact, so both give
// identical results and the caller may choose by row count.
//
// Weights are packed at load (model/quant.py: pack_vnni) as [n/16][k/4][16][4]: one 64-byte vector holds four
// consecutive k of 16 outputs, so `vpdpbusd` with four broadcast activations accumulates 16 outputs per lane and
// no horizontal sum is needed. The instruction multiplies unsigned by signed bytes and can broadcast its signed
// operand straight from memory: weights are stored offset to w + 128 (unsigned), activations stay signed and
// are broadcast four at a time inside the instruction, and 128 * sum_c q[r, c] is subtracted again. One
// instruction per 4 x 16 multiply-adds, so a few rows cost what one costs: the weights' streaming dominates.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <string.h>

int int8_gemm_packed_available(void) { return 1; }

static inline __m512i broadcast_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);  // folded into vpdpbusd's {1to16} memory operand
}

// ROWS activation rows against one block of 16 outputs; `corr` holds 128 * sum_c q[r, c] per row. Each row
// keeps SPLIT accumulators (quads c = s mod SPLIT), so every block runs 8 independent dpbusd chains: with fewer,
// the instruction's latency, not its throughput, would set the pace (1-2 rows: a decode step).
#define ROW_BLOCK(ROWS, SPLIT)                                                                                    \
    static inline void row_block_##ROWS(const int8_t *q, const int32_t *corr, const int8_t *wb, int64_t quads,  \
                                        __mmask16 mask, int32_t *out, int64_t k, int64_t n) {                    \
        __m512i acc[ROWS][SPLIT];                                                                                \
        for (int i = 0; i < ROWS; ++i)                                                                           \
            for (int s = 0; s < SPLIT; ++s) acc[i][s] = _mm512_setzero_si512();                                  \
        int64_t c = 0;                                                                                           \
        for (; c + SPLIT <= quads; c += SPLIT)                                                                   \
            for (int s = 0; s < SPLIT; ++s) {                                                                    \
                const __m512i w = _mm512_loadu_si512(wb + (c + s) * 64);                                         \
                for (int i = 0; i < ROWS; ++i)                                                                   \
                    acc[i][s] = _mm512_dpbusd_epi32(acc[i][s], w, broadcast_quad(q + i * k + 4 * (c + s)));      \
            }                                                                                                    \
        for (; c < quads; ++c) {                                                                                 \
            const __m512i w = _mm512_loadu_si512(wb + c * 64);                                                   \
            for (int i = 0; i < ROWS; ++i)                                                                       \
                acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w, broadcast_quad(q + i * k + 4 * c));                \
        }                                                                                                        \
        for (int i = 0; i < ROWS; ++i) {                                                                         \
            __m512i sum = _mm512_set1_epi32(-corr[i]);                                                           \
            for (int s = 0; s < SPLIT; ++s) sum = _mm512_add_epi32(sum, acc[i][s]);                              \
            _mm512_mask_storeu_epi32(out + i * n, mask, sum);                                                    \
        }                                                                                                        \
    }
ROW_BLOCK(1, 8)
ROW_BLOCK(2, 4)
ROW_BLOCK(4, 2)
ROW_BLOCK(8, 1)

// q [rows, k] (k a multiple of 4), w_packed [ceil(n/16)][k/4][16][4] holding w + 128, out [rows, n]
void int8_gemm_packed(const int8_t *q, const int8_t *w_packed, int32_t *out, int64_t rows, int64_t n, int64_t k) {
    const int64_t quads = k / 4, blocks = (n + 15) / 16;
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)(rows > 0 ? rows : 1));
    for (int64_t r = 0; r < rows; ++r) {
        int32_t sum = 0;
        for (int64_t c = 0; c < k; ++c) sum += q[r * k + c];
        corr[r] = 128 * sum;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int8_t *wb = w_packed + b * quads * 64;
        const int64_t left = n - b * 16;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        int32_t *ob = out + b * 16;
        int64_t r = 0;
        for (; rows - r >= 8; r += 8) row_block_8(q + r * k, corr + r, wb, quads, mask, ob + r * n, k, n);
        if (rows - r >= 4) row_block_4(q + r * k, corr + r, wb, quads, mask, ob + r * n, k, n), r += 4;
        if (rows - r >= 2) row_block_2(q + r * k, corr + r, wb, quads, mask, ob + r * n, k, n), r += 2;
        if (rows - r >= 1) row_block_1(q + r * k, corr + r, wb, quads, mask, ob + r * n, k, n);
    }
    free(corr);
}
// The whole int8 linear for a few rows in one call (quantize, packed GEMM, dequantize): at batch 1 the three
// separate calls and their buffers cost as much as the GEMM itself.
void int8_linear_packed(const float *x, int64_t rows, int64_t k, int64_t x_stride, const int8_t *w_packed,
                        const float *weight_scale, const float *bias, float *out, int64_t n) {
    int8_t *q = malloc((size_t)(2 * rows * k));
    float *scales = malloc(sizeof(float) * (size_t)(2 * rows));
    int32_t *acc = malloc(sizeof(int32_t) * (size_t)(2 * rows * n));
    quantize_two_level(x, rows, k, x_stride, q, scales);
    int8_gemm_packed(q, w_packed, acc, 2 * rows, n, k);
    dequantize_two_level(acc, rows, n, scales, weight_scale, bias, out);
    free(q);
    free(scales);
    free(acc);
}
#else
int int8_gemm_packed_available(void) { return 0; }

void int8_linear_packed(const float *x, int64_t rows, int64_t k, int64_t x_stride, const int8_t *w_packed,
                        const float *weight_scale, const float *bias, float *out, int64_t n) {
    (void)x, (void)rows, (void)k, (void)x_stride, (void)w_packed, (void)weight_scale, (void)bias, (void)out,
        (void)n;
}

void int8_gemm_packed(const int8_t *q, const int8_t *w_packed, int32_t *out, int64_t rows, int64_t n, int64_t k) {
    (void)q, (void)w_packed, (void)out, (void)rows, (void)n, (void)k;
}
#endif
