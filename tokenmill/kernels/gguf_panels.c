/* GGUF weights repacked at load into 16-row panels, and the linear layer over them (gguf_panels_avx512.h for
 * AVX512-VNNI, gguf_panels_avx2.h for AVX2 and AVX-VNNI hosts: the same bits from both).
 *
 * gguf_matmul.c reads the file's blocks in place, one output row at a time: each block's 32 products end in a
 * horizontal sum, and on a 2-core host a 4-bit model then decodes at half the speed of int8 weights. Here the
 * blocks of 16 output rows are interleaved as the int8 kernel's weights are (int8_rows.c: one 64-byte vector
 * holds 4 consecutive k of 16 rows), so one `vpdpbusd` with 4 broadcast activations accumulates 16 outputs and
 * no horizontal sum is needed. The bits stay the file's: 4-bit levels two to a byte (the low nibbles k0-3 of a
 * vector's 8 k, the high nibbles k4-7), a 5th and 6th bit as bit planes (one byte per byte position of the
 * group's vectors holding its 8 levels' bits: AVX-512 takes each level set's bits as a mask with one test and
 * adds them with one masked byte add, AVX2 with a shift and an and), the scales as the file's fp16 bits and 6-bit
 * integers. A panel costs the file's bytes to within 3%
 * (Q4_K: 4.625 bits a weight against 4.5) and the file's pages are dropped once packed.
 *
 * Per panel and group of 32 k, for each of 16 rows, with x quantized per group of 32 (quantize_groups: int8
 * levels xq, scale xd):
 *     y += xd * scale * (sum levels * xq + c * sum xq)   +   offset * xd * sum xq
 * where the weight is scale * (level + c) + offset: Q4_0 / Q5_0 / Q8_0 c = -8 / -16 / -128 (Q8_0's int8 is
 * stored + 128, unsigned, for vpdpbusd) and scale d; Q4_1 / Q5_1 scale d, offset m; Q4_K / Q5_K scale d * sc,
 * offset -dmin * mn; Q6_K c = -32 with a scale d * sc per 16 k. The integer part is exact (c * sum xq starts the
 * int32 accumulator), then one float multiply-add per group in k order, so a token's result is the same for any
 * batch: up to 8 tokens share each weight load, each in its own accumulators.
 *
 * Panel layout, per group of 32 k (in k order; k-quants put a superblock header before every 8th group):
 *   levels  nibble formats: 4 vectors of 64 B, byte [r * 4 + i] of vector v = level(r, 8v + i) | level(r, 8v + 4 + i) << 4
 *           Q8_0: 8 vectors of 64 B, byte [r * 4 + i] of vector v = level(r, 4v + i)
 *   planes  Q5_x: 64 B, byte j = the 5th bits of the levels at byte j of the 4 vectors: bit 2v the low nibble's
 *           level in vector v, bit 2v + 1 the high nibble's
 *           Q6_K: those 64 B for the 5th bits, then 64 B as they are for the 6th
 *   params  Q4_0/Q5_0/Q8_0: fp16 d [16]; Q4_1/Q5_1: fp16 d [16], fp16 m [16]; Q4_K/Q5_K: u8 sc [16], u8 mn [16];
 *           Q6_K: int8 sc [16] of k 0-15, int8 sc [16] of k 16-31
 *   header  Q4_K/Q5_K: fp16 d [16], fp16 dmin [16]; Q6_K: fp16 d [16]
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.c"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define PANEL 16  // output rows per panel: one 512-bit vector of int32 or float lanes

static int nibble_format(int type) { return type != T_Q8_0; }
static int k_quant(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

static int64_t plane_bytes(int type) {
    return type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K ? 64 : type == T_Q6_K ? 128 : 0;
}

static int64_t param_bytes(int type) { return type == T_Q4_1 || type == T_Q5_1 ? 64 : 32; }

static int64_t group_bytes(int type) { return (nibble_format(type) ? 256 : 512) + plane_bytes(type) + param_bytes(type); }

static int64_t header_bytes(int type) { return type == T_Q6_K ? 32 : k_quant(type) ? 64 : 0; }

int gguf_panels_supports(int type) { return gguf_executable_type(type); }

/* bytes of one panel of 16 rows of k values (0: not packed here) */
int64_t gguf_panel_bytes(int type, int64_t k) {
    if (!gguf_panels_supports(type) || gguf_row_bytes(type, k) == 0) return 0;
    return k / 32 * group_bytes(type) + k / 256 * header_bytes(type);
}

