// The AVX2 block path of paged_attention.c for 8-bit caches (included there; it uses that file's definitions):
// CPUs with AVX2, FMA and F16C but not AVX-512 (AMD Zen 2/3, Intel client cores). Blocks of 16 tokens and
// head_dim a multiple of 64, as two 8-lane halves: stored bytes widened and scaled in registers, float32
// arithmetic. Per row and block the same operations whatever its batch: scores as sequential sums over head_dim
// times the keys' scales, the block max and the denominator's 16 partial sums in fixed order, e^x by exp256_ps,
// then acc = acc * correction + sum_t (p[t] * v_scale[t]) v[t].
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_BLOCKS 1

// 8 consecutive stored bytes as float32, before their scale (e4m3 as its float16 pattern: the value / 256)
static inline __attribute__((always_inline)) __m256 load8_kv(const void *base, int64_t index, const int kind) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + index));
    if (kind == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    const __m128i wide = _mm_cvtepu8_epi16(raw);
    if (kind == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(wide, 8));  // e5m2 is float16's high byte
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7f)), 7);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(_mm_or_si128(magnitude, sign));
}

// 8 tokens' bf16 scales widened, times 256 for e4m3 (see load8_kv)
static inline __attribute__((always_inline)) __m256 kv_scale8(const uint16_t *scales, const int kind) {
    const __m256 s = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)scales)), 16));
    return kind == KV_E4M3 ? _mm256_mul_ps(s, _mm256_set1_ps(256.0f)) : s;
}

// scores of up to 4 rows over one block: each a sequential sum over head_dim per token, times the key's scale
static inline __attribute__((always_inline)) void block_scores8x2(float out[][MAX_BLOCK], const float *const *q,
                                                                  const void *kt, const uint16_t *ks,
                                                                  int64_t head_dim, const int rows, const int kind) {
    __m256 a[4][2];
    for (int r = 0; r < rows; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; ++d) {
        const __m256 k0 = load8_kv(kt, d * 16, kind), k1 = load8_kv(kt, d * 16 + 8, kind);
        for (int r = 0; r < rows; ++r) {
            const __m256 qd = _mm256_broadcast_ss(q[r] + d);
            a[r][0] = _mm256_fmadd_ps(qd, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(qd, k1, a[r][1]);
        }
    }
    const __m256 s0 = kv_scale8(ks, kind), s1 = kv_scale8(ks + 8, kind);
    for (int r = 0; r < rows; ++r) {
        _mm256_storeu_ps(out[r], _mm256_mul_ps(a[r][0], s0));
        _mm256_storeu_ps(out[r] + 8, _mm256_mul_ps(a[r][1], s1));
    }
}

// acc[r] = acc[r] * corr[r] + sum_{t < n} w_r[t] v[t] for up to 8 rows, 8 dims at a time (each V vector loaded
// once for all rows; weights past a row's keys are 0)
static inline __attribute__((always_inline)) void accumulate_rows8(float acc[][MAX_HEAD_DIM], const float *corr,
                                                                   float w[][MAX_BLOCK], const int rows, int n,
                                                                   const void *vb, int64_t head_dim, const int kind) {
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 a[8];
        for (int r = 0; r < rows; ++r) a[r] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + d), _mm256_set1_ps(corr[r]));
        for (int t = 0; t < n; ++t) {
            const __m256 v = load8_kv(vb, t * head_dim + d, kind);
            for (int r = 0; r < rows; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w[r] + t), v, a[r]);
        }
        for (int r = 0; r < rows; ++r) _mm256_storeu_ps(acc[r] + d, a[r]);
    }
}

