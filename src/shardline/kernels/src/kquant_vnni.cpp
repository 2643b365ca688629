// K-quant kernels, AVX-VNNI: kquant_simd.inc with vpdpbusd as the int8 dot.
#define KQ_VNNI 1
#include "kquant_simd.inc"

namespace shardline {

// This file is built with -mavxvnni, so vpdpbusd here is the VEX (AVX-VNNI) encoding. The
// dispatch also picks this ISA on AVX512-VNNI CPUs without AVX-VNNI (Ice Lake, Zen 4), where
// that encoding faults: there, no table, and kernels_for falls back to AVX2.
const Kernels* kquant_vnni(int type) {
    static const bool vex_vnni = __builtin_cpu_supports("avxvnni");
    return vex_vnni ? table(type) : nullptr;
}

}  // namespace shardline
