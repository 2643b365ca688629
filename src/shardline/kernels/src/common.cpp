// The type table, half floats, the CPU's ISA, the kernel lookup and the activation quantizers.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "blocks.hpp"

namespace shardline {

namespace {

const TypeInfo kTypes[] = {
    {Q4_0, "Q4_0", 32, 18},   {Q4_1, "Q4_1", 32, 20},   {Q5_0, "Q5_0", 32, 22},
    {Q5_1, "Q5_1", 32, 24},   {Q8_0, "Q8_0", 32, 34},   {Q2_K, "Q2_K", 256, 84},
    {Q3_K, "Q3_K", 256, 110}, {Q4_K, "Q4_K", 256, 144}, {Q5_K, "Q5_K", 256, 176},
    {Q6_K, "Q6_K", 256, 210}, {MXFP4, "MXFP4", 32, 17},
};

Isa detect() {
    __builtin_cpu_init();
    Isa isa = Isa::Scalar;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        isa = Isa::Avx2;
    // The VNNI path is built with -mavxvnni: its VEX-encoded vpdpbusd runs only where the CPU has
    // AVX-VNNI (Alder Lake, Sapphire Rapids and on). An AVX512-VNNI-only CPU (Ice Lake, Zen 4)
    // would fault on it, so it takes the AVX2 kernels.
    if (isa == Isa::Avx2 && __builtin_cpu_supports("avxvnni")) isa = Isa::Avx512Vnni;
    const char* cap = std::getenv("SHARDLINE_KERNEL_ISA");
    if (cap != nullptr) {
        std::string c(cap);
        Isa want = c == "scalar" ? Isa::Scalar : c == "avx2" ? Isa::Avx2 : isa;
        if (static_cast<int>(want) < static_cast<int>(isa)) isa = want;
    }
    return isa;
}

}  // namespace

const TypeInfo* type_info(int type) {
    for (const TypeInfo& t : kTypes)
        if (t.type == type) return &t;
    return nullptr;
}

Isa best_isa() {
    static const Isa isa = detect();
    return isa;
}

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::Avx512Vnni: return "avx-vnni";
        case Isa::Avx2: return "avx2";
        default: return "scalar";
    }
}

const Kernels* scalar_kernels(int type) {
    const Kernels* k = legacy_scalar(type);
    return k != nullptr ? k : kquant_scalar(type);
}

const Kernels* avx2_kernels(int type) {
    const Kernels* k = legacy_avx2(type);
    return k != nullptr ? k : kquant_avx2(type);
}

const Kernels* vnni_kernels(int type) {
    const Kernels* k = legacy_vnni(type);
    return k != nullptr ? k : kquant_vnni(type);
}

const Kernels* kernels_for(int type, Isa isa) {
    if (type_info(type) == nullptr) return nullptr;
    if (isa == Isa::Avx512Vnni) {
        const Kernels* k = vnni_kernels(type);
        if (k != nullptr && k->tile != nullptr) return k;
        isa = Isa::Avx2;
    }
    if (isa == Isa::Avx2) {
        const Kernels* k = avx2_kernels(type);
        if (k != nullptr && k->tile != nullptr) return k;
    }
    return scalar_kernels(type);
}

float half_to_float(uint16_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            int e = -1;
            do { ++e; man <<= 1; } while ((man & 0x400) == 0);
            bits = sign | ((127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_half(float f) {  // round to nearest even; only finite values reach it here
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    int32_t exp = static_cast<int32_t>((x >> 23) & 0xFF) - 127 + 15;
    uint32_t man = x & 0x7FFFFF;
    if (exp >= 31) return static_cast<uint16_t>(sign | 0x7C00);
    if (exp <= 0) {
        if (exp < -10) return static_cast<uint16_t>(sign);
        man |= 0x800000;
        uint32_t shift = static_cast<uint32_t>(14 - exp);
        uint32_t half = man >> shift, rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) ++half;
        return static_cast<uint16_t>(sign | half);
    }
    uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (man >> 13);
    uint32_t rest = man & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;
    return static_cast<uint16_t>(half);
}

float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e) - 1) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

size_t activation_row_bytes(int type, int64_t cols) {
    const TypeInfo* t = type_info(type);
    if (t == nullptr) return 0;
    return t->block == 256 ? static_cast<size_t>(cols / 256) * sizeof(X256) : static_cast<size_t>(cols / 32) * sizeof(X32);
}

namespace {

// Round to nearest, ties to even, as the vector path's cvtps does.
inline int8_t rne(float v) { return static_cast<int8_t>(std::nearbyint(v)); }

void quantize_32(const float* x, int64_t cols, X32* out) {
    for (int64_t b = 0; b < cols / 32; ++b, x += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) {
            out[b].q[i] = rne(x[i] * id);
            sum += out[b].q[i];
        }
        out[b].d = d;
        out[b].sum = sum;
    }
}

void quantize_256(const float* x, int64_t cols, X256* out) {
    for (int64_t b = 0; b < cols / 256; ++b, x += 256) {
        float amax = 0.0f;
        for (int i = 0; i < 256; ++i) amax = std::fmax(amax, std::fabs(x[i]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 256; ++i) out[b].q[i] = rne(x[i] * id);
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int i = 0; i < 16; ++i) s += out[b].q[16 * g + i];
            out[b].bsums[g] = static_cast<int16_t>(s);
        }
        out[b].d = d;
    }
}

}  // namespace

void quantize_row_avx2(int type, const float* x, int64_t cols, uint8_t* out);  // quantize_avx2.cpp

void quantize_row(int type, const float* x, int64_t cols, uint8_t* out, Isa isa) {
    if (isa != Isa::Scalar) {
        quantize_row_avx2(type, x, cols, out);
        return;
    }
    if (type_info(type)->block == 256)
        quantize_256(x, cols, reinterpret_cast<X256*>(out));
    else
        quantize_32(x, cols, reinterpret_cast<X32*>(out));
}

}  // namespace shardline
