// The reduction kernels (src/collectives/reduce_kernels.cpp) against straightforward references:
// every DataType x ReduceOp that is defined, both overloads and all aliasing shapes, float16 and
// bfloat16 rounding (to nearest even, checked against a double-precision reference and
// exhaustively for the conversions), bool semantics, integer wrap-around, complex arithmetic,
// scale(), and check_reduction's rejections.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "commux/collectives.hpp"

using namespace commux;

namespace {

const std::vector<DataType> kAllTypes = {
    DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,   DataType::kBFloat16,
    DataType::kInt8,    DataType::kInt16,   DataType::kInt32,     DataType::kInt64,
    DataType::kUInt8,   DataType::kBool,    DataType::kComplex64, DataType::kComplex128};
const std::vector<ReduceOp> kAllOps = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin,
                                       ReduceOp::kMax, ReduceOp::kBand,    ReduceOp::kBor,
                                       ReduceOp::kBxor};

bool defined(DataType t, ReduceOp op) {
  const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  const bool ordered = op == ReduceOp::kMin || op == ReduceOp::kMax;
  if (t == DataType::kComplex64 || t == DataType::kComplex128) return !bitwise && !ordered;
  if (t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
      t == DataType::kBFloat16) {
    return !bitwise;
  }
  return true;
}

// ---- reference float16 / bfloat16 (decoding by ldexp, rounding with nearbyint in double) -------

double ref_half_to_double(std::uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  double v;
  if (exp == 0) {
    v = std::ldexp(man, -24);
  } else if (exp == 31) {
    v = man == 0 ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(1024 + man, exp - 25);
  }
  return sign ? -v : v;
}

double ref_bf16_to_double(std::uint16_t h) {
  const int sign = h >> 15, exp = (h >> 7) & 0xFF, man = h & 0x7F;
  double v;
  if (exp == 0) {
    v = std::ldexp(man, -133);
  } else if (exp == 255) {
    v = man == 0 ? std::numeric_limits<double>::infinity()
                 : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(128 + man, exp - 134);
  }
  return sign ? -v : v;
}

// Rounds x to a binary format with `mant` explicit mantissa bits, minimum normal exponent
// `emin`, and largest finite value `maxv`; returns the rounded value as a double (inf on
// overflow). Ties go to even (nearbyint in the default rounding mode).
double ref_round(double x, int mant, int emin, double maxv) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  const double a = std::fabs(x);
  int e = std::ilogb(a);
  if (e < emin) e = emin;
  const double ulp = std::ldexp(1.0, e - mant);
  double q = std::nearbyint(a / ulp) * ulp;  // a / ulp is exact (power-of-two scaling)
  if (q > maxv) q = std::numeric_limits<double>::infinity();
  return x < 0 ? -q : q;
}

double ref_round_half(double x) { return ref_round(x, 10, -14, 65504.0); }
double ref_round_bf16(double x) {
  return ref_round(x, 7, -126, std::ldexp(255.0, 120));  // (2 - 2^-7) * 2^127
}

// Finds the encoding of a value that is exactly representable (reference rounding output), by a
// table of all 65536 decodings.
std::uint16_t ref_encode(double v, double (*decode)(std::uint16_t)) {
  static std::map<double (*)(std::uint16_t), std::unordered_map<std::uint64_t, std::uint16_t>>
      tables;
  static std::map<double (*)(std::uint16_t), std::uint16_t> nans;
  auto& table = tables[decode];
  if (table.empty()) {
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const double d = decode(static_cast<std::uint16_t>(h));
      if (std::isnan(d)) {
        nans[decode] = static_cast<std::uint16_t>(h);
        continue;
      }
      std::uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      table.emplace(bits, static_cast<std::uint16_t>(h));
    }
  }
  if (std::isnan(v)) return nans[decode];  // callers compare NaNs as NaNs, never by bits
  std::uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const auto it = table.find(bits);
  if (it == table.end()) {
    ADD_FAILURE() << "no encoding for " << v;
    return 0;
  }
  return it->second;
}

