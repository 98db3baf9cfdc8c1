/* GGUF tensors decoded from the file's own bytes, row by row, in native code.
 *
 * Each block format is decoded with the float operations of the `gguf` package's numpy reference, in the
 * same order (a product, then a sum, each rounded to float32), so `gguf_dequantize` is bit-identical to it and
 * `--quantization none` stays token-exact with transformers (which dequantizes GGUF files with that package).
 * `gguf_quantize_int8` decodes a row into a small buffer and quantizes it at once (symmetric int8, one scale per
 * row, as model/int8_linear.py's quantize_rows rounds), so no float32 copy of a tensor is ever made.
 *
 * Block layouts (GGML's, little-endian; fp16 scales):
 *   Q4_0  32 values, 18 B: d, 16 B nibbles (low nibbles: values 0-15, high: 16-31), w = d * (q - 8)
 *   Q4_1  32 values, 20 B: d, m, 16 B nibbles, w = d * q + m
 *   Q5_0  32 values, 22 B: d, 32 high bits, 16 B nibbles, w = d * (q - 16)
 *   Q5_1  32 values, 24 B: d, m, 32 high bits, 16 B nibbles, w = d * q + m
 *   Q8_0  32 values, 34 B: d, 32 int8, w = q * d
 *   Q2_K 256 values, 84 B: 16 (scale | min << 4), 64 B of 2-bit q, d, dmin; w = d*sc * q - dmin*m per 16
 *   Q3_K 256 values, 110 B: 32 B high-bit mask, 64 B of 2-bit q, 12 B of 6-bit scales, d; w = d*(sc-32) * q
 *   Q4_K 256 values, 144 B: d, dmin, 12 B of 6-bit scales and mins, 128 B nibbles; w = d*sc * q - dmin*m per 32
 *   Q5_K 256 values, 176 B: as Q4_K plus 32 B of fifth bits
 *   Q6_K 256 values, 210 B: 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales, d; w = d*sc * (q - 32)
 */
#ifndef TOKENMILL_GGUF_BLOCKS
#define TOKENMILL_GGUF_BLOCKS
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exponent = 113;
            while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* (values, bytes) of one block; 0 values: not a format decoded here */
static void block_shape(int type, int64_t *values, int64_t *bytes) {
    switch (type) {
    case T_F32: *values = 1; *bytes = 4; return;
    case T_F16: case T_BF16: *values = 1; *bytes = 2; return;
    case T_Q4_0: *values = 32; *bytes = 18; return;
    case T_Q4_1: *values = 32; *bytes = 20; return;
    case T_Q5_0: *values = 32; *bytes = 22; return;
    case T_Q5_1: *values = 32; *bytes = 24; return;
    case T_Q8_0: *values = 32; *bytes = 34; return;
    case T_Q2_K: *values = 256; *bytes = 84; return;
    case T_Q3_K: *values = 256; *bytes = 110; return;
    case T_Q4_K: *values = 256; *bytes = 144; return;
    case T_Q5_K: *values = 256; *bytes = 176; return;
    case T_Q6_K: *values = 256; *bytes = 210; return;
    default: *values = 0; *bytes = 0;
    }
}

/* Q4_K/Q5_K: the 6-bit scale and min of sub-block j (of 8) */
static void scale_min_k4(const uint8_t *s, int j, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30));
        *min = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 2) & 0x30));
    }
}

