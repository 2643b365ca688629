// Every (type, ISA) kernel against the scalar dequantized reference, on random blocks, with
// every buffer exactly its size (built under AddressSanitizer by the tests: a kernel that reads
// past a row, or past an activation row, stops the check). Exit 0 when all agree.
//
//   kernel_check            all types, every ISA this CPU runs
//   kernel_check Q4_K ...   only those types
//   kernel_check --bench Q4_K [rows cols]   one thread's G weights/s at 1 and 4 activation rows
#include <chrono>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "blocks.hpp"

using namespace shardline;

namespace {

const int kTypes[] = {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K};

// Offsets of each type's f16 fields in a block: random bytes there could be NaN or huge.
std::vector<int> half_fields(int type) {
    switch (type) {
        case Q4_0: case Q5_0: case Q8_0: return {0};
        case Q4_1: case Q5_1: case Q4_K: case Q5_K: return {0, 2};
        case Q2_K: return {80, 82};
        case Q3_K: return {108};
        case Q6_K: return {208};
        default: return {};
    }
}

void fill_blocks(int type, uint8_t* w, size_t bytes, std::mt19937& rng) {
    const TypeInfo* t = type_info(type);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
    for (size_t i = 0; i < bytes; ++i) w[i] = static_cast<uint8_t>(byte(rng));
    for (size_t b = 0; b < bytes / static_cast<size_t>(t->bytes); ++b) {
        uint8_t* blk = w + b * static_cast<size_t>(t->bytes);
        for (int off : half_fields(type)) {
            uint16_t h = float_to_half(scale(rng));
            std::memcpy(blk + off, &h, 2);
        }
        if (type == MXFP4) blk[0] = static_cast<uint8_t>(118 + byte(rng) % 12);
    }
}

// x row j dequantized from its activation blocks.
std::vector<float> activation_values(int type, const uint8_t* x, int64_t cols) {
    std::vector<float> v(static_cast<size_t>(cols));
    if (type_info(type)->block == 256) {
        const X256* b = reinterpret_cast<const X256*>(x);
        for (int64_t i = 0; i < cols; ++i) v[i] = b[i / 256].d * b[i / 256].q[i % 256];
    } else {
        const X32* b = reinterpret_cast<const X32*>(x);
        for (int64_t i = 0; i < cols; ++i) v[i] = b[i / 32].d * b[i / 32].q[i % 32];
    }
    return v;
}

bool check_quantizer(int type, int64_t cols, std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(cols));
    for (float& v : x) v = normal(rng);
    size_t bytes = activation_row_bytes(type, cols);
    std::unique_ptr<uint8_t[]> a(new uint8_t[bytes]), b(new uint8_t[bytes]);
    quantize_row(type, x.data(), cols, a.get(), Isa::Scalar);
    if (best_isa() == Isa::Scalar) return true;
    quantize_row(type, x.data(), cols, b.get(), Isa::Avx2);
    if (std::memcmp(a.get(), b.get(), bytes) != 0) {
        std::printf("FAIL quantize %s cols=%ld: avx2 differs from scalar\n", type_info(type)->name, static_cast<long>(cols));
        return false;
    }
    return true;
}

bool check_tile(int type, Isa isa, const Kernels* k, int64_t cols, int64_t n, int64_t m, std::mt19937& rng) {
    const TypeInfo* t = type_info(type);
    size_t row = static_cast<size_t>(cols / t->block * t->bytes), xrow = activation_row_bytes(type, cols);
    // Exactly sized: a read past the last weight row or activation row is out of bounds.
    std::unique_ptr<uint8_t[]> w(new uint8_t[row * n]), x(new uint8_t[xrow * m]);
    fill_blocks(type, w.get(), row * n, rng);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> xf(static_cast<size_t>(cols));
    for (int64_t j = 0; j < m; ++j) {
        for (float& v : xf) v = normal(rng);
        quantize_row(type, xf.data(), cols, x.get() + j * xrow, isa == Isa::Scalar ? Isa::Scalar : Isa::Avx2);
    }
    std::vector<float> y(static_cast<size_t>(n * m), NAN);
    k->tile(Tile{cols, w.get(), row, n, x.get(), xrow, m, y.data(), n});
    const Kernels* ref = scalar_kernels(type);
    std::vector<float> wf(static_cast<size_t>(cols));
    for (int64_t i = 0; i < n; ++i) {
        ref->dequant(cols, w.get() + i * row, wf.data());
        for (int64_t j = 0; j < m; ++j) {
            std::vector<float> xv = activation_values(type, x.get() + j * xrow, cols);
            double want = 0, mag = 0;
            for (int64_t c = 0; c < cols; ++c) {
                want += static_cast<double>(wf[c]) * xv[c];
                mag += std::fabs(static_cast<double>(wf[c]) * xv[c]);
            }
            double got = y[static_cast<size_t>(j * n + i)];
            if (!(std::fabs(got - want) <= 2e-5 * mag + 1e-6)) {
                std::printf("FAIL %s %s cols=%ld n=%ld m=%ld row %ld x %ld: %.8g, want %.8g\n", t->name,
                            isa_name(isa), static_cast<long>(cols), static_cast<long>(n), static_cast<long>(m),
                            static_cast<long>(i), static_cast<long>(j), got, want);
                return false;
            }
        }
    }
    return true;
}

