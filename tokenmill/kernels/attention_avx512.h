// The AVX-512 block path of paged_attention.c (included there; it uses that file's definitions): blocks of 16
// tokens, head_dim a multiple of 64, every cache format; on AVX512-VNNI hosts with VBMI an int8 cache's scores
// in integer arithmetic, on AVX512-BF16 hosts bf16 dot products.
#if defined(__AVX512F__)
// Blocks of 16 tokens and head_dim a multiple of 64 in AVX-512, over every cache format: one block's 16
// scores of a row are one register. Per row and block: each score a dot product over head_dim in four
// interleaved partial sums ((p0 + p1) + (p2 + p3)), the block max as a fixed-order register reduction (only
// when a score passes the running max), e^x by exp512_ps, the denominator's 16 partial sums, then
// acc = acc * correction + sum_t p[t] v[t]. Every row goes through exactly these operations whatever its tile,
// so batch invariance holds as in the generic path (whose operation order differs: the two paths are never
// mixed on one machine). bf16 values widen exactly to float32, 8-bit ones are widened and scaled in registers;
// the arithmetic is float32, except an int8 cache's scores on VNNI hosts and, on AVX512-BF16 hosts, a bf16
// cache's scores and every format's sum over V but float32's (below). The weights over V are never 8-bit:
// vpdpbusd on them cost Qwen2.5 a seventh of int8 KV's KL to bf16 KV and two of the 21 fidelity prompts.
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

// 4 rows of 16 bytes [4][16] -> 16 words of their 4 bytes each, row order (the operand vpdpbusd takes): 4 key
// dims of 16 tokens -> per token its 4 dims
static const uint8_t four_rows_to_words[64] = {
    0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
    6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
    12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
static inline __attribute__((always_inline)) void block_scores16_int8(float out[][MAX_BLOCK], const QueryRow *rows,
                                                                      int n_rows, const int8_t *kt,
                                                                      const uint16_t *ks, int64_t head_dim,
                                                                      const char *next_k, const char *next_v) {
    const __m512i index = _mm512_loadu_si512(four_rows_to_words);
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
                acc[r] = _mm512_dpbusd_epi32(acc[r], k, _mm512_set1_epi32(rows[r0 + r].words[g]));
        }
        for (int r = 0; r < count; ++r) {
            const __m512 dot = _mm512_cvtepi32_ps(
                _mm512_sub_epi32(acc[r], _mm512_set1_epi32(rows[r0 + r].correction)));
            _mm512_storeu_ps(out[r0 + r], _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(rows[r0 + r].scale)),
                                                        key_scales));
        }
    }
}

#endif

#if defined(__AVX512BF16__)
// bf16 dot products (vdpbf16ps: two products a lane into float32 at the float multiply-add's rate, so half its
// instructions). A bf16 cache's scores: each query row rounded to bf16 (the keys are bf16 already), two chains
// per row (the even and the odd pairs of dims) added at the end, the same for any tile. Every format's sum over
// V but float32's: each block's softmax weights (times the values' scales) rounded to bf16, as GPU attention
// kernels round them, against the values as bf16 (8-bit ones exactly, before their scales), in token pairs, in
// order; the denominator sums the unrounded weights. On this EPYC: prefill attention 1.6x, 16k decode 1.2-1.3x.
// vdpbf16ps flushes denormals: a row whose running sum over V fell below 2^-126 (values all but zero) could lose
// it to a pair of zero weights that another run's longer last row adds; nothing else depends on the batch.
#define BF16_DOTS 1
int paged_attention_bf16_dots(void) { return 1; }

// two bf16 rows of 16 [2][16] -> 16 words of a token's two values (the operand vdpbf16ps pairs)
static const uint16_t two_rows_to_pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                               8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
// 32 dims of two tokens' values (a: t, b: t + 1) -> the pairs (v[t][j], v[t + 1][j]) of dims 0-15, of 16-31
static const uint16_t token_pairs_low[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                             8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t token_pairs_high[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

static void bf16_query(const float *q, int64_t head_dim, QueryRow *row) {
    for (int64_t d = 0; d < head_dim; d += 32)
        _mm512_storeu_si512(row->words + d / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + d + 16),
                                                                             _mm512_loadu_ps(q + d)));
}

