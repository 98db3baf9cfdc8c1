/* Linear layers over GGUF weights executed as the file stores them: y[t, j] = sum_k W[j, k] x[t, k] with W in
 * its quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and x quantized to int8 per group of 32 with
 * one float scale (int8_rows.c's quantize_groups, as llama.cpp's q8 activations). Per block, integer dot
 * products of the weights' small integers with the activations' (AVX2 maddubs: unsigned weight levels, signed
 * activations), then float: the block's weight scale x the activation scale; the formats' offsets (Q4_0's -8,
 * Q6_K's -32) and mins (Q4_1, Q4_K, Q5_K) go through each group's activation sum.
 *
 * A row's result depends only on that row and the weights, accumulated in a fixed order (8 float lanes, then a
 * fixed reduction), so it is the same whatever the batch. Output rows are spread over the threads.
 *
 * AVX2 with FMA only (gguf_matmul_available() says); elsewhere the model keeps the int8 backend.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.c"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int gguf_matmul_available(void) { return 1; }

static inline float hsum8_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 32 unsigned weight levels (< 128) x 32 signed activations -> 8 int32 partial sums
static inline __m256i dot_u8s8(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

static inline __m256i load_x(const int8_t *x) { return _mm256_loadu_si256((const __m256i *)x); }

// 16 bytes of nibbles -> 32 levels: the low nibbles first (values 0-15), then the high ones (16-31)
static inline __m256i nibbles_32(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}

// Q5_0's 32 fifth bits (little-endian u32) -> 0x10 in the bytes whose bit is set
static inline __m256i fifth_bits_32(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

static inline float h2f(const uint8_t *p) {
#if defined(__F16C__)
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);  // exact, as half_to_float
#else
    return half_to_float(p);
#endif
}

// 8 bytes -> 8 float lanes
static inline __m256 u8x8_to_ps(const uint8_t *v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)v)));
}

#define TILE 4  // tokens per pass over a row: each block's weights are decoded once for all of them

// One token's activations: q [k] int8 in groups of 32 with scales d [k/32]; each group's sum, dequantized
// (sums [k/32]: the formats' offsets and mins go through it); each half group's integer sum (sums16 [k/16]:
// Q6_K's -32 offset, whose scales are per 16 values)
typedef struct {
    const int8_t *q;
    const float *d, *sums;
    const int32_t *sums16;
} Activations;

/* One weight row against `tile` tokens' activations; each token's sum runs in its own accumulators, in the same
 * order whatever the other tokens. */