int bench(const std::string& name, int64_t n, int64_t cols) {
    int type = -1;
    for (int t : kTypes)
        if (name == type_info(t)->name) type = t;
    if (type < 0) return 2;
    const TypeInfo* t = type_info(type);
    std::mt19937 rng(7);
    size_t row = static_cast<size_t>(cols / t->block * t->bytes), xrow = activation_row_bytes(type, cols);
    std::vector<uint8_t> w(row * n), x(xrow * 8);
    fill_blocks(type, w.data(), w.size(), rng);
    std::vector<float> xf(static_cast<size_t>(cols), 0.5f), y(static_cast<size_t>(n * 8));
    for (int j = 0; j < 8; ++j) quantize_row(type, xf.data(), cols, x.data() + j * xrow, best_isa());
    const Kernels* k = kernels_for(type, best_isa());
    for (int64_t m : {1, 4}) {
        double best = 1e30;
        for (int rep = 0; rep < 7; ++rep) {
            auto t0 = std::chrono::steady_clock::now();
            k->tile(Tile{cols, w.data(), row, n, x.data(), xrow, m, y.data(), n});
            best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::printf("%s %s m=%ld: %.2f G weights/s (%.1f GB/s of blocks), one thread\n", t->name,
                    isa_name(best_isa()), static_cast<long>(m), n * cols / best / 1e9, row * n / best / 1e9);
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc >= 3 && std::string(argv[1]) == "--bench")
        return bench(argv[2], argc > 3 ? std::atol(argv[3]) : 8192, argc > 4 ? std::atol(argv[4]) : 4096);
    std::vector<std::string> only(argv + 1, argv + argc);
    std::mt19937 rng(1234);
    std::vector<Isa> isas{Isa::Scalar};
    if (static_cast<int>(best_isa()) >= static_cast<int>(Isa::Avx2)) isas.push_back(Isa::Avx2);
    if (best_isa() == Isa::Avx512Vnni) isas.push_back(Isa::Avx512Vnni);
    int failed = 0, checked = 0;
    for (int type : kTypes) {
        const TypeInfo* t = type_info(type);
        if (!only.empty() && std::find(only.begin(), only.end(), std::string(t->name)) == only.end()) continue;
        for (int64_t blocks : {1, 2, 3, 6, 48}) failed += !check_quantizer(type, blocks * t->block, rng);
        for (Isa isa : isas) {
            const Kernels* k = isa == Isa::Scalar ? scalar_kernels(type)
                               : isa == Isa::Avx2  ? avx2_kernels(type)
                                                   : vnni_kernels(type);
            if (k == nullptr || k->tile == nullptr || k->dequant == nullptr) {
                std::printf("MISSING %s %s\n", t->name, isa_name(isa));
                ++failed;
                continue;
            }
            bool ok = true;
            for (int64_t blocks : {1, 2, 3, 6, 48})
                for (int64_t n : {1, 2, 3, 4, 5, 8, 9})
                    for (int64_t m : {1, 2, 3, 4, 7}) {
                        ok = ok && check_tile(type, isa, k, blocks * t->block, n, m, rng);
                        ++checked;
                    }
            std::printf("%s %s %s\n", ok ? "ok  " : "FAIL", t->name, isa_name(isa));
            failed += !ok;
        }
    }
    std::printf("%d tiles checked, %d failures (cpu: %s)\n", checked, failed, isa_name(best_isa()));
    return failed == 0 ? 0 : 1;
}
