#include "tensor_checks.hpp"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include "commux/communicator.hpp"
#include "device.hpp"
#include "errors.hpp"

namespace commux::c10d_detail {

void check_tensor(const char* op, const at::Tensor& t, const char* what) {
  if (!t.defined()) invalid(op, std::string(what) + " is undefined");
  if (t.layout() != at::kStrided)
    invalid(op,
            std::string(what) +
                " must be dense (got a sparse tensor; only allreduce takes sparse COO tensors)");
  if (!t.is_contiguous()) {
    invalid(op, std::string(what) + " must be contiguous (sizes " + c10::str(t.sizes()) +
                    ", strides " + c10::str(t.strides()) + "); call .contiguous() first");
  }
  memory_type_of(op, t, what);  // a device commux (or its UCX) cannot carry fails here
}

const at::Tensor& single(const char* op, const std::vector<at::Tensor>& ts) {
  if (ts.size() != 1) {
    invalid(op, "expects exactly one tensor per process, got " + std::to_string(ts.size()));
  }
  check_tensor(op, ts[0]);
  return ts[0];
}

void check_device(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what,
                  const char* ref_name) {
  if (t.device() != ref.device()) {
    invalid(op, std::string(what) + " is on " + t.device().str() + " but " + ref_name + " is on " +
                    ref.device().str() + "; a collective's tensors must share one device");
  }
}

void check_same(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what) {
  check_tensor(op, t, what);
  check_device(op, ref, t, what);
  if (t.scalar_type() != ref.scalar_type()) {
    invalid(op, std::string(what) + " has dtype " + c10::toString(t.scalar_type()) +
                    " but the input has " + c10::toString(ref.scalar_type()));
  }
  if (t.numel() != ref.numel()) {
    invalid(op, std::string(what) + " has " + std::to_string(t.numel()) +
                    " elements but the input has " + std::to_string(ref.numel()));
  }
}

void check_root(const char* op, int64_t root, int size) {
  if (root < 0 || root >= size) {
    invalid(op, "root rank " + std::to_string(root) + " is outside the group (size " +
                    std::to_string(size) + ")");
  }
}

void check_blocks(const char* op, const at::Tensor& small, const std::string& small_name,
                  const at::Tensor& big, const std::string& big_name, int size) {
  check_tensor(op, small, small_name.c_str());
  check_tensor(op, big, big_name.c_str());
  check_device(op, small, big, big_name.c_str(), ("the " + small_name).c_str());
  if (big.scalar_type() != small.scalar_type() || big.numel() != small.numel() * size) {
    invalid(op, big_name + " must have the " + small_name + "'s dtype and " + std::to_string(size) +
                    " times its elements (" + small_name + ": " + std::to_string(small.numel()) +
                    " " + c10::toString(small.scalar_type()) + ", " + big_name + ": " +
                    std::to_string(big.numel()) + " " + c10::toString(big.scalar_type()) + ")");
  }
}

std::vector<at::Tensor> root_list(const char* op, const std::vector<std::vector<at::Tensor>>& lists,
                                  const at::Tensor& ref, bool is_root, int root, int size,
                                  const std::string& what) {
  if (!is_root) {
    if (!lists.empty() && !lists[0].empty()) {
      invalid(op, "only the root (rank " + std::to_string(root) + ") takes " + what + " tensors");
    }
    return {};
  }
  if (lists.size() != 1 || lists[0].size() != static_cast<std::size_t>(size)) {
    invalid(op, "the root expects one " + what + " list of " + std::to_string(size) +
                    " tensors, got " +
                    (lists.size() == 1 ? std::to_string(lists[0].size()) + " tensors"
                                       : std::to_string(lists.size()) + " lists"));
  }
  const std::string each = what + " tensor";
  for (auto& t : lists[0]) check_same(op, ref, t, each.c_str());
  return lists[0];
}

void check_p2p(const char* op, const std::vector<at::Tensor>& tensors, int peer, int size,
               bool is_send, int tag) {
  if (tensors.empty()) invalid(op, "needs at least one tensor");
  if (peer != kAnySource && (peer < 0 || peer >= size)) {
    invalid(op, std::string(is_send ? "destination" : "source") + " rank " + std::to_string(peer) +
                    " is outside the group");
  }
  if (tag < 0) {
    invalid(op, "tag " + std::to_string(tag) + " is negative; tags are 0 .. 2^31-1");
  }
  for (const auto& t : tensors) check_tensor(op, t);
}

void check_coalesced(const char* op, const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) invalid(op, "needs at least one tensor");
  for (auto& t : tensors) {
    check_tensor(op, t);
    check_device(op, tensors[0], t, "a tensor", "the first");
    if (t.scalar_type() != tensors[0].scalar_type()) invalid(op, "all tensors must have one dtype");
  }
}

void check_allgather_outputs(const char* op, const std::vector<std::vector<at::Tensor>>& outputs,
                             const at::Tensor& in, int size) {
  if (outputs.size() != 1 || outputs[0].size() != static_cast<std::size_t>(size)) {
    invalid(op, "expects one output list of " + std::to_string(size) + " tensors, got " +
                    (outputs.size() == 1 ? std::to_string(outputs[0].size()) + " tensors"
                                         : std::to_string(outputs.size()) + " lists"));
  }
  for (auto& o : outputs[0]) check_same(op, in, o, "output tensor");
}

