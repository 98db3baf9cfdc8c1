// Paged attention on CPU over one flat batch of prompt chunks and decodes. Keys and values are read in place
// from each sequence's block table (no gathered copy of the context).
//
// Cache layout (model/attention.py): K [num_blocks, num_kv_heads, head_dim, block_size] (each block's keys
// transposed, so one block's scores are a vector over its tokens) and V [num_blocks, num_kv_heads, block_size,
// head_dim], as float32, bf16 or an 8-bit format with a bf16 scale per token and KV head ([num_blocks,
// num_kv_heads, block_size]; kv_formats.h). 8-bit values are dequantized in registers (AVX-512) or a block at
// a time into an L1 tile (the generic path): never a float copy of the cache.
//
// Every query row is computed by the same sequence of float operations, whatever its batch: keys in block
// order, an online softmax updated once per key block, each score a sequential sum over head_dim (vectorized
// across the block's tokens, never reassociated), fused multiply-adds only where written (built with
// -ffp-contract=off). So a token's attention output is bit-identical whether it is computed alone, in a prompt
// chunk of any size, or as a decode next to other sequences; with exact int8 GEMMs that makes whole steps
// batch-invariant.
//
// Built at first use by tokenmill/kernels/__init__.py; OpenMP resolves to the libgomp that torch already
// loaded (same soname), so both share one thread pool.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_formats.h"
#include "vec_exp.h"

#define MAX_TILE 64  // (query rows x heads per kv head) handled by one task
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

// scores[r][t] = sum_d q_r[d] * k[d][t] for `rows` query rows over one block (kt: [head_dim][block]).
// Rows are taken four at a time so each loaded key vector feeds four independent accumulator chains; the
// operations of any one row are the same whichever group it falls in.
static void block_scores(float scores[][MAX_BLOCK], const float *const *q, int64_t rows, const float *kt,
                         int64_t head_dim, int64_t block) {
    int64_t r = 0;
    if (block == 16) {
        for (; r + 4 <= rows; r += 4) {
            float s0[16] = {0}, s1[16] = {0}, s2[16] = {0}, s3[16] = {0};
            for (int64_t d = 0; d < head_dim; ++d) {
                const float *k = kt + d * 16;
                const float a = q[r][d], b = q[r + 1][d], c = q[r + 2][d], e = q[r + 3][d];
                for (int t = 0; t < 16; ++t) {
                    s0[t] = fmaf(a, k[t], s0[t]);
                    s1[t] = fmaf(b, k[t], s1[t]);
                    s2[t] = fmaf(c, k[t], s2[t]);
                    s3[t] = fmaf(e, k[t], s3[t]);
                }
            }
            memcpy(scores[r], s0, sizeof s0);
            memcpy(scores[r + 1], s1, sizeof s1);
            memcpy(scores[r + 2], s2, sizeof s2);
            memcpy(scores[r + 3], s3, sizeof s3);
        }
        for (; r < rows; ++r) {
            float s0[16] = {0};
            for (int64_t d = 0; d < head_dim; ++d)
                for (int t = 0; t < 16; ++t) s0[t] = fmaf(q[r][d], kt[d * 16 + t], s0[t]);
            memcpy(scores[r], s0, sizeof s0);
        }
        return;
    }
    for (; r < rows; ++r) {
        float *s = scores[r];
        for (int64_t t = 0; t < block; ++t) s[t] = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d)
            for (int64_t t = 0; t < block; ++t) s[t] = fmaf(q[r][d], kt[d * block + t], s[t]);
    }
}

// acc = acc * correction + sum_t p[t] v[t], in registers for the common head_dim of 64 (same operations as
// the generic loop).
static inline void accumulate64(float *acc, float correction, const float *p, const float *v, int64_t n) {
    float a[64];
    for (int d = 0; d < 64; ++d) a[d] = acc[d] * correction;
    for (int64_t t = 0; t < n; ++t)
        for (int d = 0; d < 64; ++d) a[d] = fmaf(p[t], v[t * 64 + d], a[d]);
    memcpy(acc, a, sizeof a);
}

