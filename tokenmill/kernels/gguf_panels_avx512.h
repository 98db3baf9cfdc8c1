// The AVX512-VNNI panel kernel of gguf_panels.c (included there; it uses that file's definitions): one 512-bit
// vector of int32 or float lanes per panel of 16 rows, `vpdpbusd` on the file's levels.
#include <immintrin.h>

#define TILE_MAX 8  // tokens sharing each weight load
#define PREFETCH_AHEAD 2048  // bytes: the weights a few groups on, in flight while this group computes


static inline __m512i broadcast4(const int8_t *p) { return _mm512_set1_epi32(word_at(p)); }

static inline __m512 half16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

static inline __m512 u8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __m512 i8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

// the bytes of a bit plane whose bit `index` is set, as a byte mask
static inline __mmask64 plane_mask(__m512i plane, int index) {
    return _mm512_test_epi8_mask(plane, _mm512_set1_epi8((char)(1 << index)));
}

/* One panel against `tile` tokens: y[u] = the 16 rows' outputs for token u. type and tile are constants in each
 * caller below, so every format's loop is compiled on its own. */
static inline __attribute__((always_inline)) void panel_tile(const int type, const int tile, const uint8_t *p,
                                                             int64_t k, const Token *x, float (*y)[PANEL]) {
    const int64_t groups = k / 32;
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? 128 : 0;  // -c
    __m512 facc[TILE_MAX], oacc[TILE_MAX], dv = _mm512_setzero_ps(), dminv = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(16), bit5 = _mm512_set1_epi8(32);
    for (int u = 0; u < tile; u++) facc[u] = oacc[u] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (k_quant(type) && g % 8 == 0) {
            dv = half16(p);
            if (type != T_Q6_K) dminv = half16(p + 32);
            p += header_bytes(type);
        }
        // two int32 chains per token (acc_b: the high nibbles, Q8_0's odd vectors, Q6_K's second 16 k), so the
        // dependent vpdpbusd chain of a group is 4 long, not 8
        __m512i acc[TILE_MAX], acc_b[TILE_MAX];
        for (int u = 0; u < tile; u++) {
            if (type == T_Q6_K) {
                acc[u] = _mm512_set1_epi32(-32 * x[u].sum16[2 * g]);
                acc_b[u] = _mm512_set1_epi32(-32 * x[u].sum16[2 * g + 1]);
            } else {
                acc[u] = _mm512_set1_epi32(-offset * x[u].sum[g]);
                acc_b[u] = _mm512_setzero_si512();
            }
        }
        for (int64_t line = 0; line < group_bytes(type); line += 64)
            _mm_prefetch((const char *)(p + PREFETCH_AHEAD + line), _MM_HINT_T0);
        if (type == T_Q8_0) {
            for (int v = 0; v < 8; v++) {
                const __m512i w = _mm512_loadu_si512(p + 64 * v);
                for (int u = 0; u < tile; u++) {
                    __m512i *chain = v % 2 ? acc_b + u : acc + u;
                    *chain = _mm512_dpbusd_epi32(*chain, w, broadcast4(x[u].q + 32 * g + 4 * v));
                }
            }
            p += 512;
        } else {
            const __m512i plane4 = plane_bytes(type) ? _mm512_loadu_si512(p + 256) : _mm512_setzero_si512();
            const __m512i plane5 = type == T_Q6_K ? _mm512_loadu_si512(p + 320) : _mm512_setzero_si512();
            for (int v = 0; v < 4; v++) {
                const __m512i w = _mm512_loadu_si512(p + 64 * v);
                __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
                if (plane_bytes(type)) {
                    lo = _mm512_mask_add_epi8(lo, plane_mask(plane4, 2 * v), lo, bit4);
                    hi = _mm512_mask_add_epi8(hi, plane_mask(plane4, 2 * v + 1), hi, bit4);
                }
                if (type == T_Q6_K) {
                    lo = _mm512_mask_add_epi8(lo, plane_mask(plane5, 2 * v), lo, bit5);
                    hi = _mm512_mask_add_epi8(hi, plane_mask(plane5, 2 * v + 1), hi, bit5);
                }
                for (int u = 0; u < tile; u++) {
                    const int8_t *xq = x[u].q + 32 * g + 8 * v;
                    if (type == T_Q6_K && v >= 2) {
                        acc_b[u] = _mm512_dpbusd_epi32(acc_b[u], lo, broadcast4(xq));
                        acc_b[u] = _mm512_dpbusd_epi32(acc_b[u], hi, broadcast4(xq + 4));
                    } else if (type == T_Q6_K) {
                        acc[u] = _mm512_dpbusd_epi32(acc[u], lo, broadcast4(xq));
                        acc[u] = _mm512_dpbusd_epi32(acc[u], hi, broadcast4(xq + 4));
                    } else {
                        acc[u] = _mm512_dpbusd_epi32(acc[u], lo, broadcast4(xq));
                        acc_b[u] = _mm512_dpbusd_epi32(acc_b[u], hi, broadcast4(xq + 4));
                    }
                }
            }
            p += 256 + plane_bytes(type);
        }
        // the group's float part: one multiply-add per token (two for Q6_K's halves), then the offsets
        if (type != T_Q6_K)
            for (int u = 0; u < tile; u++) acc[u] = _mm512_add_epi32(acc[u], acc_b[u]);
        if (type == T_Q6_K) {
            const __m512 sa = _mm512_mul_ps(dv, i8x16(p)), sb = _mm512_mul_ps(dv, i8x16(p + 16));
            for (int u = 0; u < tile; u++) {
                const __m512 xd = _mm512_set1_ps(x[u].d[g]);
                facc[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[u]), _mm512_mul_ps(sa, xd), facc[u]);
                facc[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc_b[u]), _mm512_mul_ps(sb, xd), facc[u]);
            }
        } else {
            const int kq = type == T_Q4_K || type == T_Q5_K, with_min = type == T_Q4_1 || type == T_Q5_1;
            const __m512 scale = kq ? _mm512_mul_ps(dv, u8x16(p)) : half16(p);
            const __m512 min = kq ? _mm512_mul_ps(dminv, u8x16(p + 16)) : with_min ? half16(p + 32)
                                                                                     : _mm512_setzero_ps();
            for (int u = 0; u < tile; u++) {
                facc[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[u]), _mm512_mul_ps(scale, _mm512_set1_ps(x[u].d[g])),
                                          facc[u]);
                if (kq) oacc[u] = _mm512_fnmadd_ps(min, _mm512_set1_ps(x[u].sum_f[g]), oacc[u]);
                if (with_min) oacc[u] = _mm512_fmadd_ps(min, _mm512_set1_ps(x[u].sum_f[g]), oacc[u]);
            }
        }
        p += param_bytes(type);
    }
    for (int u = 0; u < tile; u++) _mm512_storeu_ps(y[u], _mm512_add_ps(facc[u], oacc[u]));
}

// the tile sizes gguf_panels.c compiles a function for (F: its macro for one function or one table entry)
#define PANEL_TILES(F, NAME, TYPE)                                                                                 \
    F(NAME, TYPE, 1) F(NAME, TYPE, 2) F(NAME, TYPE, 3) F(NAME, TYPE, 4) F(NAME, TYPE, 5) F(NAME, TYPE, 6)          \
    F(NAME, TYPE, 7) F(NAME, TYPE, 8)
