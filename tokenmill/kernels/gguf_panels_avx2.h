// The AVX2 panel kernel of gguf_panels.c (included there; it uses that file's definitions), for hosts without
// AVX-512 (AMD Zen 2/3, Intel client CPUs): the same panels, each 64-byte vector taken as two 256-bit halves
// (rows 0-7 and 8-15). With AVX-VNNI one `vpdpbusd` (VEX) sums 4 products as on AVX-512; without it, as
// llama.cpp's AVX2 kernels do, `vpmaddubsw` multiplies unsigned levels by signed activations into int16 pairs
// (the low and the high nibbles' pairs added in int16: levels < 64 and |x| <= 128 keep the sum under 2^15) and
// `vpmaddwd` by ones sums them into int32. Q8_0's levels (stored + 128) are taken back to signed bytes and
// multiplied by the sign trick (|w| times x with w's sign), its offset then being 0. The integer sums are exact
// and the float operations per output are those of gguf_panels_avx512.h, so both give the same bits.
#include <immintrin.h>

// tokens sharing each weight load: 4 unpack each weight vector half as often as 2 did (Q4_K prompt GEMMs +3-30%,
// Q5_0 +13-15%, docs/BENCHMARKS.md gemm-peak-avx2), though 16 ymm registers then spill the float accumulators
#define TILE_MAX 4
#define PREFETCH_AHEAD 2048

static inline __m256i broadcast4_256(const int8_t *p) { return _mm256_set1_epi32(word_at(p)); }

static inline __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 i8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

// bit `index` of each byte of a bit plane moved to bit `to` (4 or 5), the other bits cleared: 16-bit shifts
// by at most 5 bring no bit across a byte into either position
static inline __m256i plane_bits(__m256i plane, int index, int to) {
    const __m256i moved = index < to ? _mm256_slli_epi16(plane, to - index) : _mm256_srli_epi16(plane, index - to);
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)(1 << to)));
}