// A query row in int8 for the integer scores over an int8 cache: q ~= scale * q8, four values a word (the
// operand vpdpbusd broadcasts), and 128 * sum(q8), taken back from the sums of (k + 128) * q8.
typedef struct {
    int32_t q4[MAX_HEAD_DIM / 4];
    float scale;
    int32_t correction;
} QuantRow;

static void quantize_query(const float *q, int64_t head_dim, QuantRow *row) {
    float amax = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
    row->scale = amax / 127.0f;
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t *bytes = (int8_t *)row->q4;
    int32_t sum = 0;
    for (int64_t d = 0; d < head_dim; ++d) {
        bytes[d] = (int8_t)nearbyintf(q[d] * inverse);
        sum += bytes[d];
    }
    row->correction = 128 * sum;
}


#if defined(__AVX512F__)
// Blocks of 16 tokens and head_dim a multiple of 64 in AVX-512, with float32 or bf16 caches: one block's 16
// scores of a row are one register. Per row and block: each score a dot product over head_dim in four
// interleaved partial sums ((p0 + p1) + (p2 + p3)), the block max and sum as fixed-order register reductions,
// e^x by exp512_ps, then acc = acc * correction + sum_t p[t] v[t]. Every row goes through exactly these
// operations whatever its tile, so batch invariance holds as in the generic path (whose operation order
// differs: the two paths are never mixed on one machine). bf16 values widen exactly to float32; all arithmetic
// is float32.
int paged_attention_bf16_available(void) { return 1; }

// 16 consecutive stored values as float32: exact for float32/bf16; an 8-bit value before its scale (e4m3
// through its float16 bit pattern, which is the value / 256: kv_scale16 puts the 256 back)
static inline __attribute__((always_inline)) __m512 load_kv(const void *base, int64_t index, const int kind) {
    if (kind == KV_BF16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    if (kind == KV_F32) return _mm512_loadu_ps((const float *)base + index);
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)base + index));
    if (kind == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    const __m256i wide = _mm256_cvtepu8_epi16(raw);
    if (kind == KV_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(wide, 8));  // e5m2 is float16's high byte
    const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7f)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
}

// the 16 tokens' scales of an 8-bit block (bf16 widened), times 256 for e4m3 (see load_kv)
static inline __attribute__((always_inline)) __m512 kv_scale16(const uint16_t *scales, const int kind) {
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)scales)), 16));
    return kind == KV_E4M3 ? _mm512_mul_ps(s, _mm512_set1_ps(256.0f)) : s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// Integer scores over int8 keys (AVX512-VNNI): each score an exact int32 sum over head_dim, so a row's scores
// do not depend on the rows beside it, then scaled by its query's and the key's scales.
#define INT8_SCORES 1
int paged_attention_int8_scores(void) { return 1; }
static inline __attribute__((always_inline)) void block_scores16_int8(float out[][MAX_BLOCK], const QuantRow *rows,
                                                                      int n_rows, const int8_t *kt,
                                                                      const uint16_t *ks, int64_t head_dim,
                                                                      const char *next_k, const char *next_v) {
    // bytes (d + j, t) of 4 key rows [4][16] -> per token t its 4 values (the word vpdpbusd takes)
    static const uint8_t interleave[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
        6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
        12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    const __m512i index = _mm512_loadu_si512(interleave);
    const __m512i bias = _mm512_set1_epi8((char)0x80);  // k + 128: vpdpbusd's unsigned operand
    const __m512 key_scales = kv_scale16(ks, KV_INT8);
    for (int r0 = 0; r0 < n_rows; r0 += 8) {
        const int count = n_rows - r0 < 8 ? n_rows - r0 : 8;
        __m512i acc[8];
        for (int r = 0; r < count; ++r) acc[r] = _mm512_setzero_si512();
        for (int64_t g = 0; g < head_dim / 4; ++g) {
            if (next_k != NULL && r0 == 0) {  // a line of a later block's K and V per step (see block_scores16)
                _mm_prefetch(next_k + g * 64, PF_HINT);
                _mm_prefetch(next_v + g * 64, PF_HINT);
            }
            const __m512i k = _mm512_xor_si512(
                _mm512_permutexvar_epi8(index, _mm512_loadu_si512(kt + g * 64)), bias);
            for (int r = 0; r < count; ++r)
                acc[r] = _mm512_dpbusd_epi32(acc[r], k, _mm512_set1_epi32(rows[r0 + r].q4[g]));
        }
        for (int r = 0; r < count; ++r) {
            const __m512 dot = _mm512_cvtepi32_ps(
                _mm512_sub_epi32(acc[r], _mm512_set1_epi32(rows[r0 + r].correction)));
            _mm512_storeu_ps(out[r0 + r], _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(rows[r0 + r].scale)),
                                                        key_scales));
        }
    }
}

