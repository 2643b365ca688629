// K-quant kernels, AVX2: kquant_simd.inc with maddubs as the int8 dot.
#define KQ_VNNI 0
#include "kquant_simd.inc"

namespace shardline {

const Kernels* kquant_avx2(int type) { return table(type); }

}  // namespace shardline