// ---- reference reductions, one element at a time, on doubles / 64-bit integers --------------

template <class T>
T wrap(std::int64_t v) {
  return static_cast<T>(static_cast<std::uint64_t>(v));  // modular, like torch
}

template <class T>
T ref_int(T a, T b, ReduceOp op) {
  const auto x = static_cast<std::int64_t>(a), y = static_cast<std::int64_t>(b);
  switch (op) {
    case ReduceOp::kSum:
      return wrap<T>(
          static_cast<std::int64_t>(static_cast<std::uint64_t>(x) + static_cast<std::uint64_t>(y)));
    case ReduceOp::kProduct:
      return wrap<T>(
          static_cast<std::int64_t>(static_cast<std::uint64_t>(x) * static_cast<std::uint64_t>(y)));
    case ReduceOp::kMin: return a < b ? a : b;
    case ReduceOp::kMax: return a > b ? a : b;
    case ReduceOp::kBand: return static_cast<T>(a & b);
    case ReduceOp::kBor: return static_cast<T>(a | b);
    case ReduceOp::kBxor: return static_cast<T>(a ^ b);
  }
  return 0;
}

template <class T>
T ref_float(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return std::isnan(a) ? a : std::isnan(b) ? b : std::fmin(a, b);
    case ReduceOp::kMax: return std::isnan(a) ? a : std::isnan(b) ? b : std::fmax(a, b);
    default: return 0;
  }
}

// ---- typed random data ---------------------------------------------------------------------

std::mt19937_64 rng(12345);

template <class T>
std::vector<T> random_ints(std::size_t n) {
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(rng());
  // Make sure extremes are present: overflow in both directions.
  if (n >= 4) {
    v[0] = std::numeric_limits<T>::max();
    v[1] = std::numeric_limits<T>::min();
    v[2] = std::numeric_limits<T>::max();
    v[3] = static_cast<T>(-1);
  }
  return v;
}

template <class T>
std::vector<T> random_reals(std::size_t n) {
  std::uniform_real_distribution<double> d(-100.0, 100.0);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(rng));
  if (n >= 4) {
    v[0] = std::numeric_limits<T>::quiet_NaN();
    v[1] = std::numeric_limits<T>::infinity();
    v[2] = static_cast<T>(-0.0);
    v[3] = static_cast<T>(0.0);
  }
  return v;
}

std::vector<std::uint16_t> random_16(std::size_t n) {
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = static_cast<std::uint16_t>(rng());
  return v;
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
bool same_value(T a, T b) {  // floats: NaN equals NaN, zero signs must agree
  if (a != a && b != b) return true;
  return a == b && std::signbit(a) == std::signbit(b);
}

// Runs both overloads and all aliasing shapes; `ref(a, b)` gives the expected element.
template <class T, class Ref, class Eq>
void check_all_shapes(DataType t, ReduceOp op, const std::vector<T>& a, const std::vector<T>& b,
                      Ref ref, Eq eq) {
  const std::size_t n = a.size();
  std::vector<T> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = ref(a[i], b[i]);
  const std::string what = std::string(dtype_name(t)) + " " + reduce_op_name(op);
  auto expect = [&](const std::vector<T>& got, const char* shape) {
    for (std::size_t i = 0; i < n; ++i) {
      if (!eq(got[i], want[i])) {
        ADD_FAILURE() << what << " (" << shape << ") element " << i << " differs";
        return;
      }
    }
  };
  {  // dst = dst OP src
    std::vector<T> d = a;
    reduce_into(d.data(), b.data(), n, t, op);
    expect(d, "dst OP= src");
  }
  {  // out = a OP b, out distinct
    std::vector<T> o(n);
    reduce_into(o.data(), a.data(), b.data(), n, t, op);
    expect(o, "out = a OP b");
  }
  {  // out aliases a
    std::vector<T> o = a;
    reduce_into(o.data(), o.data(), b.data(), n, t, op);
    expect(o, "out == a");
  }
  {  // out aliases b (the left operand stays a)
    std::vector<T> o = b;
    reduce_into(o.data(), a.data(), o.data(), n, t, op);
    expect(o, "out == b");
  }
}

constexpr std::size_t kN = 1031;  // odd, not a multiple of any vector width

template <class T>
void check_int_type(DataType t) {
  const auto a = random_ints<T>(kN), b = random_ints<T>(kN);
  for (ReduceOp op : kAllOps) {
    check_all_shapes<T>(
        t, op, a, b, [op](T x, T y) { return ref_int<T>(x, y, op); },
        [](T x, T y) { return x == y; });
  }
}

template <class T>
void check_float_type(DataType t) {
  const auto a = random_reals<T>(kN), b = random_reals<T>(kN);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
    check_all_shapes<T>(
        t, op, a, b, [op](T x, T y) { return ref_float<T>(x, y, op); },
        [op](T x, T y) {
          // MIN/MAX of +0/-0 may return either zero.
          if ((op == ReduceOp::kMin || op == ReduceOp::kMax) && x == 0 && y == 0) return true;
          return same_value(x, y);
        });
  }
}

