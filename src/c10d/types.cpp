#include "types.hpp"

#include <c10/util/Exception.h>

#include <string>

#include "commux/error.hpp"
#include "errors.hpp"
#include "torch_compat.hpp"

namespace commux::c10d_detail {

namespace {

struct DtypeEntry {
  at::ScalarType torch;
  DataType commux;
};

// Every dtype the collectives carry with a reduction (the others still travel as bytes where an
// operation does not reduce).
constexpr DtypeEntry kDtypes[] = {
    {at::kFloat, DataType::kFloat32},
    {at::kDouble, DataType::kFloat64},
    {at::kHalf, DataType::kFloat16},
    {at::kBFloat16, DataType::kBFloat16},
    {at::kChar, DataType::kInt8},
    {at::kShort, DataType::kInt16},
    {at::kInt, DataType::kInt32},
    {at::kLong, DataType::kInt64},
    {at::kByte, DataType::kUInt8},
    {at::kBool, DataType::kBool},
    {at::kComplexFloat, DataType::kComplex64},
    {at::kComplexDouble, DataType::kComplex128},
};

// Which dtypes a ReduceOp takes before core's check_reduction has its say.
enum class Takes { kAny, kFloatingOrComplex };

struct ReduceEntry {
  c10d::ReduceOp::RedOpType torch;
  ReduceOp commux;  // AVG and PREMUL_SUM are sums, scaled (Reduction)
  const char* name;
  Takes takes;
};

constexpr ReduceEntry kReduceOps[] = {
    {c10d::ReduceOp::SUM, ReduceOp::kSum, "SUM", Takes::kAny},
    {c10d::ReduceOp::AVG, ReduceOp::kSum, "AVG", Takes::kFloatingOrComplex},
    {c10d::ReduceOp::PRODUCT, ReduceOp::kProduct, "PRODUCT", Takes::kAny},
    {c10d::ReduceOp::MIN, ReduceOp::kMin, "MIN", Takes::kAny},
    {c10d::ReduceOp::MAX, ReduceOp::kMax, "MAX", Takes::kAny},
    {c10d::ReduceOp::BAND, ReduceOp::kBand, "BAND", Takes::kAny},
    {c10d::ReduceOp::BOR, ReduceOp::kBor, "BOR", Takes::kAny},
    {c10d::ReduceOp::BXOR, ReduceOp::kBxor, "BXOR", Takes::kAny},
    {c10d::ReduceOp::PREMUL_SUM, ReduceOp::kSum, "PREMUL_SUM", Takes::kFloatingOrComplex},
};

const ReduceEntry* find_op(c10d::ReduceOp::RedOpType t);

}  // namespace

std::string dtype_text(at::ScalarType s) {
  for (const auto& e : kDtypes) {
    if (e.torch == s) return dtype_name(e.commux);
  }
  return c10::toString(s);
}

namespace {

const ReduceEntry* find_op(c10d::ReduceOp::RedOpType t) {
  for (const auto& e : kReduceOps) {
    if (e.torch == t) return &e;
  }
  return nullptr;
}

}  // namespace

DataType to_dtype(const char* op, at::ScalarType s) {
  for (const auto& e : kDtypes) {
    if (e.torch == s) return e.commux;
  }
  invalid(op, std::string("dtype ") + c10::toString(s) + " is not supported for reductions");
}

at::ScalarType scalar_type(DataType t) {
  for (const auto& e : kDtypes) {
    if (e.commux == t) return e.torch;
  }
  return at::kByte;
}

const char* c10d_op_name(c10d::ReduceOp::RedOpType t) {
  const ReduceEntry* e = find_op(t);
  return e != nullptr ? e->name : "UNUSED";
}

Reduction to_reduction(const char* op, const c10d::ReduceOp& r, at::ScalarType st) {
  const DataType t = to_dtype(op, st);
  const ReduceEntry* e = find_op(r.op_);
  if (e == nullptr)
    invalid(op, std::string("ReduceOp ") + c10d_op_name(r.op_) + " is not supported");
  if (e->takes == Takes::kFloatingOrComplex && !is_floating(t) && !is_complex(t)) {
    invalid(op, std::string("ReduceOp ") + e->name +
                    " needs a floating-point or complex tensor, got " + dtype_name(t) +
                    " (use SUM and divide yourself)");
  }
  Reduction out;
  out.op = e->commux;
  if (r.op_ == c10d::ReduceOp::AVG) {
    out.average = true;
  } else if (r.op_ == c10d::ReduceOp::PREMUL_SUM) {
    auto* s = dynamic_cast<torch_compat::PreMulSumSupplement*>(r.supplement_.get());
    if (s == nullptr) invalid(op, "PREMUL_SUM without a factor");
    out.premul = true;
    out.pre_scale = s->tensor_factor.defined() ? s->tensor_factor.item<double>() : s->double_factor;
  }
  try {
    check_reduction(op, t, out.op);
  } catch (const Error& e2) {
    invalid_message(e2.what());
  }
  return out;
}

}  // namespace commux::c10d_detail
