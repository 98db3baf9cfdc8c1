// Per-row int8 activation quantization for the int8 linear layers (model/int8_linear.py), two levels deep:
//   x ~= q1 * s1 + q2 * s2, with q1 = round(x / s1), s1 = max|x| / 127, and q2 the residual quantized the same
// way. Both levels go through one int8 GEMM (stacked as 2 x rows) and are recombined in `dequantize_two_level`,
// so activations keep ~14 bits where one int8 level loses too much on this model (docs/ARCHITECTURE.md).
// Each row is handled on its own, with the same float operations as the torch fallback in model/int8_linear.py.
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

// The int8 GEMM on AVX512-VNNI hosts. Weights are packed at load (model/int8_linear.py, kernels.pack_vnni) as
// [n/16][k/4][16][4]: one 64-byte vector holds four consecutive k of 16 outputs, so `vpdpbusd` with four
// broadcast activations accumulates 16 outputs per lane and no horizontal sum is needed. The instruction
// multiplies unsigned by signed bytes and can broadcast its signed operand straight from memory: weights are
// stored offset to w + 128 (unsigned), activations stay signed and are broadcast four at a time inside the
// instruction, and 128 * (sum of the activations) is subtracted again. Small batches stream the weights at
// memory speed (oneDNN's `_int_mm` reaches about half of it); large ones are bound by vpdpbusd throughput.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <string.h>

int int8_grouped_available(void) { return 1; }
int int8_pack_lanes(void) { return 16; }
int int8_pack_offset(void) { return 128; }

static inline __m512i broadcast_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);  // folded into vpdpbusd's {1to16} memory operand
}

// Activations quantized per (row, group of 32 consecutive k), one int8 level: llama.cpp's Q8_0 and OpenVINO's
// choice. On the quality gate it keeps 97.6% top-1 agreement with float32 and float32's perplexity, where one
// level per row lost 3.7% perplexity (docs/ARCHITECTURE.md), and it needs a GEMM as tall as the batch, not twice.
// Each group's 32 products are summed exactly in int32 and scaled into a float accumulator group by group, in k
// order, so a row's result depends on nothing but that row.
#define GROUP 32

// x [rows, k] (k a multiple of 32) -> q [rows, k], scales [rows, k/32] (max|x| / 127 of each group) and
// corr [rows, k/32] = 128 * the group's sum of q (the +128 weight offset, subtracted again in the GEMM)
void quantize_groups(const float *x, int64_t rows, int64_t k, int64_t x_stride, int8_t *q, float *scales,
                     int32_t *corr) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for if (rows * k >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + r * x_stride + g * GROUP;
            const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            const float s = row_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))));
            const __m512 sv = _mm512_set1_ps(s);
            // x / s rounded to nearest even (the default MXCSR mode): torch.round(x / s) in model/int8_linear.py
            const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, sv)), qb = _mm512_cvtps_epi32(_mm512_div_ps(b, sv));
            _mm_storeu_si128((__m128i *)(q + r * k + g * GROUP), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(q + r * k + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
            scales[r * groups + g] = s;
            corr[r * groups + g] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        }
}

// ROWS rows against one block of 16 outputs: per group, an int32 sum over its 8 quads started at -corr, then
// facc += float(sum) * scale. Groups are independent chains, so out-of-order execution overlaps them even for
// one row.
#define GROUP_BLOCK(ROWS)                                                                                          \
    static inline void group_block_##ROWS(const int8_t *q, const float *scales, const int32_t *corr,              \
                                          const int8_t *wb, int64_t groups, int64_t k, __m512 *facc) {            \
        for (int i = 0; i < ROWS; ++i) facc[i] = _mm512_setzero_ps();                                              \
        for (int64_t g = 0; g < groups; ++g) {                                                                     \
            __m512i acc[ROWS];                                                                                     \
            for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_set1_epi32(-corr[i * groups + g]);                      \
            for (int c = 0; c < GROUP / 4; ++c) {                                                                  \
                const __m512i w = _mm512_loadu_si512(wb + (g * (GROUP / 4) + c) * 64);                            \
                for (int i = 0; i < ROWS; ++i)                                                                     \
                    acc[i] = _mm512_dpbusd_epi32(acc[i], w, broadcast_quad(q + i * k + g * GROUP + 4 * c));       \
            }                                                                                                      \
            for (int i = 0; i < ROWS; ++i)                                                                         \
                facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_set1_ps(scales[i * groups + g]),     \
                                          facc[i]);                                                                \
        }                                                                                                          \
    }