template <double (*Decode)(std::uint16_t), double (*Round)(double)>
void check_16bit_type(DataType t) {
  auto a = random_16(kN), b = random_16(kN);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
    check_all_shapes<std::uint16_t>(
        t, op, a, b,
        [op](std::uint16_t x, std::uint16_t y) {
          // torch: compute in float, round to the 16-bit type (to nearest even).
          const float fx = static_cast<float>(Decode(x)), fy = static_cast<float>(Decode(y));
          const double r = static_cast<double>(ref_float<float>(fx, fy, op));
          return ref_encode(std::isnan(r) ? std::numeric_limits<double>::quiet_NaN() : Round(r),
                            Decode);
        },
        [op](std::uint16_t x, std::uint16_t y) {
          const double dx = Decode(x), dy = Decode(y);
          if (std::isnan(dx) || std::isnan(dy)) return std::isnan(dx) && std::isnan(dy);
          if ((op == ReduceOp::kMin || op == ReduceOp::kMax) && dx == 0 && dy == 0) return true;
          return x == y;
        });
  }
}

}  // namespace

TEST(Kernels, NamesAndSizes) {
  EXPECT_EQ(dtype_size(DataType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DataType::kFloat64), 8u);
  EXPECT_EQ(dtype_size(DataType::kFloat16), 2u);
  EXPECT_EQ(dtype_size(DataType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DataType::kInt8), 1u);
  EXPECT_EQ(dtype_size(DataType::kInt16), 2u);
  EXPECT_EQ(dtype_size(DataType::kInt32), 4u);
  EXPECT_EQ(dtype_size(DataType::kInt64), 8u);
  EXPECT_EQ(dtype_size(DataType::kUInt8), 1u);
  EXPECT_EQ(dtype_size(DataType::kBool), 1u);
  EXPECT_EQ(dtype_size(DataType::kComplex64), 8u);
  EXPECT_EQ(dtype_size(DataType::kComplex128), 16u);
  EXPECT_STREQ(dtype_name(DataType::kBFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DataType::kComplex64), "complex64");
  EXPECT_STREQ(reduce_op_name(ReduceOp::kProduct), "PRODUCT");
  EXPECT_STREQ(reduce_op_name(ReduceOp::kBxor), "BXOR");
  int floating = 0, complex = 0;
  for (DataType t : kAllTypes) {
    floating += is_floating(t);
    complex += is_complex(t);
  }
  EXPECT_EQ(floating, 4);
  EXPECT_EQ(complex, 2);
}