// acc[r] = acc[r] * corr[r] + sum_t w_r[t] v[t] over an int8 block for up to 8 rows, the weights w_r (softmax
// numerators times the values' scales, >= 0) rounded to 8 bits against their row's largest in the block, so
// that each output is an exact int32 sum over the block's 16 values (vpdpbusd, four tokens a lane), scaled once.
static inline __attribute__((always_inline)) void accumulate_rows_int8(float acc[][MAX_HEAD_DIM],
                                                                       const float *corr, float w[][MAX_BLOCK],
                                                                       const int rows, const int8_t *vb,
                                                                       int64_t head_dim) {
    static const uint8_t interleave[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
        6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
        12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    const __m512i index = _mm512_loadu_si512(interleave);
    int32_t w8[8][4];  // each row's 16 weights as bytes, four tokens a word
    float w_scale[8];
    for (int r = 0; r < rows; ++r) {
        const __m512 wv = _mm512_loadu_ps(w[r]);
        const float w_max = _mm512_reduce_max_ps(wv);
        w_scale[r] = w_max / 255.0f;
        const __m512 inverse = _mm512_set1_ps(w_max > 0.0f ? 255.0f / w_max : 0.0f);
        _mm_storeu_si128((__m128i *)w8[r], _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(wv, inverse))));
    }
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512i sums[8];
        for (int r = 0; r < rows; ++r) sums[r] = _mm512_setzero_si512();
        for (int g = 0; g < 4; ++g) {  // tokens 4g .. 4g + 3: their 16 values at d each
            const int8_t *v = vb + 4 * g * head_dim + d;
            __m512i four = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)v));
            four = _mm512_inserti32x4(four, _mm_loadu_si128((const __m128i *)(v + head_dim)), 1);
            four = _mm512_inserti32x4(four, _mm_loadu_si128((const __m128i *)(v + 2 * head_dim)), 2);
            four = _mm512_inserti32x4(four, _mm_loadu_si128((const __m128i *)(v + 3 * head_dim)), 3);
            const __m512i values = _mm512_permutexvar_epi8(index, four);
            for (int r = 0; r < rows; ++r)
                sums[r] = _mm512_dpbusd_epi32(sums[r], _mm512_set1_epi32(w8[r][g]), values);
        }
        for (int r = 0; r < rows; ++r) {
            const __m512 kept = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d), _mm512_set1_ps(corr[r]));
            _mm512_storeu_ps(acc[r] + d, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(w_scale[r]),
                                                         kept));
        }
    }
}
#endif

// `next_k`/`next_v` (or NULL): a later block's K and V, fetched a line or two per step of the loop (as much
// as the step reads of this block): issued all at once, the prefetches fill the core's miss buffers and stall it.
// An 8-bit block's scores are the dot products of the stored values times the keys' scales (`ks`).
static inline __attribute__((always_inline)) void block_scores16(float out[][MAX_BLOCK], const float *const *q,
                                                                 const void *kt, const uint16_t *ks,
                                                                 int64_t head_dim, const int rows, const int kind,
                                                                 const char *next_k, const char *next_v) {
    const int64_t elem = kv_elem_bytes(kind);
    __m512 a[4][4];
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 4) {
        if (next_k != NULL)
            for (int64_t at = d * 16 * elem; at < (d + 4) * 16 * elem; at += 64) {
                _mm_prefetch(next_k + at, PF_HINT);
                _mm_prefetch(next_v + at, PF_HINT);
            }
        for (int j = 0; j < 4; ++j) {
            const __m512 k = load_kv(kt, (d + j) * 16, kind);
            for (int r = 0; r < rows; ++r) a[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d + j]), k, a[r][j]);
        }
    }
    for (int r = 0; r < rows; ++r) {
        const __m512 dot = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
        _mm512_storeu_ps(out[r], kv_scaled(kind) ? _mm512_mul_ps(dot, kv_scale16(ks, kind)) : dot);
    }
}