static inline __m512bh broadcast_pair(const void *p) {
    int32_t word;
    memcpy(&word, p, 4);
    return (__m512bh)_mm512_set1_epi32(word);
}

static inline __attribute__((always_inline)) void block_scores16_bf16(float out[][MAX_BLOCK], const QueryRow *rows,
                                                                      const int count, const uint16_t *kt,
                                                                      int64_t head_dim, const char *next_k,
                                                                      const char *next_v) {
    const __m512i index = _mm512_loadu_si512(two_rows_to_pairs);
    __m512 even[8], odd[8];
    for (int r = 0; r < count; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < head_dim / 2; g += 2) {
        if (next_k != NULL) {  // a line of a later block's K and V per step (see block_scores16)
            _mm_prefetch(next_k + g * 64, PF_HINT);
            _mm_prefetch(next_k + g * 64 + 64, PF_HINT);
            _mm_prefetch(next_v + g * 64, PF_HINT);
            _mm_prefetch(next_v + g * 64 + 64, PF_HINT);
        }
        const __m512bh k0 = (__m512bh)_mm512_permutexvar_epi16(index, _mm512_loadu_si512(kt + g * 32));
        const __m512bh k1 = (__m512bh)_mm512_permutexvar_epi16(index, _mm512_loadu_si512(kt + g * 32 + 32));
        for (int r = 0; r < count; ++r) {
            even[r] = _mm512_dpbf16_ps(even[r], broadcast_pair(rows[r].words + g), k0);
            odd[r] = _mm512_dpbf16_ps(odd[r], broadcast_pair(rows[r].words + g + 1), k1);
        }
    }
    for (int r = 0; r < count; ++r) _mm512_storeu_ps(out[r], _mm512_add_ps(even[r], odd[r]));
}

// whether the block path takes this format's sum over V in bf16 dot products (every format but float32)
static inline int bf16_weights(const int kind) { return kind != KV_F32; }

// 32 consecutive stored values as bf16: as stored, or an 8-bit value exactly (before its scale, as load_kv)
static inline __attribute__((always_inline)) __m512i load_kv_bf16x32(const void *base, int64_t index,
                                                                     const int kind) {
    if (kind == KV_BF16) return _mm512_loadu_si512((const uint16_t *)base + index);
    return (__m512i)_mm512_cvtne2ps_pbh(load_kv(base, index + 16, kind), load_kv(base, index, kind));
}

// The values of tokens t and t + 1 (t even) at dims d .. d + 31 as the pairs vdpbf16ps takes: dims d .. d + 15
// in `lo`, the rest in `hi`; a lone last token (t + 1 == n) is paired with zeros, never with a slot past the keys
static inline __attribute__((always_inline)) void pair_tokens(const void *vb, int t, int n, int64_t d,
                                                              int64_t head_dim, const int kind, __m512i *lo,
                                                              __m512i *hi) {
    const __m512i v0 = load_kv_bf16x32(vb, t * head_dim + d, kind);
    const __m512i v1 = t + 1 < n ? load_kv_bf16x32(vb, (t + 1) * head_dim + d, kind) : _mm512_setzero_si512();
    *lo = _mm512_permutex2var_epi16(v0, _mm512_loadu_si512(token_pairs_low), v1);
    *hi = _mm512_permutex2var_epi16(v0, _mm512_loadu_si512(token_pairs_high), v1);
}

// a block's first n values paired once ([head_dim / 32][token pair][lo, hi]) for several runs of rows to read
static inline __attribute__((always_inline)) void pair_block(__m512i *pairs, const void *vb, int n, int64_t head_dim,
                                                             const int kind) {
    for (int64_t d = 0; d < head_dim; d += 32)
        for (int t = 0; t < n; t += 2) {
            __m512i *at = pairs + ((d / 32) * 8 + t / 2) * 2;
            pair_tokens(vb, t, n, d, head_dim, kind, at, at + 1);
        }
}