TEST(Kernels, CheckReductionAcceptsExactlyTheDefinedPairs) {
  for (DataType t : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      if (defined(t, op)) {
        EXPECT_NO_THROW(check_reduction("allreduce", t, op))
            << dtype_name(t) << " " << reduce_op_name(op);
        continue;
      }
      try {
        check_reduction("allreduce", t, op);
        ADD_FAILURE() << dtype_name(t) << " " << reduce_op_name(op) << " was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Errc::kInvalidArgument);
        const std::string msg = e.what();
        EXPECT_EQ(msg.rfind("commux allreduce: ReduceOp ", 0), 0u) << msg;
        EXPECT_NE(msg.find(reduce_op_name(op)), std::string::npos) << msg;
        EXPECT_NE(msg.find(dtype_name(t)), std::string::npos) << msg;
      }
    }
  }
  // The examples the header names, and the kernels refuse the same pairs.
  EXPECT_THROW(check_reduction("x", DataType::kComplex64, ReduceOp::kMin), Error);
  EXPECT_THROW(check_reduction("x", DataType::kFloat32, ReduceOp::kBand), Error);
  EXPECT_THROW(check_reduction("x", DataType::kComplex128, ReduceOp::kBxor), Error);
  EXPECT_THROW(check_reduction("x", DataType::kBFloat16, ReduceOp::kBor), Error);
  EXPECT_THROW(check_reduction("x", static_cast<DataType>(99), ReduceOp::kSum), Error);
  EXPECT_THROW(check_reduction("x", DataType::kInt32, static_cast<ReduceOp>(42)), Error);
  float f = 1;
  EXPECT_THROW(reduce_into(&f, &f, 1, DataType::kFloat32, ReduceOp::kBxor), Error);
}

TEST(Kernels, Integers) {
  check_int_type<std::int8_t>(DataType::kInt8);
  check_int_type<std::int16_t>(DataType::kInt16);
  check_int_type<std::int32_t>(DataType::kInt32);
  check_int_type<std::int64_t>(DataType::kInt64);
  check_int_type<std::uint8_t>(DataType::kUInt8);
}

TEST(Kernels, IntegerWrapAround) {
  std::int32_t a[3] = {INT32_MAX, INT32_MIN, 46341};
  const std::int32_t b[3] = {1, -1, 46341};
  reduce_into(a, b, 2, DataType::kInt32, ReduceOp::kSum);
  EXPECT_EQ(a[0], INT32_MIN);
  EXPECT_EQ(a[1], INT32_MAX);
  reduce_into(a + 2, b + 2, 1, DataType::kInt32, ReduceOp::kProduct);
  EXPECT_EQ(a[2], static_cast<std::int32_t>(46341u * 46341u));  // 2147488281 wraps negative
  EXPECT_LT(a[2], 0);
  std::uint8_t u[2] = {250, 16};
  const std::uint8_t v[2] = {10, 16};
  reduce_into(u, v, 1, DataType::kUInt8, ReduceOp::kSum);
  reduce_into(u + 1, v + 1, 1, DataType::kUInt8, ReduceOp::kProduct);
  EXPECT_EQ(u[0], 4);
  EXPECT_EQ(u[1], 0);
  std::int16_t s = -32768;
  const std::int16_t m = -1;
  reduce_into(&s, &m, 1, DataType::kInt16, ReduceOp::kProduct);  // 32768 wraps to -32768
  EXPECT_EQ(s, -32768);
  std::int64_t l = INT64_MAX;
  const std::int64_t two = 2;
  reduce_into(&l, &two, 1, DataType::kInt64, ReduceOp::kProduct);
  EXPECT_EQ(l, -2);
}

TEST(Kernels, Floats) {
  check_float_type<float>(DataType::kFloat32);
  check_float_type<double>(DataType::kFloat64);
}

TEST(Kernels, MinMaxPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float a[2] = {nan, 1.0f};
  const float b[2] = {1.0f, nan};
  float c[2] = {a[0], a[1]};
  reduce_into(c, b, 2, DataType::kFloat32, ReduceOp::kMin);
  EXPECT_TRUE(std::isnan(c[0]));
  EXPECT_TRUE(std::isnan(c[1]));
  reduce_into(a, b, 2, DataType::kFloat32, ReduceOp::kMax);
  EXPECT_TRUE(std::isnan(a[0]));
  EXPECT_TRUE(std::isnan(a[1]));
}

