// Element-wise reduction kernels on host memory (dst = dst OP src), for every DataType x ReduceOp
// that check_reduction accepts.
//
// The common case (float32/float64/integer SUM on contiguous arrays) is a plain loop over
// __restrict pointers, which GCC and Clang vectorize at -O2/-O3. Integer arithmetic wraps around
// like torch's (computed in the unsigned type of at least 32 bits, so there is no signed overflow
// and no int promotion overflow). float16/bfloat16 convert to float, compute, and round back to
// nearest even. bool is one byte, any non-zero byte counts as true, and results are 0 or 1.
#include <complex>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "commux/collectives.hpp"
#include "half.hpp"

namespace commux {

std::size_t dtype_size(DataType t) noexcept {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kInt16: return 2;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kUInt8: return 1;
    case DataType::kBool: return 1;
    case DataType::kComplex64: return 8;
    case DataType::kComplex128: return 16;
  }
  return 0;
}

const char* dtype_name(DataType t) noexcept {
  switch (t) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kInt16: return "int16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kUInt8: return "uint8";
    case DataType::kBool: return "bool";
    case DataType::kComplex64: return "complex64";
    case DataType::kComplex128: return "complex128";
  }
  return "unknown dtype";
}

const char* reduce_op_name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
  }
  return "unknown op";
}

bool is_floating(DataType t) noexcept {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

bool is_complex(DataType t) noexcept {
  return t == DataType::kComplex64 || t == DataType::kComplex128;
}

namespace {

bool known_dtype(DataType t) { return dtype_size(t) != 0; }

bool known_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor: return true;
  }
  return false;
}

bool is_bitwise(ReduceOp op) {
  return op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
}

}  // namespace

void check_reduction(const char* op_name, DataType t, ReduceOp op) {
  // Built only for an error: this check runs in every reduction's call.
  const auto prefix = [op_name] {
    return std::string("commux ") + (op_name != nullptr ? op_name : "reduce") + ": ";
  };
  if (!known_dtype(t)) {
    throw Error(Errc::kInvalidArgument,
                prefix() + "unknown DataType " + std::to_string(static_cast<int>(t)));
  }
  if (!known_op(op)) {
    throw Error(Errc::kInvalidArgument,
                prefix() + "unknown ReduceOp " + std::to_string(static_cast<int>(op)));
  }
  if (is_complex(t) && (op == ReduceOp::kMin || op == ReduceOp::kMax)) {
    throw Error(Errc::kInvalidArgument, prefix() + "ReduceOp " + reduce_op_name(op) +
                                            " is not defined for " + dtype_name(t) +
                                            " (complex numbers have no order)");
  }
  if ((is_complex(t) || is_floating(t)) && is_bitwise(op)) {
    throw Error(Errc::kInvalidArgument, prefix() + "ReduceOp " + reduce_op_name(op) +
                                            " is not defined for " + dtype_name(t) +
                                            " (bitwise reductions need an integer or bool type)");
  }
}

namespace {

// ---- element operations ----------------------------------------------------------------------

// Integers: wrap-around in an unsigned type of at least 32 bits.
template <class T>
using Wide = std::conditional_t<(sizeof(T) < 4), std::uint32_t, std::make_unsigned_t<T>>;

template <class T>
struct IntOps {
  static T sum(T a, T b) {
    return static_cast<T>(static_cast<Wide<T>>(a) + static_cast<Wide<T>>(b));
  }
  static T prod(T a, T b) {
    return static_cast<T>(static_cast<Wide<T>>(a) * static_cast<Wide<T>>(b));
  }
  static T min(T a, T b) { return b < a ? b : a; }
  static T max(T a, T b) { return a < b ? b : a; }
  static T band(T a, T b) { return static_cast<T>(a & b); }
  static T bor(T a, T b) { return static_cast<T>(a | b); }
  static T bxor(T a, T b) { return static_cast<T>(a ^ b); }
};

// Floating point: MIN/MAX propagate NaN (like torch.minimum/maximum): the left operand wins when
// it is NaN, the right one when it is NaN and the left is not.
template <class T>
struct FloatOps {
  static T sum(T a, T b) { return a + b; }
  static T prod(T a, T b) { return a * b; }
  static T min(T a, T b) { return (a < b || a != a) ? a : b; }
  static T max(T a, T b) { return (a > b || a != a) ? a : b; }
};

// ---- loops --------------------------------------------------------------------------------------
// Three shapes, so that __restrict is always truthful: d = d OP s, d = s OP d, o = a OP b (o
// distinct from a and b; a and b may be the same array: both are only read).

template <class T, class F>
void loop_left(T* __restrict d, const T* __restrict s, std::size_t n, F f) {
  for (std::size_t i = 0; i < n; ++i) d[i] = f(d[i], s[i]);
}
template <class T, class F>
void loop_right(T* __restrict d, const T* __restrict s, std::size_t n, F f) {
  for (std::size_t i = 0; i < n; ++i) d[i] = f(s[i], d[i]);
}
template <class T, class F>
void loop3(T* __restrict o, const T* __restrict a, const T* __restrict b, std::size_t n, F f) {
  for (std::size_t i = 0; i < n; ++i) o[i] = f(a[i], b[i]);
}

template <class T, class F>
void apply(void* out, const void* a, const void* b, std::size_t n, F f) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  if (o == x && o == y) {
    // out = out OP out: one array, read and written element by element.
    for (std::size_t i = 0; i < n; ++i) o[i] = f(o[i], o[i]);
  } else if (o == x) {
    loop_left(o, y, n, f);
  } else if (o == y) {
    loop_right(o, x, n, f);
  } else {
    loop3(o, x, y, n, f);
  }
}