// One row decoded to its integer parts: levels [k] (unsigned), per group of 32 the fp16 bits of d and m (or
// the 6-bit sc and mn, or Q6_K's two int8 scales), per superblock the fp16 bits of d and dmin.
typedef struct {
    uint8_t *levels;
    uint16_t *d, *m;  // [k / 32]
    uint8_t *sc, *mn;  // [k / 32]
    int8_t *sc16;  // [k / 16]
    uint16_t *super_d, *super_dmin;  // [k / 256]
} RowParts;

static uint16_t half_bits(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static void decode_levels(int type, const uint8_t *row, int64_t k, RowParts *out) {
    int64_t values, bytes;
    block_shape(type, &values, &bytes);
    for (int64_t b = 0; b < k / values; b++) {
        const uint8_t *blk = row + b * bytes;
        uint8_t *L = out->levels + b * values;
        switch (type) {
        case T_Q4_0: case T_Q4_1: {
            const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) L[j] = qs[j] & 0x0F, L[j + 16] = qs[j] >> 4;
            out->d[b] = half_bits(blk);
            out->m[b] = type == T_Q4_1 ? half_bits(blk + 2) : 0;
            break;
        }
        case T_Q5_0: case T_Q5_1: {
            const int with_min = type == T_Q5_1;
            const uint8_t *qh = blk + (with_min ? 4 : 2), *qs = qh + 4;
            const uint32_t high = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) |
                                  ((uint32_t)qh[3] << 24);
            for (int j = 0; j < 32; j++)
                L[j] = (uint8_t)((j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4)) | (((high >> j) & 1) << 4));
            out->d[b] = half_bits(blk);
            out->m[b] = with_min ? half_bits(blk + 2) : 0;
            break;
        }
        case T_Q4_K: case T_Q5_K: {
            const int five = type == T_Q5_K;
            const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                scale_min_k4(blk + 4, j, out->sc + 8 * b + j, out->mn + 8 * b + j);
                const uint8_t *nibbles = qs + (j / 2) * 32;
                for (int l = 0; l < 32; l++) {
                    int q = (j % 2) ? (nibbles[l] >> 4) : (nibbles[l] & 0x0F);
                    if (five) q |= ((qh[l] >> j) & 1) << 4;
                    L[32 * j + l] = (uint8_t)q;
                }
            }
            out->super_d[b] = half_bits(blk);
            out->super_dmin[b] = half_bits(blk + 2);
            break;
        }
        case T_Q6_K: {
            const uint8_t *ql = blk, *qh = blk + 128;
            for (int i = 0; i < 256; i++) {
                const int half = i / 128, within = i % 128, l = within % 32, quarter = within / 32;
                const int low = (ql[half * 64 + (quarter % 2) * 32 + l] >> (4 * (quarter / 2))) & 0x0F;
                const int high = (qh[half * 32 + l] >> (2 * quarter)) & 3;
                L[i] = (uint8_t)(low | (high << 4));
            }
            memcpy(out->sc16 + 16 * b, blk + 192, 16);
            out->super_d[b] = half_bits(blk + 208);
            break;
        }
        }
    }
}

/* One group's levels (32 k from `first`) of the 16 scratch rows (levels at row * row_stride) into the panel's 4
 * vectors: byte [r * 4 + i] of vector v = level(r, 8v + i) | level(r, 8v + 4 + i) << 4, then the 5th bits (and
 * Q6_K's 6th) as bit planes: byte j of a plane holds bit 2v of the low nibble's level at byte j of vector v and
 * bit 2v + 1 of the high nibble's. */
static void interleave_nibbles(int type, const uint8_t *levels, int64_t row_stride, int64_t first, uint8_t *dst) {
    uint8_t *planes = dst + 256;
    const int plane_count = type == T_Q6_K ? 2 : plane_bytes(type) ? 1 : 0;
#if defined(__AVX512BW__)
    // a 32-bit gather takes 4 consecutive levels of each of the 16 rows: bytes in the panel's order already
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((int)row_stride));
    const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10), bit5 = _mm512_set1_epi8(0x20);
    __m512i plane4 = _mm512_setzero_si512(), plane5 = _mm512_setzero_si512();
    for (int v = 0; v < 4; v++) {
        const __m512i lo = _mm512_i32gather_epi32(rows, levels + first + 8 * v, 1);
        const __m512i hi = _mm512_i32gather_epi32(rows, levels + first + 8 * v + 4, 1);
        _mm512_storeu_si512(dst + 64 * v, _mm512_or_si512(_mm512_and_si512(lo, nibble),
                                                          _mm512_slli_epi32(_mm512_and_si512(hi, nibble), 4)));
        const __m512i low_bit = _mm512_set1_epi8((char)(1 << (2 * v)));
        const __m512i high_bit = _mm512_set1_epi8((char)(2 << (2 * v)));
        if (plane_count >= 1) {
            plane4 = _mm512_or_si512(plane4, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(lo, bit4), low_bit));
            plane4 = _mm512_or_si512(plane4, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hi, bit4), high_bit));
        }
        if (plane_count == 2) {
            plane5 = _mm512_or_si512(plane5, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(lo, bit5), low_bit));
            plane5 = _mm512_or_si512(plane5, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hi, bit5), high_bit));
        }
    }
    if (plane_count >= 1) _mm512_storeu_si512(planes, plane4);
    if (plane_count == 2) _mm512_storeu_si512(planes + 64, plane5);