// acc[r] = acc[r] * corr[r] + sum_{t < n} p_r[t] v[t] as accumulate_rows, with each row's p as bf16 pairs (the
// first 8 words of s[r]) and the values paired here or read from `paired` (pair_block over at least n keys: a
// row's weight past its own keys is 0, so the slot a lone last key is paired with adds 0 either way)
static inline __attribute__((always_inline)) void accumulate_rows_bf16(float acc[][MAX_HEAD_DIM], const float *corr,
                                                                       float s[][MAX_BLOCK], const int rows, int n,
                                                                       const void *vb, int64_t head_dim,
                                                                       const int kind, const __m512i *paired) {
    for (int64_t d = 0; d < head_dim; d += 32) {
        __m512 a[8], b[8];
        for (int r = 0; r < rows; ++r) {
            a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d), _mm512_set1_ps(corr[r]));
            b[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d + 16), _mm512_set1_ps(corr[r]));
        }
        for (int t = 0; t < n; t += 2) {
            __m512i lo, hi;
            if (paired != NULL) {
                lo = paired[((d / 32) * 8 + t / 2) * 2];
                hi = paired[((d / 32) * 8 + t / 2) * 2 + 1];
            } else {
                pair_tokens(vb, t, n, d, head_dim, kind, &lo, &hi);
            }
            for (int r = 0; r < rows; ++r) {
                const __m512bh p = broadcast_pair((const uint32_t *)s[r] + t / 2);
                a[r] = _mm512_dpbf16_ps(a[r], p, (__m512bh)lo);
                b[r] = _mm512_dpbf16_ps(b[r], p, (__m512bh)hi);
            }
        }
        for (int r = 0; r < rows; ++r) {
            _mm512_storeu_ps(acc[r] + d, a[r]);
            _mm512_storeu_ps(acc[r] + d + 16, b[r]);
        }
    }
}
#endif

// the formats whose query rows the block path packs (pack_query) for its integer or bf16 dot products
static inline int packed_query(int64_t kind) {
#ifdef INT8_SCORES
    if (kind == KV_INT8) return 1;
#endif
#ifdef BF16_DOTS
    if (kind == KV_BF16) return 1;
#endif
    (void)kind;
    return 0;
}