TEST(Kernels, Float16ConversionsExhaustive) {
  // half -> float is exact for all 65536 encodings (checked through reduce: x * 1 = x, and
  // min(x, x) keeps the bits), and float -> half rounds to nearest even at every midpoint.
  std::vector<std::uint16_t> all(65536), one(65536, 0x3C00);  // 1.0
  for (std::uint32_t h = 0; h < 65536; ++h) all[h] = static_cast<std::uint16_t>(h);
  std::vector<std::uint16_t> p = all;
  reduce_into(p.data(), one.data(), p.size(), DataType::kFloat16, ReduceOp::kProduct);
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const double v = ref_half_to_double(static_cast<std::uint16_t>(h));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(ref_half_to_double(p[h]))) << h;
    } else {
      ASSERT_EQ(p[h], h) << "half " << h << " * 1 changed";
    }
  }
  // Midpoints between consecutive positive finite halves: a + 0 where a is not representable is
  // impossible, so build midpoints as sums of two halves whose float sum is exact: x and ulp/2.
  int ties = 0;
  for (std::uint32_t h = 0x0001; h < 0x7BFF; h += 7) {
    const double lo = ref_half_to_double(static_cast<std::uint16_t>(h));
    const double hi = ref_half_to_double(static_cast<std::uint16_t>(h + 1));
    const double half_ulp = (hi - lo) / 2;
    // half_ulp is a power of two >= 2^-25: representable in half only from 2^-24 up.
    if (half_ulp < std::ldexp(1.0, -24)) continue;
    const std::uint16_t a = static_cast<std::uint16_t>(h);
    const std::uint16_t b = ref_encode(half_ulp, ref_half_to_double);
    std::uint16_t out;
    reduce_into(&out, &a, &b, 1, DataType::kFloat16, ReduceOp::kSum);
    const std::uint16_t even =
        (h % 2 == 0) ? static_cast<std::uint16_t>(h) : static_cast<std::uint16_t>(h + 1);
    ASSERT_EQ(out, even) << "tie at " << h;
    ++ties;
  }
  EXPECT_GT(ties, 1000);
  // Overflow to infinity at the midpoint 65520, not below.
  const std::uint16_t max_half = 0x7BFF, sixteen = 0x4C00, eight = 0x4800;  // 65504, 16, 8
  std::uint16_t out;
  reduce_into(&out, &max_half, &sixteen, 1, DataType::kFloat16, ReduceOp::kSum);  // 65520 -> inf
  EXPECT_EQ(out, 0x7C00);
  reduce_into(&out, &max_half, &eight, 1, DataType::kFloat16, ReduceOp::kSum);  // 65512 -> 65504
  EXPECT_EQ(out, 0x7BFF);
}

TEST(Kernels, Float16AndBFloat16Arithmetic) {
  check_16bit_type<ref_half_to_double, ref_round_half>(DataType::kFloat16);
  check_16bit_type<ref_bf16_to_double, ref_round_bf16>(DataType::kBFloat16);
}

TEST(Kernels, BFloat16RoundsToNearestEven) {
  // 1 + 2^-8 is the midpoint between 1 and 1 + 2^-7: ties to even (1). 1 + 3*2^-8 -> 1 + 2^-6.
  const std::uint16_t one = 0x3F80;
  const std::uint16_t e8 = ref_encode(std::ldexp(1.0, -8), ref_bf16_to_double);
  std::uint16_t out;
  reduce_into(&out, &one, &e8, 1, DataType::kBFloat16, ReduceOp::kSum);
  EXPECT_EQ(out, 0x3F80);
  const std::uint16_t onep = 0x3F81;  // 1 + 2^-7
  reduce_into(&out, &onep, &e8, 1, DataType::kBFloat16, ReduceOp::kSum);
  EXPECT_EQ(out, 0x3F82);  // 1 + 2^-7 + 2^-8 is a tie: rounds to the even 1 + 2^-6
}