#else
    if (plane_count) memset(planes, 0, (size_t)plane_bytes(type));
    for (int v = 0; v < 4; v++)
        for (int r = 0; r < PANEL; r++)
            for (int i = 0; i < 4; i++) {
                const uint8_t lo = levels[r * row_stride + first + 8 * v + i];
                const uint8_t hi = levels[r * row_stride + first + 8 * v + 4 + i];
                const int byte = r * 4 + i;
                dst[64 * v + byte] = (uint8_t)((lo & 0x0F) | ((hi & 0x0F) << 4));
                for (int plane = 0; plane < plane_count; plane++) {  // the 5th bits (bit 4), Q6_K's 6th (bit 5)
                    const int low_bit = (lo >> (4 + plane)) & 1, high_bit = (hi >> (4 + plane)) & 1;
                    planes[64 * plane + byte] |= (uint8_t)((low_bit | high_bit << 1) << (2 * v));
                }
            }
#endif
}

/* Q8_0 needs no decoding: each run of 4 levels moves whole to its place in the panel, + 128 (a word at a time,
 * straight from the file's blocks: the LM head of a 262k vocabulary is Q8_0, and packed a byte at a time through
 * the scratch rows it took most of a load). */
static void pack_q8_0(const uint8_t *blocks, int64_t rows, int64_t k, const int64_t *index, uint8_t *out) {
    const int64_t row_bytes = gguf_row_bytes(T_Q8_0, k), groups = k / 32, panels = (rows + PANEL - 1) / PANEL;
    const int64_t panel_bytes = gguf_panel_bytes(T_Q8_0, k);
    int64_t values, block_bytes;
    block_shape(T_Q8_0, &values, &block_bytes);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *src[PANEL];
        for (int r = 0; r < PANEL; r++) {
            const int64_t row = PANEL * p + r;
            src[r] = row < rows ? blocks + (index ? index[row] : row) * row_bytes : NULL;
        }
        uint8_t *dst = out + p * panel_bytes;
        for (int64_t g = 0; g < groups; g++, dst += group_bytes(T_Q8_0)) {
            uint32_t *words = (uint32_t *)dst;
            uint16_t *d = (uint16_t *)(dst + 512);
            for (int r = 0; r < PANEL; r++) {
                const uint8_t *blk = src[r] ? src[r] + g * block_bytes : NULL;
                d[r] = blk ? half_bits(blk) : 0;
                for (int v = 0; v < 8; v++) {
                    uint32_t w = 0;  // zero weights past the last row: levels 128, scale 0
                    if (blk) memcpy(&w, blk + 2 + 4 * v, 4);
                    words[16 * v + r] = w ^ 0x80808080u;
                }
            }
        }
    }
}

/* blocks [rows, row bytes] of one tensor -> ceil(rows / 16) panels at out (gguf_panel_bytes each). Panel row r of
 * panel p is stored row index[16 p + r] (index NULL: in order); rows past the end are zero weights. */
