/* The integer dot product the 4- and 8-bit kernels share (quant_ops.c, ggml_ops.c): AVX2 targets only. */
#pragma once
#ifdef __AVX2__
#include <immintrin.h>

/* 8 partial sums of u[i] * s[i] over 32 unsigned x signed bytes (no overflow for u < 128). */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* acc + dot_u8_i8(u, s), in one instruction with VNNI. */
static inline __m256i dot_acc_u8_i8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, dot_u8_i8(u, s));
#endif
}
#endif