#if defined(__AVXVNNI__)
// acc += the sums of 4 products of a (unsigned) and b (signed), as vpdpbusd
static inline __m256i dot4(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
static inline __m256i dot4_pair(__m256i acc, __m256i a, __m256i b, __m256i c, __m256i d) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, a, b), c, d);
}
#define SIGNED_Q8 0  // vpdpbusd takes Q8_0's stored levels (+ 128) as they are
#else
static inline __m256i dot4(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
// acc += a.b + c.d, the two int16 pair sums added before widening (levels < 64: no saturation)
static inline __m256i dot4_pair(__m256i acc, __m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(a, b), _mm256_maddubs_epi16(c, d));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#define SIGNED_Q8 1
#endif

static inline __attribute__((always_inline)) void panel_tile(const int type, const int tile, const uint8_t *p,
                                                             int64_t k, const Token *x, float (*y)[PANEL]) {
    const int64_t groups = k / 32;
    // -c; Q8_0 through the sign trick multiplies the signed levels themselves
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? (SIGNED_Q8 ? 0 : 128) : 0;
    __m256 facc[TILE_MAX][2], oacc[TILE_MAX][2], dv[2], dminv[2];
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) dv[h] = dminv[h] = _mm256_setzero_ps();
    for (int u = 0; u < tile; u++)
        for (int h = 0; h < 2; h++) facc[u][h] = oacc[u][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (k_quant(type) && g % 8 == 0) {
            for (int h = 0; h < 2; h++) {
                dv[h] = half8(p + 16 * h);
                if (type != T_Q6_K) dminv[h] = half8(p + 32 + 16 * h);
            }
            p += header_bytes(type);
        }
        for (int64_t line = 0; line < group_bytes(type); line += 64)
            _mm_prefetch((const char *)(p + PREFETCH_AHEAD + line), _MM_HINT_T0);
        __m256i acc[TILE_MAX][2], acc_b[TILE_MAX][2];  // acc_b: Q6_K's second 16 k (a scale of their own)
        for (int u = 0; u < tile; u++)
            for (int h = 0; h < 2; h++) {
                if (type == T_Q6_K) {
                    acc[u][h] = _mm256_set1_epi32(-32 * x[u].sum16[2 * g]);
                    acc_b[u][h] = _mm256_set1_epi32(-32 * x[u].sum16[2 * g + 1]);
                } else {
                    acc[u][h] = _mm256_set1_epi32(-offset * x[u].sum[g]);
                }
            }
        if (type == T_Q8_0) {
            for (int v = 0; v < 8; v++)
                for (int h = 0; h < 2; h++) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(p + 64 * v + 32 * h));
                    if (SIGNED_Q8) w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
                    for (int u = 0; u < tile; u++) {
                        const __m256i xv = broadcast4_256(x[u].q + 32 * g + 4 * v);
                        acc[u][h] = SIGNED_Q8 ? dot4(acc[u][h], _mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                                              : dot4(acc[u][h], w, xv);
                    }
                }
            p += 512;
        } else {
            for (int v = 0; v < 4; v++)
                for (int h = 0; h < 2; h++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(p + 64 * v + 32 * h));
                    __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
                    if (plane_bytes(type)) {  // the level's 5th bit (and Q6_K's 6th) from the planes' bytes
                        const __m256i plane4 = _mm256_loadu_si256((const __m256i *)(p + 256 + 32 * h));
                        lo = _mm256_or_si256(lo, plane_bits(plane4, 2 * v, 4));
                        hi = _mm256_or_si256(hi, plane_bits(plane4, 2 * v + 1, 4));
                    }
                    if (type == T_Q6_K) {
                        const __m256i plane5 = _mm256_loadu_si256((const __m256i *)(p + 320 + 32 * h));
                        lo = _mm256_or_si256(lo, plane_bits(plane5, 2 * v, 5));
                        hi = _mm256_or_si256(hi, plane_bits(plane5, 2 * v + 1, 5));
                    }
                    for (int u = 0; u < tile; u++) {
                        const int8_t *xq = x[u].q + 32 * g + 8 * v;
                        __m256i *chain = type == T_Q6_K && v >= 2 ? &acc_b[u][h] : &acc[u][h];
                        *chain = dot4_pair(*chain, lo, broadcast4_256(xq), hi, broadcast4_256(xq + 4));
                    }
                }
            p += 256 + plane_bytes(type);
        }
        // the group's float part, as gguf_panels_avx512.h's per lane
        for (int h = 0; h < 2; h++) {
            if (type == T_Q6_K) {
                const __m256 sa = _mm256_mul_ps(dv[h], i8x8(p + 8 * h)), sb = _mm256_mul_ps(dv[h], i8x8(p + 16 + 8 * h));
                for (int u = 0; u < tile; u++) {
                    const __m256 xd = _mm256_set1_ps(x[u].d[g]);
                    facc[u][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[u][h]), _mm256_mul_ps(sa, xd), facc[u][h]);
                    facc[u][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_b[u][h]), _mm256_mul_ps(sb, xd), facc[u][h]);
                }
            } else {
                const int kq = type == T_Q4_K || type == T_Q5_K, with_min = type == T_Q4_1 || type == T_Q5_1;
                const __m256 scale = kq ? _mm256_mul_ps(dv[h], u8x8(p + 8 * h)) : half8(p + 16 * h);
                const __m256 min = kq ? _mm256_mul_ps(dminv[h], u8x8(p + 16 + 8 * h))
                                      : with_min ? half8(p + 32 + 16 * h) : _mm256_setzero_ps();
                for (int u = 0; u < tile; u++) {
                    facc[u][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[u][h]),
                                                 _mm256_mul_ps(scale, _mm256_set1_ps(x[u].d[g])), facc[u][h]);
                    if (kq) oacc[u][h] = _mm256_fnmadd_ps(min, _mm256_set1_ps(x[u].sum_f[g]), oacc[u][h]);
                    if (with_min) oacc[u][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(x[u].sum_f[g]), oacc[u][h]);
                }
            }
        }
        p += param_bytes(type);
    }
    for (int u = 0; u < tile; u++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y[u] + 8 * h, _mm256_add_ps(facc[u][h], oacc[u][h]));
}

// the tile sizes gguf_panels.c compiles a function for (F: its macro for one function or one table entry)
#define PANEL_TILES(F, NAME, TYPE) F(NAME, TYPE, 1) F(NAME, TYPE, 2) F(NAME, TYPE, 3) F(NAME, TYPE, 4)