TEST(Kernels, Bool) {
  // Any non-zero byte is true; results are 0 or 1.
  const std::uint8_t a[4] = {0, 0, 7, 1};
  const std::uint8_t b[4] = {0, 2, 0, 255};
  struct Case {
    ReduceOp op;
    std::uint8_t want[4];
  };
  const Case cases[] = {
      {ReduceOp::kSum, {0, 1, 1, 1}},  {ReduceOp::kMax, {0, 1, 1, 1}},
      {ReduceOp::kBor, {0, 1, 1, 1}},  {ReduceOp::kProduct, {0, 0, 0, 1}},
      {ReduceOp::kMin, {0, 0, 0, 1}},  {ReduceOp::kBand, {0, 0, 0, 1}},
      {ReduceOp::kBxor, {0, 1, 1, 0}},
  };
  for (const Case& c : cases) {
    std::uint8_t out[4];
    reduce_into(out, a, b, 4, DataType::kBool, c.op);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], c.want[i]) << reduce_op_name(c.op) << " " << i;
    std::uint8_t d[4] = {a[0], a[1], a[2], a[3]};
    reduce_into(d, b, 4, DataType::kBool, c.op);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(d[i], c.want[i]) << reduce_op_name(c.op) << " " << i;
  }
}

TEST(Kernels, Complex) {
  std::uniform_int_distribution<int> d(-50, 50);
  std::vector<std::complex<float>> a(kN), b(kN);
  std::vector<std::complex<double>> x(kN), y(kN);
  for (std::size_t i = 0; i < kN; ++i) {
    a[i] = {static_cast<float>(d(rng)), static_cast<float>(d(rng))};
    b[i] = {static_cast<float>(d(rng)), static_cast<float>(d(rng))};
    x[i] = {d(rng) * 0.5, d(rng) * 0.25};
    y[i] = {d(rng) * 0.125, d(rng) * 1.0};
  }
  // Small integer / dyadic parts: every product and sum is exact, so compare exactly.
  check_all_shapes<std::complex<float>>(
      DataType::kComplex64, ReduceOp::kSum, a, b, [](auto p, auto q) { return p + q; },
      [](auto p, auto q) { return p == q; });
  check_all_shapes<std::complex<float>>(
      DataType::kComplex64, ReduceOp::kProduct, a, b, [](auto p, auto q) { return p * q; },
      [](auto p, auto q) { return p == q; });
  check_all_shapes<std::complex<double>>(
      DataType::kComplex128, ReduceOp::kSum, x, y, [](auto p, auto q) { return p + q; },
      [](auto p, auto q) { return p == q; });
  check_all_shapes<std::complex<double>>(
      DataType::kComplex128, ReduceOp::kProduct, x, y, [](auto p, auto q) { return p * q; },
      [](auto p, auto q) { return p == q; });
  const std::complex<float> i1(0, 1);
  std::complex<float> z(0, 1);
  reduce_into(&z, &i1, 1, DataType::kComplex64, ReduceOp::kProduct);
  EXPECT_EQ(z, std::complex<float>(-1, 0));
}

// Runs fn(dst, a, b) on three guard-filled buffers of 64 bytes each and returns "" or which
// buffer fn changed, at which byte.
std::string guards_changed_by(const std::function<void(void*, void*, void*)>& fn) {
  constexpr std::size_t kBytes = 64;
  std::vector<unsigned char> buf[3];
  for (int k = 0; k < 3; ++k) buf[k].assign(kBytes, static_cast<unsigned char>(0xA5 + k));
  const auto before = buf[0], before_a = buf[1], before_b = buf[2];
  fn(buf[0].data(), buf[1].data(), buf[2].data());
  const char* names[3] = {"dst", "a", "b"};
  const std::vector<unsigned char>* was[3] = {&before, &before_a, &before_b};
  for (int k = 0; k < 3; ++k) {
    for (std::size_t i = 0; i < kBytes; ++i) {
      if (buf[k][i] != (*was[k])[i])
        return std::string(names[k]) + " byte " + std::to_string(i) + " written";
    }
  }
  return "";
}

