// Paged attention on CPU over one flat batch of prompt chunks and decodes. Keys and values are read in place
// from each sequence's block table (no gathered copy of the context).
//
// Cache layout (model/attention.py): K [num_blocks, num_kv_heads, head_dim, block_size] (each block's keys
// transposed, so one block's scores are a vector over its tokens) and V [num_blocks, num_kv_heads, block_size,
// head_dim].
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TILE 64  // (query rows x heads per kv head) handled by one task
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

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

void paged_attention(
    float *out,                   // [T, num_heads, head_dim]: rows of `row_stride` floats
    const float *q,               // [T, num_heads, head_dim]: rows of `q_row_stride` floats
    const float *k_cache,         // [num_blocks, num_kv_heads, head_dim, block_size]
    const float *v_cache,         // [num_blocks, num_kv_heads, block_size, head_dim]
    const int64_t *query_start,   // [num_seqs + 1]: sequence s owns rows query_start[s] .. query_start[s+1]
    const int64_t *seq_lens,      // [num_seqs]: context length after this step (its last row sees all of it)
    const int64_t *block_tables,  // [num_seqs, max_blocks]
    int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t q_row_stride, int64_t row_stride, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tile_rows = MAX_TILE / group < 1 ? 1 : MAX_TILE / group;
    const int64_t head_block = head_dim * block_size;  // floats of one kv head in one block
    // tasks: (sequence, tile of its query rows, kv head)
    int64_t *task_start = malloc(sizeof(int64_t) * (num_seqs + 1));
    task_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t rows = query_start[s + 1] - query_start[s];
        task_start[s + 1] = task_start[s] + (rows + tile_rows - 1) / tile_rows * num_kv_heads;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < task_start[num_seqs]; ++task) {
        int64_t seq = 0;
        while (task_start[seq + 1] <= task) ++seq;
        const int64_t local = task - task_start[seq];
        const int64_t kvh = local % num_kv_heads, tile = local / num_kv_heads;
        const int64_t q_len = query_start[seq + 1] - query_start[seq];
        const int64_t first = tile * tile_rows;
        const int64_t rows = q_len - first < tile_rows ? q_len - first : tile_rows;
        const int64_t *table = block_tables + seq * max_blocks;
        float acc[MAX_TILE][MAX_HEAD_DIM], m[MAX_TILE], l[MAX_TILE], s[MAX_TILE][MAX_BLOCK];
        int64_t len[MAX_TILE];
        const float *qs[MAX_TILE];
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = query_start[seq] + first + r;
            for (int64_t g = 0; g < group; ++g) {
                const int64_t i = r * group + g;
                len[i] = seq_lens[seq] - q_len + first + r + 1;  // causal: keys up to this row's position
                qs[i] = q + row * q_row_stride + (kvh * group + g) * head_dim;
                m[i] = -INFINITY;
                l[i] = 0.0f;
                memset(acc[i], 0, sizeof(float) * head_dim);
            }
        }
        const int64_t n_rows = rows * group;
        for (int64_t b = 0; b * block_size < len[n_rows - 1]; ++b) {
            const float *kt = k_cache + (table[b] * num_kv_heads + kvh) * head_block;
            const float *vb = v_cache + (table[b] * num_kv_heads + kvh) * head_block;
            // rows are in position order: the ones that still see keys in this block form a suffix
            int64_t active = 0;
            while (len[active] <= b * block_size) ++active;
            block_scores(s + active, qs + active, n_rows - active, kt, head_dim, block_size);
            for (int64_t i = active; i < n_rows; ++i) {
                const int64_t left = len[i] - b * block_size;
                const int64_t n = left < block_size ? left : block_size;
                float *si = s[i];
                float block_max = m[i];
                for (int64_t t = 0; t < n; ++t) {
                    si[t] *= scale;
                    block_max = si[t] > block_max ? si[t] : block_max;
                }
                const float correction = expf(m[i] - block_max);  // exp(-inf) = 0 on the first block
                l[i] *= correction;
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) si[t] = expf(si[t] - block_max);
                for (int64_t t = 0; t < n; ++t) l[i] += si[t];
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
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = query_start[seq] + first + r;
            for (int64_t g = 0; g < group; ++g) {
                const int64_t i = r * group + g;
                float *o = out + row * row_stride + (kvh * group + g) * head_dim;
                const float inv = 1.0f / l[i];
                for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[i][d] * inv;
            }
        }
    }
    free(task_start);
}