GROUP_BLOCK(1)
GROUP_BLOCK(2)
GROUP_BLOCK(3)
GROUP_BLOCK(4)
GROUP_BLOCK(5)
GROUP_BLOCK(6)
GROUP_BLOCK(7)
GROUP_BLOCK(8)

// The int8 linear with grouped activations: out [rows, n] = (sum_g float(q_g . w_g) * scale_g) * weight_scale
// (+ bias), weights packed by pack_vnni. Any number of rows (prefill chunks too: one path keeps every batch
// shape bit-identical).
void int8_linear_grouped(const float *x, int64_t rows, int64_t k, int64_t x_stride, const int8_t *w_packed,
                         const float *weight_scale, const float *bias, float *out, int64_t n) {
    const int64_t groups = k / GROUP, blocks = (n + 15) / 16;
    int8_t *q = malloc((size_t)(rows * k));
    float *scales = malloc(sizeof(float) * (size_t)(rows * groups));
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)(rows * groups));
    quantize_groups(x, rows, k, x_stride, q, scales, corr);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int8_t *wb = w_packed + b * (k / 4) * 64;
        const int64_t left = n - b * 16;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 ws = _mm512_maskz_loadu_ps(mask, weight_scale + b * 16);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + b * 16) : _mm512_setzero_ps();
        __m512 facc[8];
        for (int64_t r = 0; r < rows;) {
            // up to 8 rows share each weight load, in blocks of near-equal size (9 rows: 5 + 4, not 8 + 1: a lone
            // row in a block of its own costs about three rows of a full one; speculative verify steps are 5 or 9)
            const int64_t blocks_left = (rows - r + 7) / 8, step = (rows - r + blocks_left - 1) / blocks_left;
            const int8_t *qr = q + r * k;
            const float *sr = scales + r * groups;
            const int32_t *cr = corr + r * groups;
            switch (step) {
                case 8: group_block_8(qr, sr, cr, wb, groups, k, facc); break;
                case 7: group_block_7(qr, sr, cr, wb, groups, k, facc); break;
                case 6: group_block_6(qr, sr, cr, wb, groups, k, facc); break;
                case 5: group_block_5(qr, sr, cr, wb, groups, k, facc); break;
                case 4: group_block_4(qr, sr, cr, wb, groups, k, facc); break;
                case 3: group_block_3(qr, sr, cr, wb, groups, k, facc); break;
                case 2: group_block_2(qr, sr, cr, wb, groups, k, facc); break;
                default: group_block_1(qr, sr, cr, wb, groups, k, facc); break;
            }
            for (int64_t i = 0; i < step; ++i) {
                __m512 y = _mm512_mul_ps(facc[i], ws);
                if (bias) y = _mm512_add_ps(y, bv);
                _mm512_mask_storeu_ps(out + (r + i) * n + b * 16, mask, y);
            }
            r += step;
        }
    }
    free(q);
    free(scales);
    free(corr);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_exp.h"  // hmax8
// The same grouped int8 linear on AVX2 hosts (no VNNI): weights packed as [n/8][k/4][8][4] signed bytes (no
// offset). Four products of one output are summed in int32 by llama.cpp's sign trick: maddubs(|x|, w * sign(x))
// multiplies unsigned by signed bytes into int16 pairs (|x|, |w| <= 127, so a pair never saturates), madd sums
// the pairs into int32. The group sums are exact, so every output equals the AVX512-VNNI kernel's bit for bit:
// the float operations after them (convert, one fused multiply-add per group in k order, the channel scale)
// are the same.
#include <immintrin.h>
#include <string.h>

