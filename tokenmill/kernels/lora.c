// LoRA additions for a flat batch that mixes adapters (Punica's SGMV shape, on CPU): the rows of the batch are
// grouped by the slot of their adapter, and for each group and each part of a projection
//     y[row, offset : offset + width] += (x[row] . A[slot]^T) @ Bt[slot]
// where A [rank, in] and Bt [rank, width] (the scale folded in). A group streams its adapter's weights once
// per tile of rows, whatever the number of rows, so a decode step reads each resident adapter at most once.
//
// Batch-invariant: a row's result depends only on that row (fixed summation order per row), so a request's
// output does not change with the batch around it.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define LORA_TILE_ROWS 16
#define LORA_COLUMN_BLOCK 256

// One projection's LoRA parts in the resident slots (model/lora_layers.py: ProjectionLoRA).
typedef struct {
    int64_t parts;  // 0: no adapter targets this projection
    int64_t in;  // input features
    int64_t max_rank;
    const int64_t *offset;  // [parts] first output column
    const int64_t *width;  // [parts]
    const float *const *a;  // [parts] -> [slots][max_rank][in]
    const float *const *bt;  // [parts] -> [slots][max_rank][width]
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

static float lora_dot(const float *a, const float *x, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(x + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(x + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(x + i + 24), s3);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    for (int j = 0; j < 8; ++j) total += lanes[j];
#endif
    for (; i < n; ++i) total += a[i] * x[i];
    return total;
}

// One unit of work: rows[0:count] of one slot, one part.
static void lora_part_rows(const LoRAWeights *w, int64_t part, int64_t slot, const int64_t *rows, int64_t count,
                      const float *x, int64_t x_stride, float *y, int64_t y_stride) {
    const int64_t rank = w->ranks[part * w->slots + slot];
    if (rank == 0) return;
    const int64_t in = w->in, width = w->width[part], offset = w->offset[part];
    const float *a = w->a[part] + slot * w->max_rank * in;
    const float *bt = w->bt[part] + slot * w->max_rank * width;
    float h[LORA_TILE_ROWS][256];  // rank <= 256 (lora/slots.py checks)
    for (int64_t r = 0; r < rank; ++r)
        for (int64_t t = 0; t < count; ++t) h[t][r] = lora_dot(a + r * in, x + rows[t] * x_stride, in);
    float delta[LORA_COLUMN_BLOCK];
    for (int64_t c0 = 0; c0 < width; c0 += LORA_COLUMN_BLOCK) {
        const int64_t cols = width - c0 < LORA_COLUMN_BLOCK ? width - c0 : LORA_COLUMN_BLOCK;
        for (int64_t t = 0; t < count; ++t) {
            memset(delta, 0, sizeof(float) * (size_t)cols);
            for (int64_t r = 0; r < rank; ++r) {
                const float hr = h[t][r], *b = bt + r * width + c0;
                for (int64_t c = 0; c < cols; ++c) delta[c] += hr * b[c];
            }
            float *out = y + rows[t] * y_stride + offset + c0;
            for (int64_t c = 0; c < cols; ++c) out[c] += delta[c];
        }
    }
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
