// The machine's int8 multiply-add peak for the instruction sequence the kernels use at this build's level:
// AVX512-VNNI `vpdpbusd` on zmm (64 multiply-adds), AVX-VNNI `vpdpbusd` on ymm (32), AVX2 `vpmaddubsw` on ymm
// (32 products summed in pairs: the multiplier's rate, an upper bound for kernels that still widen the pairs).
// Twelve independent accumulator chains per thread hide the latency, so the loop runs at the units'
// throughput; every thread of the OpenMP team runs it at once. Built by benchmarks/bench_gemm_peak.py with the
// kernels' own flags.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define CHAINS 12

// multiply-adds per iteration of one chain at this build's level (0: no integer SIMD path)
int64_t probe_macs_per_op(void) {
#if defined(__AVX512VNNI__)
    return 64;
#elif defined(__AVX2__)
    return 32;
#else
    return 0;
#endif
}

// runs `iterations` x CHAINS ops on every thread; returns a value that depends on all of them
int64_t probe_run(int64_t iterations) {
    int64_t total = 0;
#pragma omp parallel reduction(+ : total)
    {
#if defined(__AVX512VNNI__)
        __m512i acc[CHAINS];
        const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8((char)(omp_get_thread_num() + 1));  // no hoisting:
        // acc[c] is an operand of every vpdpbusd
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
        for (int64_t i = 0; i < iterations; i++)
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        for (int c = 0; c < CHAINS; c++) total += _mm512_reduce_add_epi32(acc[c]);
#elif defined(__AVX2__)
        // each chain its own weight vector from L1, as the kernels load theirs: nothing is common to hoist
        __m256i acc[CHAINS], w[CHAINS];
        const __m256i b = _mm256_set1_epi8((char)(omp_get_thread_num() + 1));
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_epi32(c), w[c] = _mm256_set1_epi8((char)(c + 1));
        __m256i x = b;
        for (int64_t i = 0; i < iterations; i++) {
            __asm__ volatile("" : "+x"(x) : : "memory");  // the weights are reloaded, x is opaque
            for (int c = 0; c < CHAINS; c++) {
#if defined(__AVXVNNI__)
                acc[c] = _mm256_dpbusd_avx_epi32(acc[c], _mm256_loadu_si256(w + c), x);
#else
                // the multiplier's own rate: vpmaddubsw alone (the kernels widen with a vpmaddwd per one or two)
                acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(_mm256_loadu_si256(w + c), x));
#endif
            }
        }
        int32_t lanes[8];
        for (int c = 0; c < CHAINS; c++) {
            _mm256_storeu_si256((__m256i *)lanes, acc[c]);
            for (int l = 0; l < 8; l++) total += lanes[l];
        }
#else
        (void)iterations;
#endif
    }
    return total;
}

int64_t probe_chains(void) { return CHAINS; }