// acc[r] = acc[r] * corr[r] + sum_{t < n} p_r[t] v[t] for up to 8 rows at once, 16 dims at a time, so each V
// vector is loaded (and widened) once for all of them. A row's p is 0 past its own keys and those slots hold this
// step's (finite) values, so the extra terms add exactly 0: a row's result does not depend on the rows beside it.
static inline __attribute__((always_inline)) void accumulate_rows(float acc[][MAX_HEAD_DIM], const float *corr,
                                                                  float s[][MAX_BLOCK], const int rows, int n,
                                                                  const void *vb, int64_t head_dim, const int kind) {
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 a[8];
        for (int r = 0; r < rows; ++r) a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d), _mm512_set1_ps(corr[r]));
        for (int t = 0; t < n; ++t) {
            const __m512 v = load_kv(vb, t * head_dim + d, kind);
            for (int r = 0; r < rows; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[r][t]), v, a[r]);
        }
        for (int r = 0; r < rows; ++r) _mm512_storeu_ps(acc[r] + d, a[r]);
    }
}

// `ks`, `vs`: the block's K and V scales (8-bit formats; else unused). The softmax weights of an 8-bit block
// are multiplied by the values' scales once the row's sum has taken them.
static inline __attribute__((always_inline)) void attend_block16(
    float acc[][MAX_HEAD_DIM], float *m, float l[][16], float s[][MAX_BLOCK], const float *const *qs, const int64_t *len,
    const int64_t *lo, int64_t first_row, int64_t n_rows, int64_t block_start, const void *kt, const void *vb,
    const uint16_t *ks, const uint16_t *vs, const QuantRow *qr, int64_t head_dim, float scale, const int kind,
    const char *next_k, const char *next_v) {
    int64_t r = first_row;
#ifdef INT8_SCORES
    if (kind == KV_INT8) {
        block_scores16_int8(s + r, qr + r, (int)(n_rows - r), (const int8_t *)kt, ks, head_dim, next_k, next_v);
        r = n_rows;
    }
#else
    (void)qr;
#endif
    for (; r + 4 <= n_rows; r += 4) {
        block_scores16(s + r, qs + r, kt, ks, head_dim, 4, kind, next_k, next_v);
        next_k = next_v = NULL;  // fetched once
    }
    switch (n_rows - r) {
        case 3: block_scores16(s + r, qs + r, kt, ks, head_dim, 3, kind, next_k, next_v); break;
        case 2: block_scores16(s + r, qs + r, kt, ks, head_dim, 2, kind, next_k, next_v); break;
        case 1: block_scores16(s + r, qs + r, kt, ks, head_dim, 1, kind, next_k, next_v); break;
        default: break;
    }
    float corr[MAX_TILE];
    int keys[MAX_TILE];  // this block's keys each row sees
    for (int64_t i = first_row; i < n_rows; ++i) {
        const int64_t left = len[i] - block_start;
        const int n = left < 16 ? (int)left : 16;
        // keys before a sliding window's start weigh exp(-inf) = 0 (a row given this block sees at least one)
        const int before = lo == NULL || lo[i] <= block_start ? 0 : (int)(lo[i] - block_start);
        const __mmask16 mask = (__mmask16)((n == 16 ? 0xFFFFu : (1u << n) - 1) & ~((1u << before) - 1));
        const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(s[i]), _mm512_set1_ps(scale));
        float block_max = _mm512_mask_reduce_max_ps(mask, sv);
        block_max = m[i] > block_max ? m[i] : block_max;
        // exp(-inf) = 0 on the first block; exp(0) = 1 exactly, the common case once the context is long
        corr[i] = block_max == m[i] ? 1.0f : expf(m[i] - block_max);
        const __m512 p = _mm512_maskz_mov_ps(mask, exp512_ps(_mm512_sub_ps(sv, _mm512_set1_ps(block_max))));
        // the denominators in 16 lanes, summed once at the end: no horizontal add per block
        _mm512_storeu_ps(l[i], _mm512_fmadd_ps(_mm512_loadu_ps(l[i]), _mm512_set1_ps(corr[i]), p));
        _mm512_storeu_ps(s[i], kv_scaled(kind) ? _mm512_mul_ps(p, kv_scale16(vs, kind)) : p);
        m[i] = block_max;
        keys[i] = n;
    }
