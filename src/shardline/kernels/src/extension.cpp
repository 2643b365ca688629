// The library `core.add_extension(path)` loads: the two ops, by the type names the IR carries.
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>

#include "blocks.hpp"
#include "gguf_matmul.hpp"

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<shardline::GgufMatMul>>(),
    std::make_shared<ov::OpExtension<shardline::GgufGather>>(),
}));

// For the loader's report (ctypes): the ISA this CPU's kernels run at.
extern "C" const char* shardline_kernel_isa() { return shardline::isa_name(shardline::best_isa()); }