static inline __attribute__((always_inline)) void dot_row(
    int type, const uint8_t *w, int64_t k, const Activations *x, float *y, const int tile) {
    __m256 acc[TILE];
    float offsets[TILE];  // the formats' offset and min terms, through the groups' activation sums (tile <= TILE)
    for (int u = 0; u < tile; u++) acc[u] = _mm256_setzero_ps(), offsets[u] = 0.0f;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (type) {
    case T_Q8_0:
        for (int64_t g = 0; g < k / 32; g++, w += 34) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2)), aq = _mm256_sign_epi8(q, q);
            const float d = h2f(w);
            for (int u = 0; u < tile; u++) {
                // signed x signed through maddubs: |w| against x carrying w's sign
                const __m256i p = dot_u8s8(aq, _mm256_sign_epi8(load_x(x[u].q + 32 * g), q));
                acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x[u].d[g]), acc[u]);
            }
        }
        break;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: {
        const int64_t size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        const int with_min = type == T_Q4_1 || type == T_Q5_1;
        const float offset = type == T_Q4_0 ? -8.0f : -16.0f;
        for (int64_t g = 0; g < k / 32; g++, w += size) {
            __m256i q = nibbles_32(w + size - 16);
            if (type == T_Q5_0 || type == T_Q5_1) q = _mm256_or_si256(q, fifth_bits_32(w + (with_min ? 4 : 2)));
            const float dw = h2f(w), m = with_min ? h2f(w + 2) : 0.0f;
            for (int u = 0; u < tile; u++) {
                acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q, load_x(x[u].q + 32 * g))),
                                         _mm256_set1_ps(dw * x[u].d[g]), acc[u]);
                // w = d (q - 8), d (q - 16) or d q + m
                offsets[u] += (with_min ? m : offset * dw) * x[u].sums[g];
            }
        }
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        __m256 min_acc[TILE];  // the mins' terms, a lane per group of the superblock
        for (int u = 0; u < tile; u++) min_acc[u] = _mm256_setzero_ps();
        for (int64_t b = 0; b < k / 256; b++, w += size) {
            const uint8_t *qs = w + (five ? 48 : 16);
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
            uint8_t sc[8], mn[8];
            for (int j = 0; j < 8; j++) scale_min_k4(w + 4, j, sc + j, mn + j);
            // the 8 groups' weight scales and mins as float lanes, times each token's activation scales
            const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(h2f(w)), u8x8_to_ps(sc));
            const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(h2f(w + 2)), u8x8_to_ps(mn));
            float scale[TILE][8];
            for (int u = 0; u < tile; u++) {
                _mm256_storeu_ps(scale[u], _mm256_mul_ps(ds, _mm256_loadu_ps(x[u].d + 8 * b)));
                min_acc[u] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(x[u].sums + 8 * b), min_acc[u]);
            }
            for (int pair = 0; pair < 4; pair++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * pair));
                for (int half = 0; half < 2; half++) {
                    const int j = 2 * pair + half;
                    __m256i q = half ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
                    if (five)
                        q = _mm256_or_si256(q, _mm256_slli_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
                    for (int u = 0; u < tile; u++) {
                        const __m256i p = dot_u8s8(q, load_x(x[u].q + 32 * (8 * b + j)));
                        acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(scale[u] + j), acc[u]);
                    }
                }
            }
        }
        for (int u = 0; u < tile; u++) offsets[u] = -hsum8_ps(min_acc[u]);
        break;
    }
    case T_Q6_K:
        for (int64_t b = 0; b < k / 256; b++, w += 210) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *scales = (const int8_t *)(w + 192);
            const float d = h2f(w + 208);
            for (int half = 0; half < 2; half++) {
                const __m256i la = _mm256_loadu_si256((const __m256i *)(ql + 64 * half));
                const __m256i lb = _mm256_loadu_si256((const __m256i *)(ql + 64 * half + 32));
                const __m256i hv = _mm256_loadu_si256((const __m256i *)(qh + 32 * half));
                for (int quarter = 0; quarter < 4; quarter++) {
                    const __m256i l = quarter % 2 ? lb : la;
                    const __m256i low = _mm256_and_si256(quarter < 2 ? l : _mm256_srli_epi16(l, 4), low4);
                    const __m256i high = _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(hv, 2 * quarter), _mm256_set1_epi8(3)), 4);
                    const __m256i levels = _mm256_or_si256(low, high);
                    const int64_t g = 8 * b + 4 * half + quarter;  // the activation group (32 values)
                    const int8_t *s = scales + 8 * half + 2 * quarter;  // its two weight groups of 16
                    const __m256i sc = _mm256_set_m128i(_mm_set1_epi16(s[1]), _mm_set1_epi16(s[0]));
                    for (int u = 0; u < tile; u++) {
                        // levels 0..63; their -32 offset through the half groups' integer sums (exact in float)
                        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(levels, load_x(x[u].q + 32 * g)),
                                                            sc);
                        const float dx = d * x[u].d[g];
                        acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx), acc[u]);
                        offsets[u] -= dx * (float)(32 * (s[0] * x[u].sums16[2 * g] + s[1] * x[u].sums16[2 * g + 1]));
                    }
                }
            }
        }
        break;
    }
    for (int u = 0; u < tile; u++) y[u] = hsum8_ps(acc[u]) + offsets[u];
}

