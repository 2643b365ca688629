// The 32-value GGUF types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4) with AVX-VNNI: legacy_avx2.cpp's
// kernels (legacy_simd.inc) with the u8 x s8 dot as one vpdpbusd instead of maddubs + madd.
// This is the only difference, so what kernel_check proves for AVX2 holds here on a CPU that
// can't run this file.
#include <immintrin.h>

#include <cstring>

#include "blocks.hpp"

namespace shardline {

namespace {

// 8 int32 sums of u8 x s8 products, lanes k of (u1 . s1) + (u2 . s2) over bytes 4k .. 4k + 3:
// two vpdpbusd, which do not saturate; within the bounds legacy_simd.inc keeps for the AVX2
// maddubs versions both give the exact sums, so they agree with legacy_avx2.cpp bit for bit.
inline __attribute__((always_inline)) __m256i dot_narrow(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
}
inline __attribute__((always_inline)) __m256i dot_wide(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
    return dot_narrow(u1, s1, u2, s2);
}

#include "legacy_simd.inc"

}  // namespace

// The dequant is the scalar one (it is not on a hot path: one row at a time for a gather).
const Kernels* legacy_vnni(int type) {
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
