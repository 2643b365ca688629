// K-quant kernels, scalar: the reference. Every type is first unpacked into one plain form
//   w[i] = (d * scale[i / sub]) * (q[i] - offset) - dmin * min[i / sub]
// (Q2_K, Q4_K, Q5_K: offset 0 and a min; Q3_K: offset 4, Q6_K: offset 32, no min), and both
// the dequant (kernel_check's reference) and the tile read that form only, so the bit layouts
// live in one place per type: the unpack functions below, which follow GGML's block layouts as
// model/gguf_blocks.py reads them. The dequant rounds as gguf-py's dequantize does ((d*sc) in
// f32, then times the code); the tile is the integer arithmetic the SIMD kernels do, in loops.
#include <cstring>

#include "blocks.hpp"

namespace shardline {

namespace {

struct Unpacked {
    uint8_t q[256];    // codes, offset not yet subtracted
    int sub;           // values per scale: 16 or 32
    int offset;        // subtracted from every code (Q3_K 4, Q6_K 32, else 0)
    int scale[16];     // 256 / sub of them; signed for Q3_K and Q6_K
    int min[16];       // 0 for the types without a min
    float d, dmin;
};

float f16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
}

// 2-bit fields of 64 bytes: value h*128 + s*32 + l is bits 2s..2s+1 of qs[h*32 + l].
void crumbs(const uint8_t* qs, uint8_t* q) {
    for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
            for (int l = 0; l < 32; ++l) q[h * 128 + s * 32 + l] = (qs[h * 32 + l] >> (2 * s)) & 3;
}

// Q4_K/Q5_K's 12 bytes: scales and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; 4-7 take
// their low 4 bits from bytes 8-11 (scale: low nibble, min: high) and their top 2 bits from
// the top bits of bytes 0-3 (scale) and 4-7 (min).
void k_scales(const uint8_t* s, int* sc, int* mn) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

// 128 bytes of nibbles: value c*64 + n*32 + l is nibble n (low first) of qs[c*32 + l].
void nibbles(const uint8_t* qs, uint8_t* q) {
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            q[c * 64 + l] = qs[c * 32 + l] & 15;
            q[c * 64 + 32 + l] = qs[c * 32 + l] >> 4;
        }
}

void unpack_q2_k(const uint8_t* b, Unpacked& u) {  // scales[16] qs[64] d dmin
    u.sub = 16, u.offset = 0, u.d = f16_at(b + 80), u.dmin = f16_at(b + 82);
    for (int k = 0; k < 16; ++k) u.scale[k] = b[k] & 15, u.min[k] = b[k] >> 4;
    crumbs(b + 16, u.q);
}

void unpack_q3_k(const uint8_t* b, Unpacked& u) {  // hmask[32] qs[64] scales[12] d
    u.sub = 16, u.offset = 4, u.d = f16_at(b + 108), u.dmin = 0.0f;
    crumbs(b + 32, u.q);
    for (int j = 0; j < 8; ++j)  // value j*32 + l: bit j of hmask[l] is the code's bit 2
        for (int l = 0; l < 32; ++l) u.q[j * 32 + l] |= ((b[l] >> j) & 1) << 2;
    const uint8_t* s = b + 96;
    for (int k = 0; k < 16; ++k) {
        int low = k < 8 ? s[k] & 15 : s[k - 8] >> 4;
        int top = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        u.scale[k] = (low | (top << 4)) - 32;
        u.min[k] = 0;
    }
}

void unpack_q4_k(const uint8_t* b, Unpacked& u) {  // d dmin scales[12] qs[128]
    u.sub = 32, u.offset = 0, u.d = f16_at(b), u.dmin = f16_at(b + 2);
    k_scales(b + 4, u.scale, u.min);
    nibbles(b + 16, u.q);
}

void unpack_q5_k(const uint8_t* b, Unpacked& u) {  // d dmin scales[12] qh[32] qs[128]
    u.sub = 32, u.offset = 0, u.d = f16_at(b), u.dmin = f16_at(b + 2);
    k_scales(b + 4, u.scale, u.min);
    nibbles(b + 48, u.q);
    for (int j = 0; j < 8; ++j)  // value j*32 + l: bit j of qh[l] is the code's bit 4
        for (int l = 0; l < 32; ++l) u.q[j * 32 + l] |= ((b[16 + l] >> j) & 1) << 4;
}

