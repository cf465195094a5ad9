// src/c10d/torch_compat.hpp -- the one place that knows how the torch releases commux supports
// (2.11 .. 2.14, see README "Supported torch") differ in the c10d API the backend uses. Each entry
// names the release that changed it; the rest of src/c10d uses only the names below.
//
// Checked against the installed headers of 2.11.0, 2.12.1, 2.13.0 and 2.14.1 (CI builds against
// each). A new release that changes something else gets its entry here, not an #if in the backend.
#pragma once

#include <torch/version.h>  // TORCH_VERSION_MAJOR / _MINOR
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if !defined(TORCH_VERSION_MAJOR) || !defined(TORCH_VERSION_MINOR)
#error "commux: torch/version.h did not define TORCH_VERSION_MAJOR/MINOR"
#endif

#define COMMUX_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !COMMUX_TORCH_AT_LEAST(2, 11)
#error "commux supports torch 2.11 and later (see README, Supported torch)"
#endif

namespace commux::torch_compat {

// The PREMUL_SUM factor (a double or a one-element tensor) rides in this ReduceOp supplement.
// torch 2.13 renamed NCCLPreMulSumSupplement to PreMulSumSupplement (keeping the old name as an
// alias for now); before 2.13 only the NCCL name exists.
#if COMMUX_TORCH_AT_LEAST(2, 13)
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#endif

// The OpType a Work of reduce_scatter_tensor_coalesced reports. torch 2.12 added
// REDUCE_SCATTER_TENSOR_COALESCED; 2.11 has no coalesced reduce-scatter type, and the closest it
// has is the one of the single-tensor form, reduce_scatter_tensor (_REDUCE_SCATTER_BASE).
#if COMMUX_TORCH_AT_LEAST(2, 12)
inline constexpr c10d::OpType kReduceScatterTensorCoalesced =
    c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
inline constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::_REDUCE_SCATTER_BASE;
#endif

}  // namespace commux::torch_compat