int int8_grouped_available(void) { return 1; }
int int8_pack_lanes(void) { return 8; }
int int8_pack_offset(void) { return 0; }

#define GROUP 32


static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// x [rows, k] (k a multiple of 32) -> q [rows, k], scales [rows, k/32], corr [rows, k/32] = 128 * group sum
// (the VNNI kernel's offset term, kept so both kernels give the same three outputs)
void quantize_groups(const float *x, int64_t rows, int64_t k, int64_t x_stride, int8_t *q, float *scales,
                     int32_t *corr) {
    const int64_t groups = k / GROUP;
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
#pragma omp parallel for if (rows * k >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + r * x_stride + g * GROUP;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int j = 0; j < 4; ++j) {
                v[j] = _mm256_loadu_ps(xg + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[j]));
            }
            const float s = row_scale(hmax8(amax));
            const __m256 sv = _mm256_set1_ps(s);
            __m256i sum = _mm256_setzero_si256();
            int8_t *qg = q + r * k + g * GROUP;
            for (int j = 0; j < 4; ++j) {
                // x / s rounded to nearest even (the default MXCSR mode): torch.round(x / s) in model/int8_linear.py
                const __m256i level = _mm256_cvtps_epi32(_mm256_div_ps(v[j], sv));
                sum = _mm256_add_epi32(sum, level);
                int32_t lanes[8];
                _mm256_storeu_si256((__m256i *)lanes, level);
                for (int t = 0; t < 8; ++t) qg[8 * j + t] = (int8_t)lanes[t];
            }
            scales[r * groups + g] = s;
            corr[r * groups + g] = 128 * hsum8_epi32(sum);
        }
}

// acc + the 8 outputs' sums of 4 products of w with the 4 activations at x4 (exact in int32 either way)
static inline __m256i dot_quad(__m256i acc, __m256i w, const int8_t *x4) {
    int32_t v;
    memcpy(&v, x4, 4);
    const __m256i xq = _mm256_set1_epi32(v);
#if defined(__AVXVNNI__)  // Alder Lake and later, Zen 5: the VEX vpdpbusd sums the four products at once
    return _mm256_dpbusd_avx_epi32(acc, _mm256_abs_epi8(xq), _mm256_sign_epi8(w, xq));
#else
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(xq), _mm256_sign_epi8(w, xq));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// ROWS rows against one block of 8 outputs: per group an exact int32 sum over its 8 quads, then
// facc += float(sum) * scale, as in the VNNI kernel.
#define GROUP_BLOCK(ROWS)                                                                                          \
    static inline void group_block_##ROWS(const int8_t *q, const float *scales, const int8_t *wb, int64_t groups, \
                                          int64_t k, __m256 *facc) {                                               \
        for (int i = 0; i < ROWS; ++i) facc[i] = _mm256_setzero_ps();                                              \
        for (int64_t g = 0; g < groups; ++g) {                                                                     \
            __m256i acc[ROWS];                                                                                     \
            for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_setzero_si256();                                        \
            for (int c = 0; c < GROUP / 4; ++c) {                                                                  \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + (g * (GROUP / 4) + c) * 32));          \
                for (int i = 0; i < ROWS; ++i)                                                                     \
                    acc[i] = dot_quad(acc[i], w, q + i * k + g * GROUP + 4 * c);                                  \
            }                                                                                                      \
            for (int i = 0; i < ROWS; ++i)                                                                         \
                facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_set1_ps(scales[i * groups + g]),     \
                                          facc[i]);                                                                \
        }                                                                                                          \
    }
GROUP_BLOCK(1)
GROUP_BLOCK(2)
GROUP_BLOCK(3)
GROUP_BLOCK(4)