static inline __attribute__((always_inline)) void attend_block16_avx2(
    float acc[][MAX_HEAD_DIM], float *m, float l[][16], float s[][MAX_BLOCK], const float *const *qs,
    const int64_t *len, const int64_t *lo, int64_t first_row, int64_t n_rows, int64_t block_start, const void *kt,
    const void *vb, const uint16_t *ks, const uint16_t *vs, int64_t head_dim, float scale, const int kind) {
    int64_t r = first_row;
    for (; r + 4 <= n_rows; r += 4) block_scores8x2(s + r, qs + r, kt, ks, head_dim, 4, kind);
    switch (n_rows - r) {
        case 3: block_scores8x2(s + r, qs + r, kt, ks, head_dim, 3, kind); break;
        case 2: block_scores8x2(s + r, qs + r, kt, ks, head_dim, 2, kind); break;
        case 1: block_scores8x2(s + r, qs + r, kt, ks, head_dim, 1, kind); break;
        default: break;
    }
    const __m256 lanes0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lanes1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256 vs0 = kv_scale8(vs, kind), vs1 = kv_scale8(vs + 8, kind);
    float corr[MAX_TILE];
    int keys[MAX_TILE];
    for (int64_t i = first_row; i < n_rows; ++i) {
        const int64_t left = len[i] - block_start;
        const int n = left < 16 ? (int)left : 16;
        const int before = lo == NULL || lo[i] <= block_start ? 0 : (int)(lo[i] - block_start);
        // the keys this row sees: lanes before .. n - 1 (the rest weigh exp(-inf) = 0)
        const __m256 first = _mm256_set1_ps((float)before), end = _mm256_set1_ps((float)n);
        const __m256 seen0 = _mm256_and_ps(_mm256_cmp_ps(lanes0, first, _CMP_GE_OQ), _mm256_cmp_ps(lanes0, end, _CMP_LT_OQ));
        const __m256 seen1 = _mm256_and_ps(_mm256_cmp_ps(lanes1, first, _CMP_GE_OQ), _mm256_cmp_ps(lanes1, end, _CMP_LT_OQ));
        const __m256 minus_inf = _mm256_set1_ps(-INFINITY), scale_v = _mm256_set1_ps(scale);
        const __m256 sv0 = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(_mm256_loadu_ps(s[i]), scale_v), seen0);
        const __m256 sv1 = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(_mm256_loadu_ps(s[i] + 8), scale_v), seen1);
        float block_max = hmax8(_mm256_max_ps(sv0, sv1));
        block_max = m[i] > block_max ? m[i] : block_max;
        corr[i] = block_max == m[i] ? 1.0f : expf(m[i] - block_max);
        const __m256 top = _mm256_set1_ps(block_max);
        const __m256 p0 = _mm256_and_ps(exp256_ps(_mm256_sub_ps(sv0, top)), seen0);
        const __m256 p1 = _mm256_and_ps(exp256_ps(_mm256_sub_ps(sv1, top)), seen1);
        const __m256 c = _mm256_set1_ps(corr[i]);
        _mm256_storeu_ps(l[i], _mm256_fmadd_ps(_mm256_loadu_ps(l[i]), c, p0));
        _mm256_storeu_ps(l[i] + 8, _mm256_fmadd_ps(_mm256_loadu_ps(l[i] + 8), c, p1));
        _mm256_storeu_ps(s[i], _mm256_mul_ps(p0, vs0));
        _mm256_storeu_ps(s[i] + 8, _mm256_mul_ps(p1, vs1));
        m[i] = block_max;
        keys[i] = n;
    }
    FOR_RUNS_OF_8_ROWS(accumulate_rows8, first_row, n_rows, vb, head_dim, kind);
}

// one specialization per 8-bit format (indexed by kind - KV_INT8), so each inlines its own loads
#define ATTEND_BLOCK16_AVX2(name, kind)                                                                          \
    static void name(float acc[][MAX_HEAD_DIM], float *m, float l[][16], float s[][MAX_BLOCK],                   \
                     const float *const *qs, const int64_t *len, const int64_t *lo, int64_t first_row,            \
                     int64_t n_rows, int64_t block_start, const void *kt, const void *vb, const uint16_t *ks,     \
                     const uint16_t *vs, int64_t head_dim, float scale) {                                         \
        attend_block16_avx2(acc, m, l, s, qs, len, lo, first_row, n_rows, block_start, kt, vb, ks, vs, head_dim,  \
                            scale, kind);                                                                         \
    }
ATTEND_BLOCK16_AVX2(attend_block16_avx2_int8, KV_INT8)
ATTEND_BLOCK16_AVX2(attend_block16_avx2_e4m3, KV_E4M3)
ATTEND_BLOCK16_AVX2(attend_block16_avx2_e5m2, KV_E5M2)
#undef ATTEND_BLOCK16_AVX2
typedef void (*AttendBlock16Avx2)(float[][MAX_HEAD_DIM], float *, float[][16], float[][MAX_BLOCK],
                                  const float *const *, const int64_t *, const int64_t *, int64_t, int64_t, int64_t,
                                  const void *, const void *, const uint16_t *, const uint16_t *, int64_t, float);
static const AttendBlock16Avx2 attend_block16_avx2_of[] = {attend_block16_avx2_int8, attend_block16_avx2_e4m3,
                                                           attend_block16_avx2_e5m2};
#endif
