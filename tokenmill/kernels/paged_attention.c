// Paged attention on CPU over one flat batch of prompt chunks and decodes. Keys and values are read in place
// from each sequence's block table (no gathered copy of the context).
//
// Cache layout (model/attention.py): K [num_blocks, num_kv_heads, head_dim, block_size] (each block's keys
// transposed, so one block's scores are a vector over its tokens) and V [num_blocks, num_kv_heads, block_size,
// head_dim], as float32, bf16 or an 8-bit format with a bf16 scale per token and KV head ([num_blocks,
// num_kv_heads, block_size]; kv_formats.h). 8-bit values are dequantized in registers (attention_avx512.h,
// attention_avx2.h) or, on other CPUs and shapes, a block at a time into an L1 tile: never a float copy of the
// cache.
//
// Every query row is computed by the same sequence of float operations, whatever its batch: keys in block
// order, an online softmax updated once per key block, each score a sequential sum over head_dim (vectorized
// across the block's tokens, never reassociated), fused multiply-adds only where written (built with
// -ffp-contract=off). So a token's attention output is bit-identical whether it is computed alone, in a prompt
// chunk of any size, or as a decode next to other sequences; with exact int8 GEMMs that makes whole steps
// batch-invariant.
//
// Built at first use by tokenmill/kernels/build.py; OpenMP resolves to the libgomp that torch already
// loaded (same soname), so both share one thread pool.
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }  // built without OpenMP: one thread
#endif
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

// A query row packed for the dot-product instructions of the AVX-512 block path: an int8 cache's integer scores
// take q ~= scale * q8, four values a word (the operand vpdpbusd broadcasts), and 128 * sum(q8), taken back from
// the sums of (k + 128) * q8; a bf16 cache's scores take q rounded to bf16, two values a word (vdpbf16ps's).
typedef struct {
    int32_t words[MAX_HEAD_DIM / 2];
    float scale;
    int32_t correction;
} QueryRow;

static void quantize_query(const float *q, int64_t head_dim, QueryRow *row) {
    float amax = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
    row->scale = amax / 127.0f;
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int8_t *bytes = (int8_t *)row->words;
    int32_t sum = 0;
    for (int64_t d = 0; d < head_dim; ++d) {
        bytes[d] = (int8_t)nearbyintf(q[d] * inverse);
        sum += bytes[d];
    }
    row->correction = 128 * sum;
}

// acc_rows(acc + r, corr + r, s + r, ROWS, keys[r + ROWS - 1], ...) over runs of up to 8 rows from first_row,
// ROWS a constant in each call so that the run's loops unroll (rows are in position order: a run's last row
// sees the most keys)
#define FOR_RUNS_OF_8_ROWS(acc_rows, first_row, n_rows, ...)                                                      \
    for (int64_t r_ = (first_row); r_ < (n_rows); r_ += 8) {                                                      \
        switch ((n_rows) - r_ < 8 ? (n_rows) - r_ : 8) {                                                          \
            case 8: acc_rows(acc + r_, corr + r_, s + r_, 8, keys[r_ + 7], __VA_ARGS__); break;                   \
            case 7: acc_rows(acc + r_, corr + r_, s + r_, 7, keys[r_ + 6], __VA_ARGS__); break;                   \
            case 6: acc_rows(acc + r_, corr + r_, s + r_, 6, keys[r_ + 5], __VA_ARGS__); break;                   \
            case 5: acc_rows(acc + r_, corr + r_, s + r_, 5, keys[r_ + 4], __VA_ARGS__); break;                   \
            case 4: acc_rows(acc + r_, corr + r_, s + r_, 4, keys[r_ + 3], __VA_ARGS__); break;                   \
            case 3: acc_rows(acc + r_, corr + r_, s + r_, 3, keys[r_ + 2], __VA_ARGS__); break;                   \
            case 2: acc_rows(acc + r_, corr + r_, s + r_, 2, keys[r_ + 1], __VA_ARGS__); break;                   \
            default: acc_rows(acc + r_, corr + r_, s + r_, 1, keys[r_], __VA_ARGS__); break;                      \
        }                                                                                                         \
    }

