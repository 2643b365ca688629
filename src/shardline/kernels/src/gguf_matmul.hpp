// The op: y = x @ W.T with W the file's own blocks (GgufMatMul), and rows of W as f32
// (GgufGather: the token embedding, which a tied head shares with GgufMatMul).
#pragma once

#include <openvino/op/op.hpp>
#include <string>

namespace shardline {

// x f32 [..., cols], w u8 [rows, cols / block * bytes] (the file's blocks, rows in order)
// -> y f32 [..., rows]. x is quantized once per call (X32 or X256 blocks), then every tile of
// weight rows is dotted with every activation row: weights are streamed once per call.
class GgufMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GgufMatMul", "shardline");
    GgufMatMul() = default;
    GgufMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& w, int64_t type, int64_t rows, int64_t cols,
               const std::string& tensor);
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
    bool has_evaluate() const override { return true; }

private:
    int64_t type_ = 0, rows_ = 0, cols_ = 0;
    std::string tensor_;  // the weight's name, for errors (the IR reads it before the node's name)
};

// w u8 [rows, row bytes] as above, ids i64 [...] -> f32 [..., cols]: the ids' rows dequantized.
// An id outside [0, rows) is an error for the call (nothing past the table is read).
class GgufGather : public ov::op::Op {
public:
    OPENVINO_OP("GgufGather", "shardline");
    GgufGather() = default;
    GgufGather(const ov::Output<ov::Node>& w, const ov::Output<ov::Node>& ids, int64_t type, int64_t rows, int64_t cols,
               const std::string& tensor);
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
    bool has_evaluate() const override { return true; }

private:
    int64_t type_ = 0, rows_ = 0, cols_ = 0;
    std::string tensor_;  // the weight's name, for errors (the IR reads it before the node's name)
};

}  // namespace shardline