#ifdef INT8_SCORES
    if (kind == KV_INT8) {
        for (r = first_row; r < n_rows; r += 8) {
            const int rows = n_rows - r < 8 ? (int)(n_rows - r) : 8;
            accumulate_rows_int8(acc + r, corr + r, s + r, rows, (const int8_t *)vb, head_dim);
        }
        return;
    }
#endif
    // rows are in position order: the last of a group sees the most keys
    for (r = first_row; r < n_rows; r += 8) {
        const int rows = n_rows - r < 8 ? (int)(n_rows - r) : 8;
        switch (rows) {
            case 8: accumulate_rows(acc + r, corr + r, s + r, 8, keys[r + 7], vb, head_dim, kind); break;
            case 7: accumulate_rows(acc + r, corr + r, s + r, 7, keys[r + 6], vb, head_dim, kind); break;
            case 6: accumulate_rows(acc + r, corr + r, s + r, 6, keys[r + 5], vb, head_dim, kind); break;
            case 5: accumulate_rows(acc + r, corr + r, s + r, 5, keys[r + 4], vb, head_dim, kind); break;
            case 4: accumulate_rows(acc + r, corr + r, s + r, 4, keys[r + 3], vb, head_dim, kind); break;
            case 3: accumulate_rows(acc + r, corr + r, s + r, 3, keys[r + 2], vb, head_dim, kind); break;
            case 2: accumulate_rows(acc + r, corr + r, s + r, 2, keys[r + 1], vb, head_dim, kind); break;
            default: accumulate_rows(acc + r, corr + r, s + r, 1, keys[r], vb, head_dim, kind); break;
        }
    }
}

// one specialization per format, so each inlines its own loads
#define ATTEND_BLOCK16(name, kind)                                                                              \
    static void name(float acc[][MAX_HEAD_DIM], float *m, float l[][16], float s[][MAX_BLOCK], const float *const *qs, \
                     const int64_t *len, const int64_t *lo, int64_t first_row, int64_t n_rows, int64_t block_start, \
                     const void *kt, const void *vb, const uint16_t *ks, const uint16_t *vs, const QuantRow *qr,   \
                     int64_t head_dim, float scale, const char *next_k, const char *next_v) {                     \
        attend_block16(acc, m, l, s, qs, len, lo, first_row, n_rows, block_start, kt, vb, ks, vs, qr, head_dim,    \
                       scale, kind, next_k, next_v);                                                              \
    }
ATTEND_BLOCK16(attend_block16_f32, KV_F32)
ATTEND_BLOCK16(attend_block16_bf16, KV_BF16)
ATTEND_BLOCK16(attend_block16_int8, KV_INT8)
ATTEND_BLOCK16(attend_block16_e4m3, KV_E4M3)
ATTEND_BLOCK16(attend_block16_e5m2, KV_E5M2)
#undef ATTEND_BLOCK16
typedef void (*AttendBlock16)(float[][MAX_HEAD_DIM], float *, float[][16], float[][MAX_BLOCK], const float *const *,
                              const int64_t *, const int64_t *, int64_t, int64_t, int64_t, const void *, const void *,
                              const uint16_t *, const uint16_t *, const QuantRow *, int64_t, float, const char *,
                              const char *);