void check_allgather_coalesced(const char* op, const std::vector<std::vector<at::Tensor>>& outputs,
                               const std::vector<at::Tensor>& inputs, int size) {
  if (outputs.size() != static_cast<std::size_t>(size)) {
    invalid(op, "expects " + std::to_string(size) + " output lists, got " +
                    std::to_string(outputs.size()));
  }
  for (auto& list : outputs) {
    if (list.size() != inputs.size()) invalid(op, "each output list needs one tensor per input");
    for (std::size_t i = 0; i < inputs.size(); ++i)
      check_same(op, inputs[i], list[i], "output tensor");
  }
  for (auto& in : inputs) {
    check_tensor(op, in, "input");
    check_device(op, inputs[0], in, "an input", "the first");
  }
}

void check_reduce_scatter_inputs(const char* op, const std::vector<std::vector<at::Tensor>>& inputs,
                                 const at::Tensor& out, int size) {
  if (inputs.size() != 1 || inputs[0].size() != static_cast<std::size_t>(size)) {
    invalid(op, "expects one input list of " + std::to_string(size) + " tensors");
  }
  for (auto& i : inputs[0]) check_same(op, out, i, "input tensor");
}

void check_blocks_coalesced(const char* op, const std::vector<at::Tensor>& outputs,
                            const std::vector<at::Tensor>& inputs, int size, bool gather) {
  if (outputs.size() != inputs.size()) invalid(op, "needs one output per input");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    // (appended, not "input " + to_string(i): GCC 12's -O3 gives a false -Wrestrict on that)
    std::string in_name = "input ", out_name = "output ";
    in_name += std::to_string(i);
    out_name += std::to_string(i);
    if (gather) {
      check_blocks(op, inputs[i], in_name, outputs[i], out_name, size);
    } else {
      check_blocks(op, outputs[i], out_name, inputs[i], in_name, size);
    }
    check_device(op, inputs[0], inputs[i], in_name.c_str(), "input 0");
  }
}

void check_alltoall_base(const char* op, const at::Tensor& input, const at::Tensor& output) {
  check_tensor(op, input, "input");
  check_tensor(op, output, "output");
  check_device(op, input, output, "the output");
  if (input.scalar_type() != output.scalar_type()) invalid(op, "input and output dtypes differ");
}

void check_alltoall(const char* op, const std::vector<at::Tensor>& outputs,
                    const std::vector<at::Tensor>& inputs, int size) {
  const auto n = static_cast<std::size_t>(size);
  if (inputs.size() != n || outputs.size() != n) {
    invalid(op, "expects " + std::to_string(n) + " input and output tensors, got " +
                    std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  }
  for (std::size_t i = 0; i < n; ++i) {
    check_tensor(op, inputs[i], "input");
    check_tensor(op, outputs[i], "output");
    check_device(op, inputs[0], inputs[i], "an input", "input 0");
    check_device(op, inputs[0], outputs[i], "an output", "input 0");
    if (inputs[i].scalar_type() != inputs[0].scalar_type() ||
        outputs[i].scalar_type() != inputs[0].scalar_type()) {
      invalid(op, "all tensors must have one dtype");
    }
  }
}

void split_bytes(const char* op, const char* which, const at::Tensor& t,
                 const std::vector<int64_t>& splits, int size, std::vector<std::size_t>& counts,
                 std::vector<std::size_t>& displs) {
  if (t.dim() == 0) invalid(op, std::string(which) + " must have at least one dimension");
  const int64_t rows = t.size(0);
  const std::size_t row_bytes = rows == 0 ? 0 : nbytes(t) / rows;
  // (No copy of `splits`: an alltoall_base call is a few microseconds, a heap allocation a
  // noticeable part of that.)
  const bool even = splits.empty();
  if (even && rows % size != 0) {
    invalid(op, std::string(which) + " has " + std::to_string(rows) +
                    " rows, not divisible by the group size " + std::to_string(size) +
                    "; pass split sizes");
  }
  if (!even && splits.size() != static_cast<std::size_t>(size)) {
    invalid(op, std::string(which) + " split sizes have " + std::to_string(splits.size()) +
                    " entries but the group has " + std::to_string(size) + " ranks");
  }
  const auto rows_of = [&](int i) { return even ? rows / size : splits[i]; };
  for (int i = 0; i < size; ++i) {
    if (rows_of(i) < 0) invalid(op, std::string(which) + " split sizes contain a negative entry");
  }
  int64_t sum = 0;
  for (int i = 0; i < size; ++i) {
    // (Each at most the rows, so that the sum cannot wrap around to the rows: entries near 2^62
    // once did, and the byte counts overran the tensor.)
    if (rows_of(i) > rows) {
      invalid(op, std::string(which) + " split size " + std::to_string(rows_of(i)) + " (for rank " +
                      std::to_string(i) + ") exceeds the tensor's " + std::to_string(rows) +
                      " rows");
    }
    sum += rows_of(i);
  }
  if (sum != rows) {
    invalid(op, std::string(which) + " split sizes add up to " + std::to_string(sum) +
                    " but the tensor has " + std::to_string(rows) + " rows");
  }
  counts.resize(size);
  displs.resize(size);
  std::size_t off = 0;
  for (int i = 0; i < size; ++i) {
    counts[i] = static_cast<std::size_t>(rows_of(i)) * row_bytes;
    displs[i] = off;
    off += counts[i];
  }
}

}  // namespace commux::c10d_detail
