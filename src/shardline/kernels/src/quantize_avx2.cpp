// x into int8 activation blocks with AVX2: bit for bit the scalar quantizer's result (the same
// max, the same f32 divide and multiply, cvtps rounding to nearest even as nearbyint does).
#include <immintrin.h>

#include "blocks.hpp"

namespace shardline {

namespace {

// (No vector constants at namespace scope: their static initializers would run AVX code at load
// on a CPU that has none.)
inline float block_amax(const float* x, int n) {
    const __m256 kAbs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), kAbs));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

// 32 values times id, rounded, packed to int8 in order.
inline __m256i round_32(const float* x, __m256 id) {
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
    __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
    __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    __m256i q = _mm256_packs_epi16(ab, cd);
    // packs interleave 128-bit lanes: put the 4-byte groups back in order.
    return _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline int32_t sum_i8(__m256i q) {
    __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
    __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    h = _mm_hadd_epi32(h, h);
    h = _mm_hadd_epi32(h, h);
    return _mm_cvtsi128_si32(h);
}

}  // namespace

void quantize_row_avx2(int type, const float* x, int64_t cols, uint8_t* out) {
    if (type_info(type)->block == 256) {
        X256* y = reinterpret_cast<X256*>(out);
        for (int64_t b = 0; b < cols / 256; ++b, x += 256) {
            float amax = block_amax(x, 256);
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            __m256 vid = _mm256_set1_ps(id);
            for (int i = 0; i < 8; ++i) {
                __m256i q = round_32(x + 32 * i, vid);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].q + 32 * i), q);
                __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);  // pairs
                __m128i lo = _mm256_castsi256_si128(s16), hi = _mm256_extracti128_si256(s16, 1);
                // 8 pair sums per half -> 2 sums of 16 values
                lo = _mm_hadd_epi16(lo, hi);  // 8 sums of 4
                lo = _mm_hadd_epi16(lo, lo);  // 4 sums of 8 (x2)
                lo = _mm_hadd_epi16(lo, lo);  // 2 sums of 16 (x4)
                y[b].bsums[2 * i] = static_cast<int16_t>(_mm_extract_epi16(lo, 0));
                y[b].bsums[2 * i + 1] = static_cast<int16_t>(_mm_extract_epi16(lo, 1));
            }
            y[b].d = d;
        }
        return;
    }
    X32* y = reinterpret_cast<X32*>(out);
    for (int64_t b = 0; b < cols / 32; ++b, x += 32) {
        float amax = block_amax(x, 32);
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q = round_32(x, _mm256_set1_ps(id));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].q), q);
        y[b].sum = sum_i8(q);
        y[b].d = d;
    }
}

}  // namespace shardline