std::uint16_t h_from(float f) { return half::float_to_half(f); }
float h_to(std::uint16_t h) { return half::half_to_float(h); }
std::uint16_t bf_from(float f) { return half::float_to_bfloat16(f); }
float bf_to(std::uint16_t h) { return half::bfloat16_to_float(h); }

template <class T>
void reduce_int(void* o, const void* a, const void* b, std::size_t n, ReduceOp op) {
  using K = IntOps<T>;
  switch (op) {
    case ReduceOp::kSum: return apply<T>(o, a, b, n, [](T x, T y) { return K::sum(x, y); });
    case ReduceOp::kProduct: return apply<T>(o, a, b, n, [](T x, T y) { return K::prod(x, y); });
    case ReduceOp::kMin: return apply<T>(o, a, b, n, [](T x, T y) { return K::min(x, y); });
    case ReduceOp::kMax: return apply<T>(o, a, b, n, [](T x, T y) { return K::max(x, y); });
    case ReduceOp::kBand: return apply<T>(o, a, b, n, [](T x, T y) { return K::band(x, y); });
    case ReduceOp::kBor: return apply<T>(o, a, b, n, [](T x, T y) { return K::bor(x, y); });
    case ReduceOp::kBxor: return apply<T>(o, a, b, n, [](T x, T y) { return K::bxor(x, y); });
  }
}

template <class T>
void reduce_float(void* o, const void* a, const void* b, std::size_t n, ReduceOp op) {
  using K = FloatOps<T>;
  switch (op) {
    case ReduceOp::kSum: return apply<T>(o, a, b, n, [](T x, T y) { return K::sum(x, y); });
    case ReduceOp::kProduct: return apply<T>(o, a, b, n, [](T x, T y) { return K::prod(x, y); });
    case ReduceOp::kMin: return apply<T>(o, a, b, n, [](T x, T y) { return K::min(x, y); });
    case ReduceOp::kMax: return apply<T>(o, a, b, n, [](T x, T y) { return K::max(x, y); });
    default: break;  // rejected by check_reduction
  }
}

template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
void reduce_half(void* o, const void* a, const void* b, std::size_t n, ReduceOp op) {
  using H = std::uint16_t;
  using K = FloatOps<float>;
  switch (op) {
    case ReduceOp::kSum:
      return apply<H>(o, a, b, n, [](H x, H y) { return FromF(K::sum(ToF(x), ToF(y))); });
    case ReduceOp::kProduct:
      return apply<H>(o, a, b, n, [](H x, H y) { return FromF(K::prod(ToF(x), ToF(y))); });
    case ReduceOp::kMin:
      // The result is one of the operands: keep its bits (NaN payloads included).
      return apply<H>(o, a, b, n, [](H x, H y) {
        const float fx = ToF(x), fy = ToF(y);
        return (fx < fy || fx != fx) ? x : y;
      });
    case ReduceOp::kMax:
      return apply<H>(o, a, b, n, [](H x, H y) {
        const float fx = ToF(x), fy = ToF(y);
        return (fx > fy || fx != fx) ? x : y;
      });
    default: break;
  }
}

