// GgufMatMul and GgufGather: shapes checked when the graph is read (a block tensor of the wrong
// byte length is refused there, naming it), the work split over output rows with TBB.
#include "gguf_matmul.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <string>
#include <vector>

#include "blocks.hpp"

namespace shardline {

namespace {

// Weight rows per task: small enough that both cores get work on the smallest matrices here,
// large enough that a task's rows (then re-read from cache for each activation chunk) pay
// for its scheduling.
constexpr int64_t kRowsPerTask = 32;
// Activation rows per tile: a chunk of quantized x stays in L1/L2 while a tile of weight rows
// is dotted with it.
constexpr int64_t kActivationChunk = 16;

const TypeInfo& checked_type(const ov::Node* node, int64_t type, int64_t cols) {
    const TypeInfo* t = type_info(static_cast<int>(type));
    NODE_VALIDATION_CHECK(node, t != nullptr, "GGUF block type ", type, " is not one the kernels take");
    NODE_VALIDATION_CHECK(node, cols > 0 && cols % t->block == 0, t->name, " rows of ", cols,
                          " values are not whole blocks of ", t->block);
    return *t;
}

void check_blocks(const ov::Node* node, const std::string& tensor, const ov::PartialShape& w, const TypeInfo& t,
                  int64_t rows, int64_t cols) {
    NODE_VALIDATION_CHECK(node, w.rank().is_static() && w.rank().get_length() == 2, "blocks must be [rows, row bytes]");
    const int64_t row_bytes = cols / t.block * t.bytes;
    NODE_VALIDATION_CHECK(node, w[0].compatible(rows) && w[1].compatible(row_bytes), "blocks of ",
                          tensor, " are ", w, " bytes, but ", rows, " rows of ", cols, " ",
                          t.name, " values take [", rows, ",", row_bytes, "]");
}

}  // namespace

GgufMatMul::GgufMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& w, int64_t type, int64_t rows,
                       int64_t cols, const std::string& tensor)
    : Op({x, w}), type_(type), rows_(rows), cols_(cols), tensor_(tensor) {
    constructor_validate_and_infer_types();
}

void GgufMatMul::validate_and_infer_types() {
    const TypeInfo& t = checked_type(this, type_, cols_);
    NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
    NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::u8, "blocks must be u8");
    check_blocks(this, tensor_, get_input_partial_shape(1), t, rows_, cols_);
    ov::PartialShape x = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, x.rank().is_static() && x.rank().get_length() >= 1, "x needs a static rank");
    NODE_VALIDATION_CHECK(this, x[x.size() - 1].compatible(cols_), "x has ", x, " but the blocks take ", cols_,
                          " values a row");
    x[x.size() - 1] = rows_;
    set_output_type(0, ov::element::f32, x);
}

std::shared_ptr<ov::Node> GgufMatMul::clone_with_new_inputs(const ov::OutputVector& args) const {
    check_new_args_count(this, args);
    return std::make_shared<GgufMatMul>(args[0], args[1], type_, rows_, cols_, tensor_);
}

bool GgufMatMul::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("type", type_);
    visitor.on_attribute("rows", rows_);
    visitor.on_attribute("cols", cols_);
    visitor.on_attribute("tensor", tensor_);
    return true;
}