void gguf_panels_pack(int type, const uint8_t *blocks, int64_t rows, int64_t k, const int64_t *index, uint8_t *out) {
    if (type == T_Q8_0) {
        pack_q8_0(blocks, rows, k, index, out);
        return;
    }
    const int64_t row_bytes = gguf_row_bytes(type, k), panels = (rows + PANEL - 1) / PANEL;
    const int64_t panel_bytes = gguf_panel_bytes(type, k), groups = k / 32;
    // per row: levels [k], d and m [groups] (u16), sc and mn [groups], sc16 [k / 16], super_d and super_dmin [k / 256]
    const int64_t scratch_row = k + 8 * groups + 4 * (k / 256);
#pragma omp parallel
    {
        RowParts parts[PANEL];
        uint8_t *scratch = malloc((size_t)(PANEL * scratch_row));
        for (int r = 0; r < PANEL; r++) {
            uint8_t *base = scratch + r * scratch_row;
            parts[r].levels = base;
            parts[r].d = (uint16_t *)(base + k);
            parts[r].m = parts[r].d + groups;
            parts[r].sc = base + k + 4 * groups;
            parts[r].mn = parts[r].sc + groups;
            parts[r].sc16 = (int8_t *)(parts[r].mn + groups);
            parts[r].super_d = (uint16_t *)(base + k + 8 * groups);
            parts[r].super_dmin = parts[r].super_d + k / 256;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            uint8_t *dst = out + p * panel_bytes;
            for (int r = 0; r < PANEL; r++) {
                const int64_t row = PANEL * p + r;
                if (row < rows) {
                    decode_levels(type, blocks + (index ? index[row] : row) * row_bytes, k, parts + r);
                } else {  // zero weights: zero levels and scales
                    memset(scratch + r * scratch_row, 0, (size_t)scratch_row);
                }
            }
            for (int64_t g = 0; g < groups; g++) {
                if (k_quant(type) && g % 8 == 0) {
                    uint16_t *h = (uint16_t *)dst;
                    for (int r = 0; r < PANEL; r++) {
                        h[r] = parts[r].super_d[g / 8];
                        if (type != T_Q6_K) h[PANEL + r] = parts[r].super_dmin[g / 8];
                    }
                    dst += header_bytes(type);
                }
                interleave_nibbles(type, scratch, scratch_row, 32 * g, dst);
                dst += 256 + plane_bytes(type);
                for (int r = 0; r < PANEL; r++) {
                    if (type == T_Q4_K || type == T_Q5_K) {
                        dst[r] = parts[r].sc[g];
                        dst[PANEL + r] = parts[r].mn[g];
                    } else if (type == T_Q6_K) {
                        dst[r] = (uint8_t)parts[r].sc16[2 * g];
                        dst[PANEL + r] = (uint8_t)parts[r].sc16[2 * g + 1];
                    } else {
                        ((uint16_t *)dst)[r] = parts[r].d[g];
                        if (type == T_Q4_1 || type == T_Q5_1) ((uint16_t *)dst)[PANEL + r] = parts[r].m[g];
                    }
                }
                dst += param_bytes(type);
            }
        }
        free(scratch);
    }
}

// One token's activations (quantize_groups' outputs and the sums derived from them)
typedef struct {
    const int8_t *q;  // [k]
    const float *d, *sum_f;  // [k / 32]: scales; xd * (sum of the group's levels)
    const int32_t *sum;  // [k / 32]: the group's sum of levels
    const int32_t *sum16;  // [k / 16]: each half group's (Q6_K)
} Token;

// One panel against `tile` tokens: y[u] = the panel's 16 outputs for token u (the ISA's header defines panel_fn,
// TILE_MAX and PanelFn's implementations; every header computes each output with the same float operations, so
// all of them give the same bits).
typedef void (*PanelFn)(const uint8_t *, int64_t, const Token *, float (*)[PANEL]);

// 4 bytes as one int32 (4 activations to broadcast), at any alignment
static inline int32_t word_at(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANEL_KERNELS 1
#include "gguf_panels_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PANEL_KERNELS 1
#include "gguf_panels_avx2.h"
#endif

#ifdef PANEL_KERNELS
int gguf_panels_available(void) { return 1; }

// one function per format and tile size (the header's PANEL_TILES), so each format's loop compiles on its own
#define PANEL_FN(NAME, TYPE, T)                                                                                    \
    static void NAME##_##T(const uint8_t *p, int64_t k, const Token *x, float (*y)[PANEL]) {                       \
        panel_tile(TYPE, T, p, k, x, y);                                                                           \
    }
#define PANEL_REF(NAME, TYPE, T) NAME##_##T,
#define PANEL_FNS(NAME, TYPE) PANEL_TILES(PANEL_FN, NAME, TYPE)
PANEL_FNS(q4_0, T_Q4_0)
PANEL_FNS(q4_1, T_Q4_1)
PANEL_FNS(q5_0, T_Q5_0)
PANEL_FNS(q5_1, T_Q5_1)
PANEL_FNS(q8_0, T_Q8_0)
PANEL_FNS(q4_k, T_Q4_K)
PANEL_FNS(q5_k, T_Q5_K)
PANEL_FNS(q6_k, T_Q6_K)