void unpack_q6_k(const uint8_t* b, Unpacked& u) {  // ql[128] qh[64] scales[16] (int8) d
    u.sub = 16, u.offset = 32, u.d = f16_at(b + 208), u.dmin = 0.0f;
    for (int h = 0; h < 2; ++h)  // value h*128 + n*64 + l: nibble n of ql[h*64 + l]
        for (int n = 0; n < 2; ++n)
            for (int l = 0; l < 64; ++l) u.q[h * 128 + n * 64 + l] = (b[h * 64 + l] >> (4 * n)) & 15;
    uint8_t high[256];
    crumbs(b + 128, high);
    for (int i = 0; i < 256; ++i) u.q[i] |= high[i] << 4;
    for (int k = 0; k < 16; ++k) u.scale[k] = static_cast<int8_t>(b[192 + k]), u.min[k] = 0;
}

template <void (*Unpack)(const uint8_t*, Unpacked&), int Bytes>
void dequant(int64_t cols, const uint8_t* w, float* out) {
    Unpacked u;
    for (int64_t b = 0; b < cols / 256; ++b, w += Bytes, out += 256) {
        Unpack(w, u);
        for (int i = 0; i < 256; ++i) {
            int k = i / u.sub;
            out[i] = (u.d * static_cast<float>(u.scale[k])) * static_cast<float>(u.q[i] - u.offset) -
                     u.dmin * static_cast<float>(u.min[k]);
        }
    }
}

// Per block, in integers: sum_k scale_k * (sum_i q_i x_i - offset * bsum(k)) in d units, and
// sum_k min_k * bsum(k) in dmin units (bsum(k): the x codes' sum over sub-block k, from the
// 16-value bsums). Both fit int32 easily: |codes| < 64, |x| <= 127, |scales| <= 128.
template <void (*Unpack)(const uint8_t*, Unpacked&), int Bytes>
void tile(const Tile& t) {
    const int64_t nb = t.cols / 256;
    Unpacked u;
    for (int64_t i = 0; i < t.n; ++i)
        for (int64_t j = 0; j < t.m; ++j) {
            const uint8_t* w = t.w + i * t.w_stride;
            const X256* x = reinterpret_cast<const X256*>(t.x + j * t.x_stride);
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; ++b, w += Bytes) {
                Unpack(w, u);
                int32_t dot = 0, mins = 0;
                for (int k = 0; k < 256 / u.sub; ++k) {
                    int32_t s = 0, xs = 0;
                    for (int l = k * u.sub; l < (k + 1) * u.sub; ++l) s += u.q[l] * x[b].q[l];
                    for (int g = k * u.sub / 16; g < (k + 1) * u.sub / 16; ++g) xs += x[b].bsums[g];
                    dot += u.scale[k] * (s - u.offset * xs);
                    mins += u.min[k] * xs;
                }
                sum += x[b].d * (u.d * static_cast<float>(dot) - u.dmin * static_cast<float>(mins));
            }
            t.y[j * t.y_stride + i] = sum;
        }
}

#define SHARDLINE_KQ(unpack, bytes) Kernels{tile<unpack, bytes>, dequant<unpack, bytes>}
const Kernels kQ2K = SHARDLINE_KQ(unpack_q2_k, 84);
const Kernels kQ3K = SHARDLINE_KQ(unpack_q3_k, 110);
const Kernels kQ4K = SHARDLINE_KQ(unpack_q4_k, 144);
const Kernels kQ5K = SHARDLINE_KQ(unpack_q5_k, 176);
const Kernels kQ6K = SHARDLINE_KQ(unpack_q6_k, 210);
#undef SHARDLINE_KQ

}  // namespace

const Kernels* kquant_scalar(int type) {
    switch (type) {
        case Q2_K: return &kQ2K;
        case Q3_K: return &kQ3K;
        case Q4_K: return &kQ4K;
        case Q5_K: return &kQ5K;
        case Q6_K: return &kQ6K;
        default: return nullptr;
    }
}

}  // namespace shardline
