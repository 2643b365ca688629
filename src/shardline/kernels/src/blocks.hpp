// The GGUF block types the op reads as the file stores them, the int8 activation blocks it
// quantizes x into (once per call), and the kernel table: one entry per (type, ISA).
//
// Invariants every kernel keeps:
//  - a weight row is exactly cols / values_per_block blocks of the type's bytes, read in place
//    (no widening, no copy); nothing past a row's last byte is read;
//  - an activation row is cols / values_per_block activation blocks (X32 for the 32-value
//    types, X256 for the K-quants), nothing past its last byte is read;
//  - products are integer within a block (int8 x small codes); scales are applied in f32.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardline {

// GGML's type ids (ggml.h's enum ggml_type): the op's `type` attribute.
enum GgmlType : int {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39,
};

struct TypeInfo {
    int type;
    const char* name;
    int block;  // values per block (32 or 256)
    int bytes;  // bytes per block
};

// nullptr for a type the op does not take.
const TypeInfo* type_info(int type);

// x quantized for the 32-value types (Q4_0 ... Q8_0, MXFP4): q = round(x / d), |q| <= 127,
// d = max|x| / 127 (0 for an all-zero block); sum = the q's sum (for the types with a min).
struct X32 {
    float d;
    int32_t sum;
    int8_t q[32];
};
static_assert(sizeof(X32) == 40, "X32 is packed");

// x quantized for the K-quants (Q2_K ... Q6_K), 256 values: d as above (f32), bsums[i] = the
// sum of q[16 i .. 16 i + 15].
struct X256 {
    float d;
    int16_t bsums[16];
    int8_t q[256];
};
static_assert(sizeof(X256) == 292, "X256 is packed");

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512Vnni = 2 };

// The best ISA this CPU runs (cpuid, once); SHARDLINE_KERNEL_ISA=scalar|avx2|avx512vnni caps it.
Isa best_isa();
const char* isa_name(Isa isa);

// One tile of dot products: y[j * y_stride + i] = dot(weight row i, activation row j), for
// i < n and j < m, over `cols` values. Rows are w_stride (and x_stride) bytes apart.
struct Tile {
    int64_t cols;
    const uint8_t* w;
    size_t w_stride;
    int64_t n;
    const uint8_t* x;  // X32 or X256 blocks
    size_t x_stride;
    int64_t m;
    float* y;
    int64_t y_stride;
};

using TileFn = void (*)(const Tile&);
using DequantFn = void (*)(int64_t cols, const uint8_t* w_row, float* out);

struct Kernels {
    TileFn tile;  // nullptr: no kernel for this (type, ISA)
    DequantFn dequant;  // one row to f32 (the gather, checks)
};

// The kernels for `type` at `isa` (falling back to a lower ISA's where a type has no kernel
// at that one); nullptr for an unknown type.
const Kernels* kernels_for(int type, Isa isa);

// Each ISA's table (common.cpp joins the two families). Each family and ISA is its own
// translation unit, compiled with that ISA's flags only (CMakeLists.txt): nullptr for a type
// it does not hold. The dequant of the SIMD tables may be the scalar one.
const Kernels* scalar_kernels(int type);
const Kernels* avx2_kernels(int type);
const Kernels* vnni_kernels(int type);
const Kernels* legacy_scalar(int type);  // legacy_scalar.cpp: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4
const Kernels* legacy_avx2(int type);    // legacy_avx2.cpp
const Kernels* legacy_vnni(int type);    // legacy_vnni.cpp
const Kernels* kquant_scalar(int type);  // kquant_scalar.cpp: Q2_K Q3_K Q4_K Q5_K Q6_K
const Kernels* kquant_avx2(int type);    // kquant_avx2.cpp
const Kernels* kquant_vnni(int type);    // kquant_vnni.cpp

// x (cols f32 values, cols a multiple of the type's block) into the activation blocks `type`
// takes; returns the bytes one activation row takes.
size_t activation_row_bytes(int type, int64_t cols);
void quantize_row(int type, const float* x, int64_t cols, uint8_t* out, Isa isa);

// Small helpers the kernels share.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float e8m0_half(uint8_t e);  // half of 2^(e - 127), as MXFP4 scales its doubled e2m1 values

}  // namespace shardline