static const AttendBlock16 attend_block16_of[] = {attend_block16_f32, attend_block16_bf16, attend_block16_int8,
                                                  attend_block16_e4m3, attend_block16_e5m2};
#else
int paged_attention_bf16_available(void) { return 0; }
#endif
#ifndef INT8_SCORES
int paged_attention_int8_scores(void) { return 0; }
#endif

// A block of stored values [rows][cols] as float32 into `tile`, each times its token's scale (8-bit formats; the
// token is the column of a K block, the row of a V block).
static void decode_kv_block(const void *src, const uint16_t *scales, int64_t rows, int64_t cols, int64_t kind,
                         int token_is_column, float *tile) {
    for (int64_t r = 0; r < rows; ++r) {
        const void *row = (const char *)src + r * cols * kv_elem_bytes(kind);
        if (!kv_scaled(kind) || token_is_column) {
            kv_decode(row, 1, cols, kind, 1.0f, tile + r * cols);
            if (kv_scaled(kind))
                for (int64_t c = 0; c < cols; ++c) tile[r * cols + c] *= bf16_value(scales[c]);
        } else {
            kv_decode(row, 1, cols, kind, bf16_value(scales[r]), tile + r * cols);
        }
    }
}

// One kv head's query rows (in position order; rows active .. n_rows - 1 see keys in this block) over one
// block. `lo` (sliding windows, else NULL): the first key each row sees. Offsets count elements of the cache
// (`offset`, `next_offset`: this block's and a later one's, -1 for none) and of the scales (`scale_offset`).
static void attend_block(float acc[][MAX_HEAD_DIM], float *m, float l[][16], float s[][MAX_BLOCK], const float *const *qs,
                         const QuantRow *qr, const int64_t *len, const int64_t *lo, int64_t active, int64_t n_rows, int64_t b,
                         const void *k_cache, const void *v_cache, const uint16_t *k_scale, const uint16_t *v_scale,
                         int64_t offset, int64_t next_offset, int64_t scale_offset, int64_t head_dim,
                         int64_t block_size, float scale, int64_t kind) {
    const int64_t elem = kv_elem_bytes(kind);
    const uint16_t *ks = kv_scaled(kind) ? k_scale + scale_offset : NULL;
    const uint16_t *vs = kv_scaled(kind) ? v_scale + scale_offset : NULL;
#if defined(__AVX512F__)
    if (block_size == 16 && head_dim % 64 == 0) {
        // blocks lie anywhere in the pool: fetch a later one's K and V while this one computes, which the
        // hardware prefetchers, working within a page, would not
        const char *next_k = next_offset < 0 ? NULL : (const char *)k_cache + next_offset * elem;
        const char *next_v = next_offset < 0 ? NULL : (const char *)v_cache + next_offset * elem;
        if (next_offset >= 0 && kv_scaled(kind)) {  // and its scales (a block's are one line apart from its values)
            _mm_prefetch((const char *)(k_scale + next_offset / head_dim), PF_HINT);
            _mm_prefetch((const char *)(v_scale + next_offset / head_dim), PF_HINT);
        }
        attend_block16_of[kind](acc, m, l, s, qs, len, lo, active, n_rows, b * block_size,
                                (const char *)k_cache + offset * elem, (const char *)v_cache + offset * elem, ks, vs,
                                qr, head_dim, scale, next_k, next_v);
        return;
    }
#endif
    (void)next_offset;
    (void)qr;
    const float *kt = (const float *)((const char *)k_cache + offset * elem);
    const float *vb = (const float *)((const char *)v_cache + offset * elem);
    float k_tile[kind == KV_F32 ? 1 : MAX_HEAD_DIM * MAX_BLOCK], v_tile[kind == KV_F32 ? 1 : MAX_HEAD_DIM * MAX_BLOCK];
    if (kind != KV_F32) {  // this block dequantized (widened) into L1, then the float32 path
        decode_kv_block(kt, ks, head_dim, block_size, kind, 1, k_tile);
        decode_kv_block(vb, vs, block_size, head_dim, kind, 0, v_tile);
        kt = k_tile;
        vb = v_tile;
    }
    block_scores(s + active, qs + active, n_rows - active, kt, head_dim, block_size);
    for (int64_t i = active; i < n_rows; ++i) {
        const int64_t left = len[i] - b * block_size;
        const int64_t n = left < block_size ? left : block_size;
        const int64_t before = lo == NULL || lo[i] <= b * block_size ? 0 : lo[i] - b * block_size;
        float *si = s[i];
        float block_max = m[i];
        for (int64_t t = 0; t < before; ++t) si[t] = -INFINITY;  // outside the window: weight exp(-inf) = 0
        for (int64_t t = before; t < n; ++t) {
            si[t] *= scale;
            block_max = si[t] > block_max ? si[t] : block_max;
        }
        const float correction = expf(m[i] - block_max);  // exp(-inf) = 0 on the first block
        l[i][0] *= correction;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) si[t] = expf(si[t] - block_max);
        for (int64_t t = 0; t < n; ++t) l[i][0] += si[t];
        if (head_dim == 64) {
            accumulate64(acc[i], correction, si, vb, n);
        } else {
            float *a = acc[i];
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
            for (int64_t t = 0; t < n; ++t)
                for (int64_t d = 0; d < head_dim; ++d) a[d] = fmaf(si[t], vb[t * head_dim + d], a[d]);
        }
        m[i] = block_max;
    }
}

