// LoRA additions for a flat batch that mixes adapters (Punica's SGMV shape, on CPU): the rows of the batch are
// grouped by the slot of their adapter, and for each group and each part of a projection
//     y[row, offset : offset + width] += (x[row] @ At[slot]) @ Bt[slot]
// with At [in, R] and Bt [R, width] (the scale folded into Bt). A group streams its adapter's weights once per
// tile of rows, whatever the number of rows, so a decode step reads each resident adapter at most once.
//
// Batch-invariant: every element is one chain of fused multiply-adds in a fixed order (over `in` for the
// shrink, over the rank for the expand), vectorized across outputs only, so a row's result depends on that row
// alone, whatever its tile or its batch. The scalar tails use fmaf, which rounds exactly as the vector FMA.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LORA_TILE_ROWS 16
#define LORA_MAX_RANK 256

// One projection's LoRA parts in the resident slots (lora/slots.py: ProjectionLoRA).
typedef struct {
    int64_t parts;  // 0: no adapter targets this projection
    int64_t in;  // input features
    int64_t max_rank;  // R: a multiple of 16
    const int64_t *offset;  // [parts] first output column
    const int64_t *width;  // [parts]
    const void *const *at;  // [parts] -> [slots][in][R]
    const void *const *bt;  // [parts] -> [slots][R][width]
    const int32_t *ranks;  // [parts][slots]: the rank of each slot's adapter on the part (0: not targeted)
    int64_t slots;
    int64_t bf16;  // the weights are bfloat16 (else float32); the arithmetic is float32 either way
} LoRAWeights;

// The step's rows by slot (lora/slots.py: LoRABatch).
typedef struct {
    int64_t segments;
    const int64_t *slot;  // [segments]
    const int64_t *start;  // [segments + 1] into rows
    const int64_t *rows;  // rows of the flat batch, grouped by slot
} LoRABatch;

#if defined(__AVX512F__)
#define LORA_VW 16
typedef __m512 lora_vec;
#define LORA_ZERO() _mm512_setzero_ps()
#define LORA_LOAD(p) _mm512_loadu_ps(p)
#define LORA_STORE(p, v) _mm512_storeu_ps(p, v)
#define LORA_SET1(x) _mm512_set1_ps(x)
#define LORA_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define LORA_ADD(a, b) _mm512_add_ps(a, b)
#define LORA_LOAD_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif defined(__AVX2__) && defined(__FMA__)
#define LORA_VW 8
typedef __m256 lora_vec;
#define LORA_ZERO() _mm256_setzero_ps()
#define LORA_LOAD(p) _mm256_loadu_ps(p)
#define LORA_STORE(p, v) _mm256_storeu_ps(p, v)
#define LORA_SET1(x) _mm256_set1_ps(x)
#define LORA_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define LORA_ADD(a, b) _mm256_add_ps(a, b)
#define LORA_LOAD_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif

static inline float lora_bf16(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// element i of a weight array of either type
static inline float lora_weight(const void *w, int64_t i, int bf16) {
    return bf16 ? lora_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#ifdef LORA_VW
static inline lora_vec lora_load_weights(const void *w, int64_t i, int bf16) {
    return bf16 ? LORA_LOAD_BF16((const uint16_t *)w + i) : LORA_LOAD((const float *)w + i);
}
#endif

// h[t][0:cols] = x[rows[t]] @ at[:, 0:cols] for t < count (cols a multiple of 16, at's row stride R)
static void lora_shrink(const float *x, int64_t x_stride, const int64_t *rows, int64_t count, const void *at,
                        int64_t in, int64_t R, int64_t cols, float h[][LORA_MAX_RANK], int bf16) {
#ifdef LORA_VW
    // 4 rows x 2 vectors of ranks per pass: each x broadcast feeds 2 FMAs, each weight load 4
    for (int64_t c = 0; c < cols; c += 2 * LORA_VW) {
        const int two = c + 2 * LORA_VW <= cols;
        int64_t t = 0;
        for (; t < count; t += 4) {
            const int64_t n = count - t < 4 ? count - t : 4;
            const float *xr[4];
            for (int j = 0; j < 4; ++j) xr[j] = x + rows[t + (j < n ? j : 0)] * x_stride;
            lora_vec a[4][2];
            for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = LORA_ZERO();
            if (two) {
                for (int64_t k = 0; k < in; ++k) {
                    const lora_vec w0 = lora_load_weights(at, k * R + c, bf16);
                    const lora_vec w1 = lora_load_weights(at, k * R + c + LORA_VW, bf16);
                    for (int j = 0; j < 4; ++j) {
                        const lora_vec b = LORA_SET1(xr[j][k]);
                        a[j][0] = LORA_FMA(b, w0, a[j][0]);
                        a[j][1] = LORA_FMA(b, w1, a[j][1]);
                    }
                }
            } else {
                for (int64_t k = 0; k < in; ++k) {
                    const lora_vec w0 = lora_load_weights(at, k * R + c, bf16);
                    for (int j = 0; j < 4; ++j) a[j][0] = LORA_FMA(LORA_SET1(xr[j][k]), w0, a[j][0]);
                }
            }
            for (int j = 0; j < n; ++j) {
                LORA_STORE(h[t + j] + c, a[j][0]);
                if (two) LORA_STORE(h[t + j] + c + LORA_VW, a[j][1]);
            }
        }
    }
#else
    for (int64_t t = 0; t < count; ++t) {
        const float *xr = x + rows[t] * x_stride;
        for (int64_t c = 0; c < cols; ++c) {
            float a = 0.0f;
            for (int64_t k = 0; k < in; ++k) a = fmaf(xr[k], lora_weight(at, k * R + c, bf16), a);
            h[t][c] = a;
        }
    }
#endif
}

// y[rows[t]][offset + c] += sum over r < rank of h[t][r] * bt[r][c] (the sum formed first, then added)
static void lora_expand(float h[][LORA_MAX_RANK], int64_t count, int64_t rank, const void *bt, int64_t width,
                        float *y, int64_t y_stride, const int64_t *rows, int64_t offset, int bf16) {
    int64_t c = 0;
#ifdef LORA_VW
    // 4 rows x 2 vectors of columns per pass
    for (; c + LORA_VW <= width; c += 2 * LORA_VW) {
        const int two = c + 2 * LORA_VW <= width;
        for (int64_t t = 0; t < count; t += 4) {
            const int64_t n = count - t < 4 ? count - t : 4;
            lora_vec d[4][2];
            for (int j = 0; j < 4; ++j) d[j][0] = d[j][1] = LORA_ZERO();
            const float *hr[4];
            for (int j = 0; j < 4; ++j) hr[j] = h[t + (j < n ? j : 0)];
            if (two) {
                for (int64_t r = 0; r < rank; ++r) {
                    const lora_vec w0 = lora_load_weights(bt, r * width + c, bf16);
                    const lora_vec w1 = lora_load_weights(bt, r * width + c + LORA_VW, bf16);
                    for (int j = 0; j < 4; ++j) {
                        const lora_vec b = LORA_SET1(hr[j][r]);
                        d[j][0] = LORA_FMA(b, w0, d[j][0]);
                        d[j][1] = LORA_FMA(b, w1, d[j][1]);
                    }
                }
            } else {
                for (int64_t r = 0; r < rank; ++r) {
                    const lora_vec w0 = lora_load_weights(bt, r * width + c, bf16);
                    for (int j = 0; j < 4; ++j) d[j][0] = LORA_FMA(LORA_SET1(hr[j][r]), w0, d[j][0]);
                }
            }
            for (int j = 0; j < n; ++j) {
                float *out = y + rows[t + j] * y_stride + offset + c;
                LORA_STORE(out, LORA_ADD(LORA_LOAD(out), d[j][0]));
                if (two) LORA_STORE(out + LORA_VW, LORA_ADD(LORA_LOAD(out + LORA_VW), d[j][1]));
            }
        }
        if (!two) {
            c += LORA_VW;
            break;
        }
    }
#endif
    for (; c < width; ++c)
        for (int64_t t = 0; t < count; ++t) {
            float d = 0.0f;
            for (int64_t r = 0; r < rank; ++r) d = fmaf(h[t][r], lora_weight(bt, r * width + c, bf16), d);
            y[rows[t] * y_stride + offset + c] += d;
        }
}

// One unit of work: rows[0:count] (count <= LORA_TILE_ROWS) of one slot, one part.
static void lora_part_rows(const LoRAWeights *w, int64_t part, int64_t slot, const int64_t *rows, int64_t count,
                           const float *x, int64_t x_stride, float *y, int64_t y_stride) {
    const int64_t rank = w->ranks[part * w->slots + slot];
    if (rank == 0) return;
    const int64_t in = w->in, R = w->max_rank, width = w->width[part];
    float h[LORA_TILE_ROWS][LORA_MAX_RANK];
    const int bf16 = (int)w->bf16;
    const size_t element = bf16 ? 2 : 4;
    const char *at = (const char *)w->at[part] + (size_t)(slot * in * R) * element;
    const char *bt = (const char *)w->bt[part] + (size_t)(slot * R * width) * element;
    lora_shrink(x, x_stride, rows, count, at, in, R, (rank + 15) / 16 * 16, h, bf16);
    lora_expand(h, count, rank, bt, width, y, y_stride, rows, w->offset[part], bf16);
}

void lora_add(const LoRAWeights *w, const LoRABatch *batch, const float *x, int64_t x_stride, float *y,
              int64_t y_stride) {
    if (w == NULL || batch == NULL || w->parts == 0) return;
    // units: (segment, part, tile of rows); parts write disjoint columns, tiles disjoint rows. The tiles of one
    // part follow each other, so its weights stay in cache from one tile to the next.
    int64_t units = 0;
    for (int64_t s = 0; s < batch->segments; ++s) {
        const int64_t count = batch->start[s + 1] - batch->start[s];
        units += (count + LORA_TILE_ROWS - 1) / LORA_TILE_ROWS * w->parts;
    }
    int64_t *unit_segment = malloc(sizeof(int64_t) * (size_t)units * 3);
    int64_t *unit_first = unit_segment + units, *unit_part = unit_first + units, u = 0;
    for (int64_t s = 0; s < batch->segments; ++s)
        for (int64_t p = 0; p < w->parts; ++p)
            for (int64_t first = batch->start[s]; first < batch->start[s + 1]; first += LORA_TILE_ROWS) {
                unit_segment[u] = s, unit_first[u] = first, unit_part[u] = p;
                ++u;
            }
#pragma omp parallel for schedule(dynamic, 1) if (units > 1)
    for (int64_t i = 0; i < units; ++i) {
        const int64_t s = unit_segment[i], first = unit_first[i], end = batch->start[s + 1];
        const int64_t count = end - first < LORA_TILE_ROWS ? end - first : LORA_TILE_ROWS;
        lora_part_rows(w, unit_part[i], batch->slot[s], batch->rows + first, count, x, x_stride, y, y_stride);
    }
    free(unit_segment);
}