void reduce_bool(void* o, const void* a, const void* b, std::size_t n, ReduceOp op) {
  using B = std::uint8_t;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      return apply<B>(o, a, b, n, [](B x, B y) { return static_cast<B>((x | y) != 0); });
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return apply<B>(o, a, b, n, [](B x, B y) { return static_cast<B>((x != 0) & (y != 0)); });
    case ReduceOp::kBxor:
      return apply<B>(o, a, b, n, [](B x, B y) { return static_cast<B>((x != 0) ^ (y != 0)); });
  }
}

// Complex numbers as interleaved (re, im) pairs. SUM is a real SUM over 2n values; PRODUCT uses
// the textbook formula (like c10::complex), without C99 Annex G's inf/NaN recovery.
template <class R>
void reduce_complex(void* o, const void* a, const void* b, std::size_t n, ReduceOp op) {
  if (op == ReduceOp::kSum) return apply<R>(o, a, b, 2 * n, [](R x, R y) { return x + y; });
  if (op != ReduceOp::kProduct) return;
  using C = std::complex<R>;
  apply<C>(o, a, b, n, [](C x, C y) {
    return C(x.real() * y.real() - x.imag() * y.imag(), x.real() * y.imag() + x.imag() * y.real());
  });
}

void dispatch(void* o, const void* a, const void* b, std::size_t n, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::kFloat32: return reduce_float<float>(o, a, b, n, op);
    case DataType::kFloat64: return reduce_float<double>(o, a, b, n, op);
    case DataType::kFloat16: return reduce_half<h_to, h_from>(o, a, b, n, op);
    case DataType::kBFloat16: return reduce_half<bf_to, bf_from>(o, a, b, n, op);
    case DataType::kInt8: return reduce_int<std::int8_t>(o, a, b, n, op);
    case DataType::kInt16: return reduce_int<std::int16_t>(o, a, b, n, op);
    case DataType::kInt32: return reduce_int<std::int32_t>(o, a, b, n, op);
    case DataType::kInt64: return reduce_int<std::int64_t>(o, a, b, n, op);
    case DataType::kUInt8: return reduce_int<std::uint8_t>(o, a, b, n, op);
    case DataType::kBool: return reduce_bool(o, a, b, n, op);
    case DataType::kComplex64: return reduce_complex<float>(o, a, b, n, op);
    case DataType::kComplex128: return reduce_complex<double>(o, a, b, n, op);
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, std::size_t count, DataType t, ReduceOp op) {
  check_reduction("reduce_into", t, op);
  if (count == 0) return;
  dispatch(dst, dst, src, count, t, op);
}

void reduce_into(void* out, const void* a, const void* b, std::size_t count, DataType t,
                 ReduceOp op) {
  check_reduction("reduce_into", t, op);
  if (count == 0) return;
  dispatch(out, a, b, count, t, op);
}

namespace {

template <class T>
void scale_real(T* __restrict p, std::size_t n, double f) {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<double>(p[i]) * f);
}

template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
void scale_half(std::uint16_t* __restrict p, std::size_t n, double f) {
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = FromF(static_cast<float>(static_cast<double>(ToF(p[i])) * f));
  }
}

}  // namespace

void scale(void* buf, std::size_t count, DataType t, double factor) {
  if (!known_dtype(t)) {
    throw Error(Errc::kInvalidArgument,
                "commux scale: unknown DataType " + std::to_string(static_cast<int>(t)));
  }
  if (!is_floating(t) && !is_complex(t)) {
    throw Error(Errc::kInvalidArgument, std::string("commux scale: ") + dtype_name(t) +
                                            " cannot be scaled (floating and complex types only)");
  }
  if (count == 0) return;
  switch (t) {
    case DataType::kFloat32: return scale_real(static_cast<float*>(buf), count, factor);
    case DataType::kFloat64: return scale_real(static_cast<double*>(buf), count, factor);
    case DataType::kComplex64: return scale_real(static_cast<float*>(buf), 2 * count, factor);
    case DataType::kComplex128: return scale_real(static_cast<double*>(buf), 2 * count, factor);
    case DataType::kFloat16:
      return scale_half<h_to, h_from>(static_cast<std::uint16_t*>(buf), count, factor);
    case DataType::kBFloat16:
      return scale_half<bf_to, bf_from>(static_cast<std::uint16_t*>(buf), count, factor);
    default: break;
  }
}

}  // namespace commux