void paged_attention(
    float *out,                   // [T, num_heads, head_dim]: rows of `row_stride` floats
    const float *q,               // [T, num_heads, head_dim]: rows of `q_row_stride` floats
    const void *k_cache,          // [num_blocks, num_kv_heads, head_dim, block_size], in format kv_kind
    const void *v_cache,          // [num_blocks, num_kv_heads, block_size, head_dim], same format
    const uint16_t *k_scale,      // 8-bit formats: [num_blocks, num_kv_heads, block_size] bf16 (else NULL)
    const uint16_t *v_scale,
    const int64_t *query_start,   // [num_seqs + 1]: sequence s owns rows query_start[s] .. query_start[s+1]
    const int64_t *seq_lens,      // [num_seqs]: context length after this step (its last row sees all of it)
    const int64_t *block_tables,  // [num_seqs, max_blocks]
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t q_row_stride, int64_t row_stride, float scale,
    int64_t kv_kind,              // kv_formats.h (bf16 only with paged_attention_bf16_available and blocks of 16)
    int64_t window) {                 // > 0: a row at position p sees keys p - window + 1 .. p
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_block = head_dim * block_size;  // elements of one kv head in one block
    // Tasks: (sequence, tile of its query rows, kv heads). A sequence whose rows all fit in one tile (decodes)
    // takes all its kv heads in one task when there are enough such tasks for the threads: it then reads each
    // block's K and V as one contiguous run instead of a head's slice of it on each of num_kv_heads passes
    // (measured here: cold-cache decode attention 1.5-1.8x faster). Heads are independent, so how they are
    // grouped into tasks changes no result.
    const int64_t head_tile_rows = MAX_TILE / group < 1 ? 1 : MAX_TILE / group;  // query rows of a one-head task
    int64_t *task_start = malloc(sizeof(int64_t) * (num_seqs + 1));
#define FITS_ONE_TASK(rows) ((rows) * num_heads <= MAX_TILE)  // a sequence's rows for all its heads
    int64_t fits = 0;
    for (int64_t s = 0; s < num_seqs; ++s) fits += FITS_ONE_TASK(query_start[s + 1] - query_start[s]);
    const int merge = fits >= omp_get_max_threads();
#define ALL_HEADS(rows) (merge && FITS_ONE_TASK(rows))  // one task takes all of a sequence's kv heads
    task_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t rows = query_start[s + 1] - query_start[s];
        task_start[s + 1] = task_start[s] + (ALL_HEADS(rows) ? 1 : (rows + head_tile_rows - 1) / head_tile_rows
                                                                       * num_kv_heads);
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < task_start[num_seqs]; ++task) {
        int64_t seq = 0;
        while (task_start[seq + 1] <= task) ++seq;
        const int64_t local = task - task_start[seq];
        const int64_t q_len = query_start[seq + 1] - query_start[seq];
        const int64_t heads = ALL_HEADS(q_len) ? num_kv_heads : 1;  // kv heads in this task
        const int64_t tile_rows = heads > 1 ? q_len : head_tile_rows;
        const int64_t first_head = heads > 1 ? 0 : local % num_kv_heads, tile = heads > 1 ? 0 : local / num_kv_heads;
        const int64_t first = tile * tile_rows;
        const int64_t rows = q_len - first < tile_rows ? q_len - first : tile_rows;
        const int64_t n_rows = rows * group;  // query rows of one kv head: rows x the heads sharing it
        const int64_t *table = block_tables + seq * max_blocks;
        // l: each row's softmax denominator, in 16 partial sums (the AVX-512 path) or the first alone
        float acc[MAX_TILE][MAX_HEAD_DIM], m[MAX_TILE], l[MAX_TILE][16], s[MAX_TILE][MAX_BLOCK];
        int64_t len[MAX_TILE], lo[MAX_TILE];
        const float *qs[MAX_TILE];
#ifdef INT8_SCORES
        QuantRow qr[kv_kind == KV_INT8 && block_size == 16 && head_dim % 64 == 0 ? MAX_TILE : 1];
        const int quantized = kv_kind == KV_INT8 && block_size == 16 && head_dim % 64 == 0;
#else
        QuantRow qr[1];
        const int quantized = 0;
#endif
        // row i = (kv head h of this task, row r, head g of its group): each kv head's rows are contiguous
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t row = query_start[seq] + first + r;
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t i = h * n_rows + r * group + g;
                    len[i] = seq_lens[seq] - q_len + first + r + 1;  // causal: keys up to this row's position
                    lo[i] = window > 0 && len[i] > window ? len[i] - window : 0;
                    qs[i] = q + row * q_row_stride + ((first_head + h) * group + g) * head_dim;
                    if (quantized) quantize_query(qs[i], head_dim, &qr[i]);
                    m[i] = -INFINITY;
                    memset(l[i], 0, sizeof l[i]);
                    memset(acc[i], 0, sizeof(float) * head_dim);
                }
            }
        for (int64_t b = lo[0] / block_size; b * block_size < len[n_rows - 1]; ++b) {
            // rows are in position order: the ones that see keys in this block form a run (a suffix without
            // windows; with one, the rows whose window starts past the block end it)
            int64_t active = 0, end = n_rows;
            while (len[active] <= b * block_size) ++active;
            while (window > 0 && lo[end - 1] >= (b + 1) * block_size) --end;
            const int64_t ahead = (b + PREFETCH_BLOCKS) * block_size < len[n_rows - 1] ? table[b + PREFETCH_BLOCKS] : -1;
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t kvh = first_head + h, i = h * n_rows;
                attend_block(acc + i, m + i, l + i, s + i, qs + i, quantized ? qr + i : NULL, len + i, window > 0 ? lo + i : NULL, active, end,
                             b, k_cache, v_cache, k_scale, v_scale, (table[b] * num_kv_heads + kvh) * head_block,
                             ahead < 0 ? -1 : (ahead * num_kv_heads + kvh) * head_block,
                             (table[b] * num_kv_heads + kvh) * block_size, head_dim, block_size, scale, kv_kind);
            }
        }
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t row = query_start[seq] + first + r;
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t i = h * n_rows + r * group + g;
                    float *o = out + row * row_stride + ((first_head + h) * group + g) * head_dim;
                    float total = 0.0f;
                    for (int lane = 0; lane < 16; ++lane) total += l[i][lane];
                    const float inv = 1.0f / total;
                    for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[i][d] * inv;
                }
            }
    }
    free(task_start);
#undef ALL_HEADS
#undef FITS_ONE_TASK
}
