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
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define LORA_TILE_ROWS 16
#define LORA_MAX_RANK 256

// One projection's LoRA parts in the resident slots (lora/slots.py: ProjectionLoRA).
typedef struct {
    int64_t parts;  // 0: no adapter targets this projection
    int64_t in;  // input features
    int64_t max_rank;  // R: a multiple of 8
    const int64_t *offset;  // [parts] first output column
    const int64_t *width;  // [parts]
    const float *const *at;  // [parts] -> [slots][in][R]
    const float *const *bt;  // [parts] -> [slots][R][width]
    const int32_t *ranks;  // [parts][slots]: the rank of each slot's adapter on the part (0: not targeted)
    int64_t slots;
} LoRAWeights;

// The step's rows by slot (lora/slots.py: LoRABatch).
typedef struct {
    int64_t segments;
    const int64_t *slot;  // [segments]
    const int64_t *start;  // [segments + 1] into rows
    const int64_t *rows;  // rows of the flat batch, grouped by slot
} LoRABatch;

// h[t][0:cols] = x[rows[t]] @ at[:, 0:cols] for t < count (cols a multiple of 8, at's row stride R)
static void lora_shrink(const float *x, int64_t x_stride, const int64_t *rows, int64_t count, const float *at,
                        int64_t in, int64_t R, int64_t cols, float h[][LORA_MAX_RANK]) {
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; t + 4 <= count; t += 4) {
        const float *x0 = x + rows[t] * x_stride, *x1 = x + rows[t + 1] * x_stride;
        const float *x2 = x + rows[t + 2] * x_stride, *x3 = x + rows[t + 3] * x_stride;
        for (int64_t c = 0; c < cols; c += 8) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < in; ++k) {
                const __m256 w = _mm256_loadu_ps(at + k * R + c);
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x0 + k), w, a0);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x1 + k), w, a1);
                a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(x2 + k), w, a2);
                a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(x3 + k), w, a3);
            }
            _mm256_storeu_ps(h[t] + c, a0);
            _mm256_storeu_ps(h[t + 1] + c, a1);
            _mm256_storeu_ps(h[t + 2] + c, a2);
            _mm256_storeu_ps(h[t + 3] + c, a3);
        }
    }
    for (; t < count; ++t) {
        const float *xr = x + rows[t] * x_stride;
        for (int64_t c = 0; c < cols; c += 8) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t k = 0; k < in; ++k) a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + k), _mm256_loadu_ps(at + k * R + c), a);
            _mm256_storeu_ps(h[t] + c, a);
        }
    }
#else
    for (; t < count; ++t) {
        const float *xr = x + rows[t] * x_stride;
        for (int64_t c = 0; c < cols; ++c) {
            float a = 0.0f;
            for (int64_t k = 0; k < in; ++k) a = fmaf(xr[k], at[k * R + c], a);
            h[t][c] = a;
        }
    }
#endif
}

// y[rows[t]][offset + c] += sum over r < rank of h[t][r] * bt[r][c] (the sum formed first, then added)
static void lora_expand(float h[][LORA_MAX_RANK], int64_t count, int64_t rank, const float *bt, int64_t width,
                        float *y, int64_t y_stride, const int64_t *rows, int64_t offset) {
    int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; c + 8 <= width; c += 8) {
        int64_t t = 0;
        for (; t + 4 <= count; t += 4) {
            __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
            for (int64_t r = 0; r < rank; ++r) {
                const __m256 w = _mm256_loadu_ps(bt + r * width + c);
                d0 = _mm256_fmadd_ps(_mm256_set1_ps(h[t][r]), w, d0);
                d1 = _mm256_fmadd_ps(_mm256_set1_ps(h[t + 1][r]), w, d1);
                d2 = _mm256_fmadd_ps(_mm256_set1_ps(h[t + 2][r]), w, d2);
                d3 = _mm256_fmadd_ps(_mm256_set1_ps(h[t + 3][r]), w, d3);
            }
            const __m256 d[4] = {d0, d1, d2, d3};
            for (int j = 0; j < 4; ++j) {
                float *out = y + rows[t + j] * y_stride + offset + c;
                _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), d[j]));
            }
        }
        for (; t < count; ++t) {
            __m256 d = _mm256_setzero_ps();
            for (int64_t r = 0; r < rank; ++r)
                d = _mm256_fmadd_ps(_mm256_set1_ps(h[t][r]), _mm256_loadu_ps(bt + r * width + c), d);
            float *out = y + rows[t] * y_stride + offset + c;
            _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), d));
        }
    }
#endif
    for (; c < width; ++c)
        for (int64_t t = 0; t < count; ++t) {
            float d = 0.0f;
            for (int64_t r = 0; r < rank; ++r) d = fmaf(h[t][r], bt[r * width + c], d);
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
    lora_shrink(x, x_stride, rows, count, w->at[part] + slot * in * R, in, R, (rank + 7) / 8 * 8, h);
    lora_expand(h, count, rank, w->bt[part] + slot * R * width, width, y, y_stride, rows, w->offset[part]);
}

void lora_add(const LoRAWeights *w, const LoRABatch *batch, const float *x, int64_t x_stride, float *y,
              int64_t y_stride) {
    if (w == NULL || batch == NULL || w->parts == 0) return;
    // units: (segment tile, part); parts write disjoint columns, tiles disjoint rows
    int64_t units = 0;
    for (int64_t s = 0; s < batch->segments; ++s) {
        const int64_t count = batch->start[s + 1] - batch->start[s];
        units += (count + LORA_TILE_ROWS - 1) / LORA_TILE_ROWS * w->parts;
    }
    int64_t *unit_segment = malloc(sizeof(int64_t) * (size_t)units * 3);
    int64_t *unit_first = unit_segment + units, *unit_part = unit_first + units, u = 0;
    for (int64_t s = 0; s < batch->segments; ++s)
        for (int64_t first = batch->start[s]; first < batch->start[s + 1]; first += LORA_TILE_ROWS)
            for (int64_t p = 0; p < w->parts; ++p) {
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