void int8_linear_grouped(const float *x, int64_t rows, int64_t k, int64_t x_stride, const int8_t *w_packed,
                         const float *weight_scale, const float *bias, float *out, int64_t n) {
    const int64_t groups = k / GROUP, blocks = (n + 7) / 8;
    int8_t *q = malloc((size_t)(rows * k));
    float *scales = malloc(sizeof(float) * (size_t)(rows * groups));
    int32_t *corr = malloc(sizeof(int32_t) * (size_t)(rows * groups));
    quantize_groups(x, rows, k, x_stride, q, scales, corr);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int8_t *wb = w_packed + b * (k / 4) * 32;
        const int64_t left = n - b * 8, width = left < 8 ? left : 8;
        float ws[8] = {0}, bv[8] = {0};
        memcpy(ws, weight_scale + b * 8, sizeof(float) * (size_t)width);
        if (bias) memcpy(bv, bias + b * 8, sizeof(float) * (size_t)width);
        const __m256 wsv = _mm256_loadu_ps(ws), bvv = _mm256_loadu_ps(bv);
        __m256 facc[4];
        for (int64_t r = 0; r < rows;) {
            // up to 4 rows share each weight load, in blocks of near-equal size (as the VNNI kernel's 8)
            const int64_t blocks_left = (rows - r + 3) / 4, step = (rows - r + blocks_left - 1) / blocks_left;
            const int8_t *qr = q + r * k;
            const float *sr = scales + r * groups;
            switch (step) {
                case 4: group_block_4(qr, sr, wb, groups, k, facc); break;
                case 3: group_block_3(qr, sr, wb, groups, k, facc); break;
                case 2: group_block_2(qr, sr, wb, groups, k, facc); break;
                default: group_block_1(qr, sr, wb, groups, k, facc); break;
            }
            for (int64_t i = 0; i < step; ++i) {
                __m256 y = _mm256_mul_ps(facc[i], wsv);
                if (bias) y = _mm256_add_ps(y, bvv);
                float lanes[8];
                _mm256_storeu_ps(lanes, y);
                memcpy(out + (r + i) * n + b * 8, lanes, sizeof(float) * (size_t)width);
            }
            r += step;
        }
    }
    free(q);
    free(scales);
    free(corr);
}
#else
int int8_grouped_available(void) { return 0; }
int int8_pack_lanes(void) { return 0; }
int int8_pack_offset(void) { return 0; }

void quantize_groups(const float *x, int64_t rows, int64_t k, int64_t x_stride, int8_t *q, float *scales,
                     int32_t *corr) {
    (void)x, (void)rows, (void)k, (void)x_stride, (void)q, (void)scales, (void)corr;
}

void int8_linear_grouped(const float *x, int64_t rows, int64_t k, int64_t x_stride, const int8_t *w_packed,
                         const float *weight_scale, const float *bias, float *out, int64_t n) {
    (void)x, (void)rows, (void)k, (void)x_stride, (void)w_packed, (void)weight_scale, (void)bias, (void)out,
        (void)n;
}
#endif

/* int8 weight [n, k] -> the packed layout [ceil(n/L), k/4, L, 4] the grouped kernel reads (L, offset: this ISA's
 * int8_pack_lanes and int8_pack_offset; rows past n are zero weights). One pass, parallel over row groups. */
void int8_pack(const int8_t *w, int64_t n, int64_t k, int8_t *out) {
    int64_t lanes = int8_pack_lanes(), groups = (n + lanes - 1) / lanes;
    uint8_t offset = (uint8_t)int8_pack_offset();
    if (lanes == 0) return;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        int8_t *dst = out + g * k * lanes;
        for (int64_t quad = 0; quad < k / 4; quad++) {
            for (int64_t lane = 0; lane < lanes; lane++) {
                int64_t row = g * lanes + lane;
                for (int b = 0; b < 4; b++) {
                    int8_t v = row < n ? w[row * k + quad * 4 + b] : 0;
                    *dst++ = (int8_t)((uint8_t)v ^ offset);
                }
            }
        }
    }
}