// A zero-count reduction writes nothing: not the output, not the inputs (both overloads,
// including the aliased forms).
TEST(Kernels, ZeroCountTouchesNothing) {
  for (DataType t : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      if (!defined(t, op)) continue;
      const std::string what = std::string(dtype_name(t)) + " " + reduce_op_name(op);
      EXPECT_EQ(guards_changed_by([&](void* d, void* a, void*) { reduce_into(d, a, 0, t, op); }),
                "")
          << what;
      EXPECT_EQ(
          guards_changed_by([&](void* d, void* a, void* b) { reduce_into(d, a, b, 0, t, op); }), "")
          << what;
      EXPECT_EQ(guards_changed_by([&](void* d, void*, void* b) { reduce_into(d, d, b, 0, t, op); }),
                "")
          << what;
      if (is_floating(t) || is_complex(t)) {
        EXPECT_EQ(guards_changed_by([&](void* d, void*, void*) { scale(d, 0, t, 3.0); }), "")
            << what << " scale";
      }
    }
  }
}

// The guard check above can fail: a one-element reduction does write the output.
TEST(Kernels, GuardCheckSeesAWrite) {
  EXPECT_EQ(guards_changed_by([](void* d, void* a, void*) {
              reduce_into(d, a, 1, DataType::kInt32, ReduceOp::kSum);
            }),
            "dst byte 0 written");
}

TEST(Kernels, Scale) {
  std::vector<float> f = {3.0f, -6.0f, 1.5f};
  scale(f.data(), f.size(), DataType::kFloat32, 1.0 / 3.0);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 0.5f);
  std::vector<double> d = {10.0, 7.0};
  scale(d.data(), d.size(), DataType::kFloat64, 0.5);
  EXPECT_EQ(d[0], 5.0);
  EXPECT_EQ(d[1], 3.5);
  std::vector<std::complex<double>> c = {{2.0, -4.0}};
  scale(c.data(), c.size(), DataType::kComplex128, 0.25);
  EXPECT_EQ(c[0], std::complex<double>(0.5, -1.0));
  std::vector<std::complex<float>> cf = {{8.0f, 2.0f}};
  scale(cf.data(), cf.size(), DataType::kComplex64, 0.5);
  EXPECT_EQ(cf[0], std::complex<float>(4.0f, 1.0f));
  // float16: 3 / 3 -> 1; 1 * 1/3 rounds to the nearest half (0x3555).
  std::uint16_t h[2] = {0x4200, 0x3C00};  // 3.0, 1.0
  scale(h, 2, DataType::kFloat16, 1.0 / 3.0);
  EXPECT_EQ(h[0], 0x3C00);
  EXPECT_EQ(h[1], ref_encode(ref_round_half(1.0 / 3.0), ref_half_to_double));
  std::uint16_t bf = 0x4040;  // 3.0
  scale(&bf, 1, DataType::kBFloat16, 2.0);
  EXPECT_EQ(bf, 0x40C0);  // 6.0
  std::int32_t i = 4;
  try {
    scale(&i, 1, DataType::kInt32, 0.5);
    ADD_FAILURE() << "integer scale accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()).rfind("commux scale:", 0), 0u);
  }
  EXPECT_THROW(scale(&i, 1, DataType::kBool, 0.5), Error);
}

TEST(Kernels, LargeFloatSumMatchesScalarLoop) {
  // The vectorized path (long arrays, unaligned start) against a plain loop.
  const std::size_t n = (1u << 20) + 3;
  std::vector<float> a(n + 1), b(n + 1);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i % 1000) * 0.5f;
    b[i] = static_cast<float>((i * 7) % 999) - 400.0f;
  }
  std::vector<float> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = a[i + 1] + b[i + 1];
  reduce_into(a.data() + 1, b.data() + 1, n, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(std::memcmp(a.data() + 1, want.data(), n * sizeof(float)), 0);
}