static void pack_query(const float *q, int64_t head_dim, int64_t kind, QueryRow *row) {
#ifdef BF16_DOTS
    if (kind == KV_BF16) {
        bf16_query(q, head_dim, row);
        return;
    }
#endif
    (void)kind;
    quantize_query(q, head_dim, row);
}
#define PACKED_QUERIES 1

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
    const uint16_t *ks, const uint16_t *vs, const QueryRow *qr, int64_t head_dim, float scale, const int kind,
    const char *next_k, const char *next_v) {
    int64_t r = first_row;
#ifdef INT8_SCORES
    if (kind == KV_INT8) {
        block_scores16_int8(s + r, qr + r, (int)(n_rows - r), (const int8_t *)kt, ks, head_dim, next_k, next_v);
        r = n_rows;
    }
#endif
#ifdef BF16_DOTS
    if (kind == KV_BF16) {
        for (; r < n_rows; r += 8) {
            switch (n_rows - r < 8 ? n_rows - r : 8) {  // a constant count per call: its chains stay in registers
#define SCORES_BF16(COUNT)                                                                                        \
    case COUNT:                                                                                                   \
        block_scores16_bf16(s + r, qr + r, COUNT, (const uint16_t *)kt, head_dim, next_k, next_v);                \
        break;
                SCORES_BF16(8) SCORES_BF16(7) SCORES_BF16(6) SCORES_BF16(5) SCORES_BF16(4) SCORES_BF16(3)
                SCORES_BF16(2) SCORES_BF16(1)
#undef SCORES_BF16
            }
            next_k = next_v = NULL;  // fetched once
        }
    }
#endif
    (void)qr;
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
    const __m512 v_scales = kv_scaled(kind) ? kv_scale16(vs, kind) : _mm512_set1_ps(1.0f);
    for (int64_t i = first_row; i < n_rows; ++i) {
        const int64_t left = len[i] - block_start;
        const int n = left < 16 ? (int)left : 16;
        // keys before a sliding window's start weigh exp(-inf) = 0 (a row given this block sees at least one)
        const int before = lo == NULL || lo[i] <= block_start ? 0 : (int)(lo[i] - block_start);
        const __mmask16 mask = (__mmask16)((n == 16 ? 0xFFFFu : (1u << n) - 1) & ~((1u << before) - 1));
        const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(s[i]), _mm512_set1_ps(scale));
        // the running max holds unless a score passes it (the common case once the context is long: no
        // reduction, and exp(0) = 1 exactly); on the first block every score passes -inf, and exp(-inf) = 0
        float block_max = m[i];
        corr[i] = 1.0f;
        if (_mm512_mask_cmp_ps_mask(mask, sv, _mm512_set1_ps(m[i]), _CMP_GT_OQ)) {
            block_max = _mm512_mask_reduce_max_ps(mask, sv);
            corr[i] = expf(m[i] - block_max);
        }
        const __m512 p = _mm512_maskz_mov_ps(mask, exp512_ps(_mm512_sub_ps(sv, _mm512_set1_ps(block_max))));
        // the denominators in 16 lanes, summed once at the end: no horizontal add per block
        _mm512_storeu_ps(l[i], _mm512_fmadd_ps(_mm512_loadu_ps(l[i]), _mm512_set1_ps(corr[i]), p));
        m[i] = block_max;
        keys[i] = n;
        // masked: the bf16 sum over V pairs a lone last key with the slot after it, whose scale may be stale
        const __m512 weights = kv_scaled(kind) ? _mm512_maskz_mul_ps(mask, p, v_scales) : p;
#ifdef BF16_DOTS
        if (bf16_weights(kind)) {  // as the sum over V takes them: bf16 pairs
            _mm256_storeu_si256((__m256i *)s[i], (__m256i)_mm512_cvtneps_pbh(weights));
            continue;
        }
#endif
        _mm512_storeu_ps(s[i], weights);
    }
#ifdef BF16_DOTS
    if (bf16_weights(kind)) {
        // an 8-bit block under several runs of rows (prompt chunks): its values widened and paired once, not once a
        // run (a bf16 block's pairing is one instruction per vector: cheaper than a store and a load; measured)
        if (kind != KV_BF16 && n_rows - first_row > 8) {
            __m512i paired[MAX_HEAD_DIM / 32 * 16];
            pair_block(paired, vb, keys[n_rows - 1], head_dim, kind);
            FOR_RUNS_OF_8_ROWS(accumulate_rows_bf16, first_row, n_rows, vb, head_dim, kind, paired);
        } else {
            FOR_RUNS_OF_8_ROWS(accumulate_rows_bf16, first_row, n_rows, vb, head_dim, kind, NULL);
        }
        return;
    }
#endif
    FOR_RUNS_OF_8_ROWS(accumulate_rows, first_row, n_rows, vb, head_dim, kind);
}

// one specialization per format, so each inlines its own loads
#define ATTEND_BLOCK16(name, kind)                                                                              \
    static void name(float acc[][MAX_HEAD_DIM], float *m, float l[][16], float s[][MAX_BLOCK], const float *const *qs, \
                     const int64_t *len, const int64_t *lo, int64_t first_row, int64_t n_rows, int64_t block_start, \
                     const void *kt, const void *vb, const uint16_t *ks, const uint16_t *vs, const QueryRow *qr,   \
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
                              const uint16_t *, const uint16_t *, const QueryRow *, int64_t, float, const char *,
                              const char *);
static const AttendBlock16 attend_block16_of[] = {attend_block16_f32, attend_block16_bf16, attend_block16_int8,
                                                  attend_block16_e4m3, attend_block16_e5m2};
#else
int paged_attention_bf16_available(void) { return 0; }
#endif
#ifndef INT8_SCORES
int paged_attention_int8_scores(void) { return 0; }
#endif