static PanelFn panel_fn(int type, int tile) {
#define PICK(NAME)                                                                                                 \
    {                                                                                                              \
        static const PanelFn fns[TILE_MAX] = {PANEL_TILES(PANEL_REF, NAME, 0)};                                    \
        return fns[tile - 1];                                                                                      \
    }
    switch (type) {
    case T_Q4_0: PICK(q4_0);
    case T_Q4_1: PICK(q4_1);
    case T_Q5_0: PICK(q5_0);
    case T_Q5_1: PICK(q5_1);
    case T_Q8_0: PICK(q8_0);
    case T_Q4_K: PICK(q4_k);
    case T_Q5_K: PICK(q5_k);
    default: PICK(q6_k);
    }
#undef PICK
}

/* out[t * out_stride + j] = W[j] . x[t] (+ bias[j]) for the outputs j of `parts` stacked tensors (a fused
 * projection), part p's rows[p] outputs packed by gguf_panels_pack at packed[p] (type types[p]).
 * xq/xd/xs: quantize_groups' outputs for x [tokens, k] (xs = 128 * each group's sum of levels). */
void gguf_panels_matmul(int64_t parts, const int *types, const uint8_t *const *packed, const int64_t *rows,
                        int64_t k, const int8_t *xq, const float *xd, const int32_t *xs, int64_t tokens,
                        const float *bias, float *out, int64_t out_stride) {
    const int64_t groups = k / 32;
    int64_t panels = 0;
    for (int64_t p = 0; p < parts; p++) panels += (rows[p] + PANEL - 1) / PANEL;
    // each panel: its type, its first output, the end of its tensor's outputs, its bytes
    int64_t *panel_type = malloc(sizeof(int64_t) * (size_t)panels * 3);
    int64_t *panel_out = panel_type + panels, *panel_end = panel_out + panels;
    const uint8_t **panel_data = malloc(sizeof(uint8_t *) * (size_t)panels);
    int q6k = 0;
    for (int64_t p = 0, i = 0, first = 0; p < parts; first += rows[p], p++) {
        const int64_t bytes = gguf_panel_bytes(types[p], k);
        q6k |= types[p] == T_Q6_K;
        for (int64_t local = 0; local < (rows[p] + PANEL - 1) / PANEL; local++, i++) {
            panel_type[i] = types[p];
            panel_out[i] = first + PANEL * local;
            panel_end[i] = first + rows[p];
            panel_data[i] = packed[p] + local * bytes;
        }
    }
    int32_t *sum = malloc(sizeof(int32_t) * (size_t)(tokens * groups));
    float *sum_f = malloc(sizeof(float) * (size_t)(tokens * groups));
    int32_t *sum16 = malloc(sizeof(int32_t) * (size_t)(q6k ? tokens * 2 * groups : 1));
    for (int64_t i = 0; i < tokens * groups; i++) sum[i] = xs[i] / 128, sum_f[i] = xd[i] * (float)sum[i];
    if (q6k) half_group_sums(xq, tokens * 2 * groups, sum16);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < panels; i++) {
        const int64_t first = panel_out[i], left = panel_end[i] - first;
        const int64_t width = left < PANEL ? left : PANEL;
        for (int64_t t = 0; t < tokens;) {
            // up to 8 tokens per weight pass, in tiles of near-equal size (as int8_linear_grouped)
            const int64_t tiles_left = (tokens - t + TILE_MAX - 1) / TILE_MAX;
            const int step = (int)((tokens - t + tiles_left - 1) / tiles_left);
            Token x[TILE_MAX];
            for (int u = 0; u < step; u++)
                x[u] = (Token){xq + (t + u) * k, xd + (t + u) * groups, sum_f + (t + u) * groups,
                               sum + (t + u) * groups, sum16 + (q6k ? (t + u) * 2 * groups : 0)};
            float y[TILE_MAX][PANEL];
            panel_fn((int)panel_type[i], step)(panel_data[i], k, x, y);
            for (int u = 0; u < step; u++) {
                float *row = out + (t + u) * out_stride + first;
                for (int64_t j = 0; j < width; j++) row[j] = bias ? y[u][j] + bias[first + j] : y[u][j];
            }
            t += step;
        }
    }
    free(sum16);
    free(sum_f);
    free(sum);
    free(panel_data);
    free(panel_type);
}
#else
int gguf_panels_available(void) { return 0; }

void gguf_panels_matmul(int64_t parts, const int *types, const uint8_t *const *packed, const int64_t *rows,
                        int64_t k, const int8_t *xq, const float *xd, const int32_t *xs, int64_t tokens,
                        const float *bias, float *out, int64_t out_stride) {
    (void)parts, (void)types, (void)packed, (void)rows, (void)k, (void)xq, (void)xd, (void)xs, (void)tokens,
        (void)bias, (void)out, (void)out_stride;
}
#endif