// the one-token and the full-tile variants (a token's arithmetic is the same in both)
static void dot_row_1(int type, const uint8_t *w, int64_t k, const Activations *x, float *y) {
    dot_row(type, w, k, x, y, 1);
}

static void dot_row_tile(int type, const uint8_t *w, int64_t k, const Activations *x, float *y) {
    dot_row(type, w, k, x, y, TILE);
}

int gguf_matmul_supports(int type) { return gguf_executable_type(type); }

/* out[t * out_stride + j] = W[row(j)] . x[t] (+ bias[j]) for the outputs j of `parts` stacked tensors (a fused
 * projection: q, k, v): part p has rows[p] outputs, its blocks of `types[p]` at weights[p] (rows of k values,
 * contiguous) and row(j) = row_index[p][j] (NULL: in order). xq/xd/xs: quantize_groups' outputs for x [tokens, k]. */
void gguf_matmul(int64_t parts, const int *types, const uint8_t *const *weights, const int64_t *rows,
                 const int64_t *const *row_index, int64_t k, const int8_t *xq, const float *xd, const int32_t *xs,
                 int64_t tokens, const float *bias, float *out, int64_t out_stride) {
    const int64_t groups = k / 32;
    int64_t n = 0;
    for (int64_t p = 0; p < parts; p++) n += rows[p];
    float *sums_f = malloc(sizeof(float) * (size_t)(tokens * groups));  // each group's activation sum, as a float
    for (int64_t i = 0; i < tokens * groups; i++) sums_f[i] = xd[i] * (float)(xs[i] / 128);
    int q6k = 0;  // only Q6_K reads the half-group sums
    for (int64_t p = 0; p < parts; p++) q6k |= types[p] == T_Q6_K;
    int32_t *sums16 = malloc(sizeof(int32_t) * (size_t)(tokens * 2 * groups));
    if (q6k) half_group_sums(xq, tokens * 2 * groups, sums16);
    int64_t *row_bytes = malloc(sizeof(int64_t) * (size_t)parts);
    for (int64_t p = 0; p < parts; p++) row_bytes[p] = gguf_row_bytes(types[p], k);
#pragma omp parallel for schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += 16)
        for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
            Activations x[TILE];
            for (int u = 0; u < TILE; u++) {  // a short last tile repeats its last token (results unused)
                const int64_t t = t0 + u < tokens ? t0 + u : tokens - 1;
                x[u] = (Activations){xq + t * k, xd + t * groups, sums_f + t * groups, sums16 + t * 2 * groups};
            }
            for (int64_t j = j0; j < n && j < j0 + 16; j++) {
                int64_t p = 0, local = j;
                while (local >= rows[p]) local -= rows[p++];
                const int64_t stored = row_index && row_index[p] ? row_index[p][local] : local;
                const uint8_t *row = weights[p] + stored * row_bytes[p];
                float y[TILE];
                (tokens - t0 == 1 ? dot_row_1 : dot_row_tile)(types[p], row, k, x, y);
                for (int u = 0; u < TILE && t0 + u < tokens; u++)
                    out[(t0 + u) * out_stride + j] = bias ? y[u] + bias[j] : y[u];
            }
        }
    free(sums16);
    free(sums_f);
    free(row_bytes);
}
#else
int gguf_matmul_available(void) { return 0; }
int gguf_matmul_supports(int type) { (void)type; return 0; }
void gguf_matmul(int64_t parts, const int *types, const uint8_t *const *weights, const int64_t *rows,
                 const int64_t *const *row_index, int64_t k, const int8_t *xq, const float *xd, const int32_t *xs,
                 int64_t tokens, const float *bias, float *out, int64_t out_stride) {
    (void)parts, (void)types, (void)weights, (void)rows, (void)row_index, (void)k, (void)xq, (void)xd, (void)xs,
        (void)tokens, (void)bias, (void)out, (void)out_stride;
}
#endif