#include "attention_avx512.h"
#include "attention_avx2.h"
#ifndef BF16_DOTS
int paged_attention_bf16_dots(void) { return 0; }
#endif
#ifndef PACKED_QUERIES  // no dot-product path on this CPU: no query is packed
static inline int packed_query(int64_t kind) { return (void)kind, 0; }
static void pack_query(const float *q, int64_t head_dim, int64_t kind, QueryRow *row) {
    (void)kind;
    quantize_query(q, head_dim, row);
}
#endif

// A block of stored values [rows][cols] as float32 into `tile`, each times its token's scale (8-bit formats; the
// token is the column of a K block, the row of a V block).
static void decode_kv_block(const void *src, const uint16_t *scales, int64_t rows, int64_t cols, int64_t kind,
                         int token_is_column, float *tile) {
    for (int64_t r = 0; r < rows; ++r) {
        const void *row = (const char *)src + r * cols * kv_elem_bytes(kind);
        if (!kv_scaled(kind) || token_is_column) {
            kv_decode(row, cols, kind, 1.0f, tile + r * cols);
            if (kv_scaled(kind))
                for (int64_t c = 0; c < cols; ++c) tile[r * cols + c] *= bf16_value(scales[c]);
        } else {
            kv_decode(row, cols, kind, bf16_value(scales[r]), tile + r * cols);
        }
    }
}

// One kv head's query rows (in position order; rows active .. n_rows - 1 see keys in this block) over one
// block. `lo` (sliding windows, else NULL): the first key each row sees. Offsets count elements of the cache
// (`offset`, `next_offset`: this block's and a later one's, -1 for none) and of the scales (`scale_offset`).
static void attend_block(float acc[][MAX_HEAD_DIM], float *m, float l[][16], float s[][MAX_BLOCK], const float *const *qs,
                         const QueryRow *qr, const int64_t *len, const int64_t *lo, int64_t active, int64_t n_rows, int64_t b,
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
#elif defined(AVX2_BLOCKS)
    if (block_size == 16 && head_dim % 64 == 0 && kv_scaled(kind)) {
        if (next_offset >= 0) {  // a later block's scales (its values: the hardware prefetchers, within the page)
            _mm_prefetch((const char *)(k_scale + next_offset / head_dim), PF_HINT);
            _mm_prefetch((const char *)(v_scale + next_offset / head_dim), PF_HINT);
        }
        attend_block16_avx2_of[kind - KV_INT8](acc, m, l, s, qs, len, lo, active, n_rows, b * block_size,
                                               (const char *)k_cache + offset * elem,
                                               (const char *)v_cache + offset * elem, ks, vs, head_dim, scale);
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
        // the query rows packed for the block path's integer or bf16 dot products, when its format takes them
        const int packed = block_size == 16 && head_dim % 64 == 0 && packed_query(kv_kind);
        QueryRow qr[packed ? MAX_TILE : 1];
        // row i = (kv head h of this task, row r, head g of its group): each kv head's rows are contiguous
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t r = 0; r < rows; ++r) {
                const int64_t row = query_start[seq] + first + r;
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t i = h * n_rows + r * group + g;
                    len[i] = seq_lens[seq] - q_len + first + r + 1;  // causal: keys up to this row's position
                    lo[i] = window > 0 && len[i] > window ? len[i] - window : 0;
                    qs[i] = q + row * q_row_stride + ((first_head + h) * group + g) * head_dim;
                    if (packed) pack_query(qs[i], head_dim, kv_kind, &qr[i]);
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
                attend_block(acc + i, m + i, l + i, s + i, qs + i, packed ? qr + i : NULL, len + i, window > 0 ? lo + i : NULL, active, end,
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
