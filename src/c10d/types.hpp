// src/c10d/types.hpp -- torch's dtypes and ReduceOps as commux's collectives see them (internal).
//
// The one place that maps them: a table of {at::ScalarType, commux::DataType} and one of
// {c10d::ReduceOp::RedOpType, commux::ReduceOp, name, the dtypes it takes} (types.cpp). Every
// caller in src/c10d goes through the functions below; what is not in a table is refused with a
// c10::ValueError naming the operation (and, through errors.hpp's GroupScope, the group).
#pragma once

#include <c10/core/ScalarType.h>

#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "commux/collectives.hpp"

namespace commux::c10d_detail {

// The kernels' dtype of a torch dtype. Throws "commux <op>: dtype <X> is not supported for
// reductions" for one commux has no kernels for (e.g. float8, uint16).
DataType to_dtype(const char* op, at::ScalarType s);
// How errors name a torch dtype: commux's name ("float32") where it has one, else torch's.
std::string dtype_text(at::ScalarType s);
// The torch dtype of a commux one (every DataType has one).
at::ScalarType scalar_type(DataType t);

// torch's name of a ReduceOp ("SUM", "PREMUL_SUM", ...); "UNUSED" for anything else.
const char* c10d_op_name(c10d::ReduceOp::RedOpType t);

// A ReduceOp as the kernels see it, plus the scaling AVG and PREMUL_SUM need.
struct Reduction {
  ReduceOp op = ReduceOp::kSum;
  double pre_scale = 1.0;  // PREMUL_SUM: applied to the inputs
  bool premul = false;     // PREMUL_SUM (whatever its factor, which may differ between ranks)
  bool average = false;    // AVG: the result is divided by the group size
};

// Validated on every rank before anything is posted, so a bad op never leaves peers waiting:
// the dtype (to_dtype), the op (in the table), the op's dtypes (AVG and PREMUL_SUM: floating or
// complex; the rest as core's check_reduction says), PREMUL_SUM's factor.
Reduction to_reduction(const char* op, const c10d::ReduceOp& r, at::ScalarType st);

}  // namespace commux::c10d_detail
