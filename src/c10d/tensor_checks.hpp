// src/c10d/tensor_checks.hpp -- what the "ucx" backend checks about its arguments before it posts
// anything (internal).
//
// Every check runs on the calling thread, on every rank, before a collective is queued or a send
// or receive posted, so bad input fails where it was passed instead of leaving peers waiting.
// Each throws c10::ValueError "commux <op>: <what> (<group>)" through errors.hpp's invalid(): the
// operation from `op`, the group from the caller's GroupScope. test_tensor_checks.cpp and
// python/tests/test_tensor_checks.py check their messages.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace commux::c10d_detail {

// A contiguous tensor's size in bytes.
inline std::size_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

// The bytes [first, second) a dense tensor with at least one element can touch: from its first
// element to one past its last (strides are never negative in torch).
inline std::pair<std::uintptr_t, std::uintptr_t> byte_span(const at::Tensor& t) {
  const auto elem = static_cast<std::uintptr_t>(t.element_size());
  std::uintptr_t span = elem;
  for (int64_t d = 0; d < t.dim(); ++d) {
    span += static_cast<std::uintptr_t>(t.size(d) - 1) * static_cast<std::uintptr_t>(t.stride(d)) *
            elem;
  }
  const auto first = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  return {first, first + span};
}

// Defined, dense (strided), contiguous, on a device commux (and its UCX) can carry.
void check_tensor(const char* op, const at::Tensor& t, const char* what = "tensor");

// The one tensor per process of broadcast, allreduce, reduce, ... (checked as above).
const at::Tensor& single(const char* op, const std::vector<at::Tensor>& ts);

// A collective's tensors share one device (its algorithms move one memory type).
void check_device(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what,
                  const char* ref_name = "the input");

// `t` is a valid tensor on `ref`'s device with `ref`'s dtype and number of elements.
void check_same(const char* op, const at::Tensor& ref, const at::Tensor& t, const char* what);

// 0 <= root < size.
void check_root(const char* op, int64_t root, int size);

// `big` must hold `size` times the elements of `small` in the same dtype (allgather's output,
// reduce-scatter's input); the names appear in the message ("output 2", ...).
void check_blocks(const char* op, const at::Tensor& small, const std::string& small_name,
                  const at::Tensor& big, const std::string& big_name, int size);

// The root's list of `size` tensors like `ref` (gather's outputs, scatter's inputs); the other
// ranks pass no tensors there. Returns the root's list (empty elsewhere).
std::vector<at::Tensor> root_list(const char* op, const std::vector<std::vector<at::Tensor>>& lists,
                                  const at::Tensor& ref, bool is_root, int root, int size,
                                  const std::string& what);

// Point-to-point: at least one tensor, the peer in the group (or kAnySource, -1), a tag that is
// not negative, every tensor valid.
void check_p2p(const char* op, const std::vector<at::Tensor>& tensors, int peer, int size,
               bool is_send, int tag);

// allreduce_coalesced: at least one tensor, all valid, on one device, with one dtype.
void check_coalesced(const char* op, const std::vector<at::Tensor>& tensors);

// allgather: one output list of `size` tensors, each like `in`.
void check_allgather_outputs(const char* op, const std::vector<std::vector<at::Tensor>>& outputs,
                             const at::Tensor& in, int size);

// allgather_coalesced: `size` output lists, each with one tensor like each input; inputs valid
// and on one device.
void check_allgather_coalesced(const char* op, const std::vector<std::vector<at::Tensor>>& outputs,
                               const std::vector<at::Tensor>& inputs, int size);

// reduce_scatter: one input list of `size` tensors, each like `out`.
void check_reduce_scatter_inputs(const char* op, const std::vector<std::vector<at::Tensor>>& inputs,
                                 const at::Tensor& out, int size);

// The *_tensor_coalesced forms: one output per input, each pair as check_blocks says (gather: the
// output holds `size` inputs; otherwise the input holds `size` outputs), all on input 0's device.
void check_blocks_coalesced(const char* op, const std::vector<at::Tensor>& outputs,
                            const std::vector<at::Tensor>& inputs, int size, bool gather);

// alltoall_base: both tensors valid, on one device, with one dtype.
void check_alltoall_base(const char* op, const at::Tensor& input, const at::Tensor& output);

// alltoall: `size` inputs and outputs, all valid, on input 0's device, with one dtype.
void check_alltoall(const char* op, const std::vector<at::Tensor>& outputs,
                    const std::vector<at::Tensor>& inputs, int size);

// Split sizes (rows of dim 0) -> byte counts and displacements; empty means even splits. `which`
// is "input" or "output".
void split_bytes(const char* op, const char* which, const at::Tensor& t,
                 const std::vector<int64_t>& splits, int size, std::vector<std::size_t>& counts,
                 std::vector<std::size_t>& displs);

}  // namespace commux::c10d_detail
