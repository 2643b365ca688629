// The 32-value GGUF types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4), plain C++: the reference every other
// kernel is checked against (kernel_check compares with this file's dequant), and the fallback
// on a CPU without AVX2. Written to be obviously ggml's layouts, not to be fast.
//
// Every block decodes to 32 signed integer codes c, a scale d and a min m, with the value
// w = d * c + m. The tile then needs only integers inside a block:
//   dot(block, x block) = d * dx * sum(c * qx) + m * dx * sum(qx)
// (x ~ dx * qx; X32 carries sum(qx)), which is what the SIMD kernels compute too.
#include <cstring>

#include "blocks.hpp"

namespace shardline {

namespace {

struct Decoded {
    int c[32];
    float d;
    float m;
};

inline float f16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
}

// Value i < 16 is the low nibble of qs[i], value 16 + i its high nibble (ggml's order).
inline int nibble(const uint8_t* qs, int i) { return i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4; }

// Q5's fifth bits: a little-endian u32, bit i is value i's.
inline int fifth_bit(const uint8_t* qh, int i) {
    uint32_t h = static_cast<uint32_t>(qh[0]) | static_cast<uint32_t>(qh[1]) << 8 |
                 static_cast<uint32_t>(qh[2]) << 16 | static_cast<uint32_t>(qh[3]) << 24;
    return static_cast<int>((h >> i) & 1);
}

// MXFP4's e2m1 values, doubled so they are integers; e8m0_half undoes the doubling.
const int kMxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

Decoded decode(int type, const uint8_t* b) {
    Decoded r{};
    switch (type) {
        case Q4_0:  // f16 d, qs[16]: w = d * (q - 8)
            r.d = f16_at(b);
            for (int i = 0; i < 32; ++i) r.c[i] = nibble(b + 2, i) - 8;
            break;
        case Q4_1:  // f16 d, f16 m, qs[16]: w = d * q + m
            r.d = f16_at(b);
            r.m = f16_at(b + 2);
            for (int i = 0; i < 32; ++i) r.c[i] = nibble(b + 4, i);
            break;
        case Q5_0:  // f16 d, qh[4], qs[16]: w = d * ((q | h << 4) - 16)
            r.d = f16_at(b);
            for (int i = 0; i < 32; ++i) r.c[i] = (nibble(b + 6, i) | fifth_bit(b + 2, i) << 4) - 16;
            break;
        case Q5_1:  // f16 d, f16 m, qh[4], qs[16]: w = d * (q | h << 4) + m
            r.d = f16_at(b);
            r.m = f16_at(b + 2);
            for (int i = 0; i < 32; ++i) r.c[i] = nibble(b + 8, i) | fifth_bit(b + 4, i) << 4;
            break;
        case Q8_0:  // f16 d, int8 qs[32]: w = d * q
            r.d = f16_at(b);
            for (int i = 0; i < 32; ++i) r.c[i] = static_cast<int8_t>(b[2 + i]);
            break;
        case MXFP4:  // u8 e, qs[16]: w = kvalues[q] * 2^(e - 127) / 2
            r.d = e8m0_half(b[0]);
            for (int i = 0; i < 32; ++i) r.c[i] = kMxfp4[nibble(b + 1, i)];
            break;
    }
    return r;
}

int block_bytes(int type) { return type_info(type)->bytes; }

template <int Type>
void dequant(int64_t cols, const uint8_t* w, float* out) {
    const int bytes = block_bytes(Type);
    for (int64_t b = 0; b < cols / 32; ++b, w += bytes, out += 32) {
        Decoded k = decode(Type, w);
        for (int i = 0; i < 32; ++i) out[i] = k.d * static_cast<float>(k.c[i]) + k.m;
    }
}

template <int Type>
void tile(const Tile& t) {
    const int bytes = block_bytes(Type);
    const int64_t nb = t.cols / 32;
    for (int64_t i = 0; i < t.n; ++i) {
        const uint8_t* row = t.w + static_cast<size_t>(i) * t.w_stride;
        for (int64_t j = 0; j < t.m; ++j) {
            const X32* x = reinterpret_cast<const X32*>(t.x + static_cast<size_t>(j) * t.x_stride);
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                Decoded k = decode(Type, row + b * bytes);
                int32_t isum = 0;
                for (int v = 0; v < 32; ++v) isum += k.c[v] * x[b].q[v];
                acc += k.d * x[b].d * static_cast<float>(isum) + k.m * x[b].d * static_cast<float>(x[b].sum);
            }
            t.y[j * t.y_stride + i] = acc;
        }
    }
}

template <int Type>
const Kernels kTable{tile<Type>, dequant<Type>};

}  // namespace

const Kernels* legacy_scalar(int type) {
    switch (type) {
        case Q4_0: return &kTable<Q4_0>;
        case Q4_1: return &kTable<Q4_1>;
        case Q5_0: return &kTable<Q5_0>;
        case Q5_1: return &kTable<Q5_1>;
        case Q8_0: return &kTable<Q8_0>;
        case MXFP4: return &kTable<MXFP4>;
        default: return nullptr;
    }
}

}  // namespace shardline