bool GgufMatMul::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const ov::Tensor& x = inputs[0];
    const ov::Tensor& w = inputs[1];
    ov::Shape shape = x.get_shape();
    OPENVINO_ASSERT(!shape.empty() && static_cast<int64_t>(shape.back()) == cols_, "GgufMatMul: x ", shape);
    OPENVINO_ASSERT(w.get_byte_size() == static_cast<size_t>(rows_) * (cols_ / type_info(type_)->block) *
                                             type_info(type_)->bytes, "GgufMatMul: blocks of ", w.get_byte_size(), " bytes");
    shape.back() = static_cast<size_t>(rows_);
    outputs[0].set_shape(shape);
    const int64_t m = static_cast<int64_t>(x.get_size()) / cols_;
    if (m == 0) return true;
    const Isa isa = best_isa();
    const Kernels* k = kernels_for(static_cast<int>(type_), isa);
    OPENVINO_ASSERT(k != nullptr && k->tile != nullptr, "GgufMatMul: no kernel for type ", type_);
    const size_t x_row = activation_row_bytes(static_cast<int>(type_), cols_);
    std::vector<uint8_t> xq(x_row * static_cast<size_t>(m));  // x quantized once per call
    const float* xf = x.data<const float>();
    tbb::parallel_for(int64_t(0), m, [&](int64_t j) {
        quantize_row(static_cast<int>(type_), xf + j * cols_, cols_, xq.data() + j * x_row, isa);
    });
    const uint8_t* wb = static_cast<const uint8_t*>(w.data());
    const size_t w_row = w.get_byte_size() / static_cast<size_t>(rows_);
    float* y = outputs[0].data<float>();
    const int64_t tasks = (rows_ + kRowsPerTask - 1) / kRowsPerTask;
    tbb::parallel_for(int64_t(0), tasks, [&](int64_t task) {
        const int64_t r0 = task * kRowsPerTask, n = std::min(kRowsPerTask, rows_ - r0);
        for (int64_t j0 = 0; j0 < m; j0 += kActivationChunk) {
            const int64_t mj = std::min(kActivationChunk, m - j0);
            k->tile(Tile{cols_, wb + r0 * w_row, w_row, n, xq.data() + j0 * x_row, x_row, mj, y + j0 * rows_ + r0, rows_});
        }
    });
    return true;
}

GgufGather::GgufGather(const ov::Output<ov::Node>& w, const ov::Output<ov::Node>& ids, int64_t type, int64_t rows,
                       int64_t cols, const std::string& tensor)
    : Op({w, ids}), type_(type), rows_(rows), cols_(cols), tensor_(tensor) {
    constructor_validate_and_infer_types();
}

void GgufGather::validate_and_infer_types() {
    const TypeInfo& t = checked_type(this, type_, cols_);
    NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::u8, "blocks must be u8");
    // The CPU plugin narrows i64 inputs to i32 before a Reference node: both are taken.
    const ov::element::Type ids_type = get_input_element_type(1);
    NODE_VALIDATION_CHECK(this, ids_type == ov::element::i64 || ids_type == ov::element::i32, "ids must be i64 or i32");
    check_blocks(this, tensor_, get_input_partial_shape(0), t, rows_, cols_);
    ov::PartialShape ids = get_input_partial_shape(1);
    NODE_VALIDATION_CHECK(this, ids.rank().is_static(), "ids need a static rank");
    ov::PartialShape out = ids;
    out.push_back(cols_);
    set_output_type(0, ov::element::f32, out);
}

std::shared_ptr<ov::Node> GgufGather::clone_with_new_inputs(const ov::OutputVector& args) const {
    check_new_args_count(this, args);
    return std::make_shared<GgufGather>(args[0], args[1], type_, rows_, cols_, tensor_);
}

bool GgufGather::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("type", type_);
    visitor.on_attribute("rows", rows_);
    visitor.on_attribute("cols", cols_);
    visitor.on_attribute("tensor", tensor_);
    return true;
}

bool GgufGather::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const ov::Tensor& w = inputs[0];
    const ov::Tensor& ids = inputs[1];
    ov::Shape shape = ids.get_shape();
    shape.push_back(static_cast<size_t>(cols_));
    outputs[0].set_shape(shape);
    const size_t n = ids.get_size(), w_row = w.get_byte_size() / static_cast<size_t>(rows_);
    std::vector<int64_t> id(n);
    if (ids.get_element_type() == ov::element::i32)
        std::copy_n(ids.data<const int32_t>(), n, id.begin());
    else
        std::copy_n(ids.data<const int64_t>(), n, id.begin());
    for (size_t i = 0; i < n; ++i)
        OPENVINO_ASSERT(id[i] >= 0 && id[i] < rows_, "GgufGather: token id ", id[i], " outside 0-", rows_ - 1);
    const Kernels* k = scalar_kernels(static_cast<int>(type_));
    const uint8_t* wb = static_cast<const uint8_t*>(w.data());
    float* y = outputs[0].data<float>();
    tbb::parallel_for(size_t(0), n, [&](size_t i) { k->dequant(cols_, wb + id[i] * w_row, y + i * cols_); });
    return true;
}

}  // namespace shardline
