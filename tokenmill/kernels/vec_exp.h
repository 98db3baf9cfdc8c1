// e^x on 16 floats at once (AVX-512F), shared by the kernels that need many exponentials per step (softmax
// numerators, SiLU). glibc's scalar expf cannot be vectorized without -ffast-math, which the kernels avoid (it
// would let the compiler reorder sums per call site); this is the Cephes expf polynomial, < 2 ulp from expf,
// with the same operations in every lane, so results never depend on a value's position or batch.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp512_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    // x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two so n * ln2 is exact enough
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);  // p * 2^n
}
#endif