static void decode_block(int type, const uint8_t *b, float *out) {
    switch (type) {
    case T_Q4_0: {
        float d = half_to_float(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((int)(b[2 + j] & 0x0F) - 8);
            out[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
        }
        return;
    }
    case T_Q4_1: {
        float d = half_to_float(b), m = half_to_float(b + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(b[4 + j] & 0x0F) + m;
            out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        return;
    }
    case T_Q5_0: case T_Q5_1: {
        int with_min = type == T_Q5_1;
        float d = half_to_float(b), m = with_min ? half_to_float(b + 2) : 0.0f;
        const uint8_t *qh = b + (with_min ? 4 : 2), *qs = qh + 4;
        uint32_t high = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
        for (int j = 0; j < 32; j++) {
            int low = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
            int q = low | (int)(((high >> j) & 1) << 4);
            out[j] = with_min ? d * (float)q + m : d * (float)(q - 16);
        }
        return;
    }
    case T_Q8_0: {
        float d = half_to_float(b);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    case T_Q2_K: {
        const uint8_t *scales = b, *qs = b + 16;
        float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
        for (int i = 0; i < 256; i++) {
            int half = i / 128, shift = (i % 128) / 32, l = i % 32, group = i / 16;
            float q = (float)((qs[half * 32 + l] >> (2 * shift)) & 3);
            float dl = d * (float)(scales[group] & 0x0F), ml = dmin * (float)(scales[group] >> 4);
            out[i] = dl * q - ml;
        }
        return;
    }
    case T_Q3_K: {
        const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
        float d = half_to_float(b + 108);
        float dl[16];
        for (int g = 0; g < 16; g++) {
            int low = g < 8 ? (s[g] & 0x0F) : (s[g - 8] >> 4);
            int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
            dl[g] = d * (float)((int8_t)(uint8_t)(low | (high << 4)) - 32);
        }
        for (int i = 0; i < 256; i++) {
            int half = i / 128, shift = (i % 128) / 32, l = i % 32;
            int low = (qs[half * 32 + l] >> (2 * shift)) & 3;
            int high_clear = ((hmask[l] >> (i / 32)) & 1) ^ 1;  /* the offset applies where the bit is 0 */
            out[i] = dl[i / 16] * (float)(low - (high_clear << 2));
        }
        return;
    }
    case T_Q4_K: case T_Q5_K: {
        int five = type == T_Q5_K;
        float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            scale_min_k4(scales, j, &sc, &mn);
            float dj = d * (float)sc, mj = dmin * (float)mn;
            const uint8_t *nibbles = qs + (j / 2) * 32;
            for (int l = 0; l < 32; l++) {
                int q = (j % 2) ? (nibbles[l] >> 4) : (nibbles[l] & 0x0F);
                if (five) q |= ((qh[l] >> j) & 1) << 4;
                out[j * 32 + l] = dj * (float)q - mj;
            }
        }
        return;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = half_to_float(b + 208);
        for (int i = 0; i < 256; i++) {
            int half = i / 128, within = i % 128, l = within % 32, quarter = within / 32;
            int low = (ql[half * 64 + (quarter % 2) * 32 + l] >> (4 * (quarter / 2))) & 0x0F;
            int high = (qh[half * 32 + l] >> (2 * quarter)) & 3;
            out[i] = (d * (float)scales[i / 16]) * (float)((low | (high << 4)) - 32);
        }
        return;
    }
    }
}

static void decode_row(int type, const uint8_t *row, int64_t cols, float *out) {
    if (type == T_F32) { memcpy(out, row, (size_t)cols * 4); return; }
    if (type == T_F16) { for (int64_t i = 0; i < cols; i++) out[i] = half_to_float(row + 2 * i); return; }
    if (type == T_BF16) {
        for (int64_t i = 0; i < cols; i++) {
            uint32_t bits = ((uint32_t)row[2 * i] | ((uint32_t)row[2 * i + 1] << 8)) << 16;
            memcpy(out + i, &bits, 4);
        }
        return;
    }
    int64_t values, bytes;
    block_shape(type, &values, &bytes);
    for (int64_t k = 0; k < cols / values; k++) decode_block(type, row + k * bytes, out + k * values);
}

/* the formats gguf_matmul.c and gguf_panels.c multiply as stored */
static int gguf_executable_type(int type) {
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* each half group's sum of activation levels (xq [n * 16] -> out [n]): Q6_K's -32 offset, its scales per 16 */
static void half_group_sums(const int8_t *xq, int64_t n, int32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        int32_t sum = 0;
        for (int j = 0; j < 16; j++) sum += xq[16 * i + j];
        out[i] = sum;
    }
}

/* bytes of one row of `cols` values; 0: not decodable here (an unknown type, or cols not whole blocks) */
int64_t gguf_row_bytes(int type, int64_t cols) {
    int64_t values, bytes;
    block_shape(type, &values, &bytes);
    if (values == 0 || cols % values) return 0;
    return cols / values * bytes;
}

void gguf_dequantize(int type, const uint8_t *src, int64_t rows, int64_t cols, float *out) {
    int64_t row_bytes = gguf_row_bytes(type, cols);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) decode_row(type, src + r * row_bytes, cols, out + r * cols);
}

/* int8 rows: q = round-half-even(w / scale), scale = max(|w|max, 1e-10) / 127, as quant.py's quantize_rows */
void gguf_quantize_int8(int type, const uint8_t *src, int64_t rows, int64_t cols, int8_t *q, float *scales) {
    int64_t row_bytes = gguf_row_bytes(type, cols);
#pragma omp parallel
    {
        float *buffer = malloc((size_t)cols * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            decode_row(type, src + r * row_bytes, cols, buffer);
            float amax = 0.0f;
            for (int64_t i = 0; i < cols; i++) amax = fmaxf(amax, fabsf(buffer[i]));
            float scale = fmaxf(amax, 1e-10f) / 127.0f;
            int8_t *out = q + r * cols;
            for (int64_t i = 0; i < cols; i++) out[i] = (int8_t)nearbyintf(buffer[i] / scale);
            scales[r] = scale;
        }
        free(buffer);
    }
}

/* Rows `index[0..n)` of a [rows, cols] tensor, decoded: an embedding table looked up where the file stores it */
void gguf_gather_rows(int type, const uint8_t *src, int64_t cols, const int64_t *index, int64_t n, float *out) {
    int64_t row_bytes = gguf_row_bytes(type, cols);
#pragma omp parallel for schedule(static) if (n > 16)
    for (int64_t r = 0; r < n; r++) decode_row(type, src + index[r] * row_bytes, cols, out + r * cols);
}
#endif  // TOKENMILL_GGUF_BLOCKS
