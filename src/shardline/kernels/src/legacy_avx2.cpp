// The 32-value GGUF types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4) with AVX2: the kernels are
// legacy_simd.inc; this file gives them the u8 x s8 dot as maddubs + madd. legacy_vnni.cpp is
// the same code with vpdpbusd, so whatever kernel_check proves here holds there.
#include <immintrin.h>

#include <cstring>

#include "blocks.hpp"

namespace shardline {

namespace {

// 8 int32 sums of u8 x s8 products, lanes k of (u1 . s1) + (u2 . s2) over bytes 4k .. 4k + 3.
// maddubs saturates its int16 pair sums: dot_narrow adds two of them in int16 too, so it needs
// 4 * u * |s| <= 32767 (codes <= 31); dot_wide widens each first (2 * u * |s| <= 32767).
inline __attribute__((always_inline)) __m256i dot_narrow(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
inline __attribute__((always_inline)) __m256i dot_wide(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
    const __m256i one = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u1, s1), one),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u2, s2), one));
}

#include "legacy_simd.inc"

}  // namespace

// The dequant is the scalar one (it is not on a hot path: one row at a time for a gather).
const Kernels* legacy_avx2(int type) {
    static const Kernels q4_0{tile<TQ4_0>, legacy_scalar(Q4_0)->dequant};
    static const Kernels q4_1{tile<TQ4_1>, legacy_scalar(Q4_1)->dequant};
    static const Kernels q5_0{tile<TQ5_0>, legacy_scalar(Q5_0)->dequant};
    static const Kernels q5_1{tile<TQ5_1>, legacy_scalar(Q5_1)->dequant};
    static const Kernels q8_0{tile<TQ8_0>, legacy_scalar(Q8_0)->dequant};
    static const Kernels mxfp4{tile<TMXFP4>, legacy_scalar(MXFP4)->dequant};
    switch (type) {
        case Q4_0: return &q4_0;
        case Q4_1: return &q4_1;
        case Q5_0: return &q5_0;
        case Q5_1: return &q5_1;
        case Q8_0: return &q8_0;
        case MXFP4: return &mxfp4;
        default: return nullptr;
    }
}

}  // namespace shardline
