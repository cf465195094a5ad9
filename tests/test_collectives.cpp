// The collectives (include/commux/collectives.hpp) end to end.
//
// Worlds of 1, 2, 3, 4, 5 and 8 ranks run as threads of this one process (one Communicator per
// thread over a shared FileStore in a fresh directory) and go through every collective with
// counts 0, 1, 7, counts not divisible by the world size and, for a couple of sizes, a large one
// (1M floats), roots other than 0, uneven allgatherv / reduce_scatter / alltoallv counts with
// zeros. Inputs are integer-valued floats, so sums are exact and compared exactly; results that
// depend on the order of float additions are compared bitwise across ranks.
//
// Forked processes (tests/harness.hpp) cover what threads cannot: a rank that never joins an
// allreduce (the others time out, or see it fail when it exits, with "commux allreduce" in the
// message), and alltoallv splits that disagree (both ranks fail, naming the peer).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <complex>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "commux/collectives.hpp"
#include "harness.hpp"
#include "world.hpp"

using namespace commux;
using namespace commux::test;
using Clock = std::chrono::steady_clock;

namespace {

// ---- a world of ranks as threads ------------------------------------------------------------

// Results that must be bitwise identical on every rank, keyed by a name, collected across threads.
class Snapshots {
 public:
  explicit Snapshots(int n) : n_(n) {}
  void put(const std::string& key, int rank, const void* data, std::size_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    auto& v = map_[key];
    v.resize(static_cast<std::size_t>(n_));
    const auto* p = static_cast<const unsigned char*>(data);
    v[static_cast<std::size_t>(rank)].assign(p, p + bytes);
  }
  void check() const {
    for (const auto& [key, v] : map_) {
      for (std::size_t r = 1; r < v.size(); ++r) {
        EXPECT_EQ(v[r], v[0]) << key << ": rank " << r << " differs from rank 0";
      }
    }
  }
  std::size_t size() const { return map_.size(); }

 private:
  int n_;
  std::mutex mu_;
  std::map<std::string, std::vector<std::vector<unsigned char>>> map_;
};

struct Rank {
  Communicator& comm;
  Snapshots& snaps;
  MemoryType mem = MemoryType::kHost;
  std::uint32_t next_tag = 1;
  // Context::algorithm per op name passed to ctx() ("allgatherv" counts as "allgather"), and a
  // prefix for snapshot keys (which algorithm produced them).
  std::map<std::string, std::string> forced;
  std::string label;
  coll::DeviceOps* device = nullptr;  // Context::device
  int r() const { return comm.rank(); }
  int n() const { return comm.size(); }
  coll::Context ctx(const char* op) {
    coll::Context c;
    c.comm = &comm;
    c.tag = next_tag++;
    c.deadline = Clock::now() + std::chrono::seconds(30);
    c.op_name = op;
    c.mem = mem;
    c.device = device;
    std::string key = op;
    if (key == "allgatherv") key = "allgather";
    if (key == "alltoallv") key = "alltoall";
    const auto it = forced.find(key);
    if (it != forced.end()) c.algorithm = it->second.c_str();
    return c;
  }
  std::string key(const std::string& what) const { return label + what; }
};

// A DeviceOps over host memory that counts what the collectives ask of it and checks that every
// scratch buffer it hands out is released (Context::device's contract, without a GPU).
class CountingDeviceOps final : public coll::DeviceOps {
 public:
  ~CountingDeviceOps() override {
    if (expect_released) {
      EXPECT_EQ(live_.size(), 0u) << "device scratch never released";
    }
  }
  void* allocate(std::size_t bytes) override {
    auto p = std::make_unique<char[]>(std::max<std::size_t>(bytes, 1));
    void* raw = p.get();
    live_.emplace(raw, std::move(p));
    ++allocations;
    return raw;
  }
  void synchronize() override { ++syncs; }
  void release(void* p) noexcept override {
    if (live_.erase(p) != 1) ++bad_releases;
  }
  void reduce(void* out, const void* a, const void* b, std::size_t count, DataType t,
              ReduceOp op) override {
    ++reductions;
    reduce_into(out, a, b, count, t, op);
  }
  void copy(void* dst, MemoryType, const void* src, MemoryType, std::size_t bytes) override {
    ++copies;
    std::memmove(dst, src, bytes);
  }
  std::size_t live() const { return live_.size(); }
  std::size_t allocations = 0, reductions = 0, copies = 0, bad_releases = 0, syncs = 0;
  // False where a failed call parks its scratch on purpose (a request of it stays posted).
  bool expect_released = true;

 private:
  std::map<void*, std::unique_ptr<char[]>> live_;
};

void run_world(int n, const std::function<void(Rank&)>& body, MemoryType mem = MemoryType::kHost,
               bool device_ops = false) {
  const TempDir dir("commux-coll");
  auto store = dir.store();
  Snapshots snaps(n);
  const std::vector<std::string> errors = run_threads(n, [&](int r) {
    Communicator comm(store, r, n, default_test_options());
    CountingDeviceOps ops;
    Rank rank{comm, snaps, mem, 1, {}, {}, device_ops ? &ops : nullptr};
    body(rank);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r << " of " << n;
  }
  snaps.check();
}

// Integer-valued contribution of rank r to element i, in -5..5.
float val(int r, std::size_t i) {
  return static_cast<float>(static_cast<int>((static_cast<std::size_t>(r) * 7 + i * 3) % 11) - 5);
}

std::vector<float> contribution(int r, std::size_t count) {
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = val(r, i);
  return v;
}

template <class T>
void check_eq(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  CX_CHECK_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(got[i] == want[i])) {
      check_failed(__FILE__, __LINE__,
                   what + ": element " + std::to_string(i) + " is " +
                       std::to_string(static_cast<double>(got[i])) + ", expected " +
                       std::to_string(static_cast<double>(want[i])));
    }
  }
}

std::vector<unsigned char> bytes_of(int r, std::size_t n, std::uint64_t salt) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = pattern(static_cast<std::uint64_t>(r) * 1000 + salt, i);
  return v;
}

std::string tag(const char* what, std::size_t count, int root = -1) {
  return std::string(what) + " count " + std::to_string(count) +
         (root >= 0 ? " root " + std::to_string(root) : "");
}

std::vector<std::size_t> counts_for(int n, std::size_t base) {
  std::vector<std::size_t> c;
  for (std::size_t p = 0; p < static_cast<std::size_t>(n); ++p) c.push_back(base);
  return c;
}

// ---- the checks, per collective --------------------------------------------------------------

void check_barrier(Rank& k) {
  for (int i = 0; i < 3; ++i) coll::barrier(k.ctx("barrier"));
}

void check_broadcast(Rank& k, std::size_t bytes, int root) {
  std::vector<unsigned char> buf =
      k.r() == root ? bytes_of(root, bytes, 1) : std::vector<unsigned char>(bytes, 0xEE);
  coll::broadcast(k.ctx("broadcast"), buf.data(), bytes, root);
  if (buf != bytes_of(root, bytes, 1))
    check_failed(__FILE__, __LINE__, tag("broadcast", bytes, root) + ": wrong data");
}

void check_allreduce_sum(Rank& k, std::size_t count) {
  std::vector<float> buf = contribution(k.r(), count), want(count, 0.0f);
  for (int p = 0; p < k.n(); ++p) {
    for (std::size_t i = 0; i < count; ++i) want[i] += val(p, i);
  }
  coll::allreduce(k.ctx("allreduce"), buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
  check_eq(buf, want, tag("allreduce float32 SUM", count));
  k.snaps.put(k.key(tag("allreduce float32 SUM", count)), k.r(), buf.data(), count * sizeof(float));
}

// Float sums in an order-dependent way: the values differ but must be the same on all ranks.
void check_allreduce_identical(Rank& k, std::size_t count) {
  std::mt19937 g(static_cast<unsigned>(1000 + k.r()));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> buf(count);
  for (auto& x : buf) x = d(g) * 1e-3f + (static_cast<float>(k.r()) * 1e3f);
  coll::allreduce(k.ctx("allreduce"), buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
  k.snaps.put(k.key(tag("allreduce random float32 SUM", count)), k.r(), buf.data(),
              count * sizeof(float));
  std::vector<double> h(count);
  for (std::size_t i = 0; i < count; ++i) h[i] = d(g) * 1e10 + i;
  coll::allreduce(k.ctx("allreduce"), h.data(), count, DataType::kFloat64, ReduceOp::kProduct);
  k.snaps.put(k.key(tag("allreduce random float64 PRODUCT", count)), k.r(), h.data(),
              count * sizeof(double));
}

void check_allreduce_types(Rank& k, std::size_t count) {
  const int n = k.n(), r = k.r();
  {  // int32 MAX and MIN
    std::vector<std::int32_t> mx(count), mn(count), wmx(count, INT32_MIN), wmn(count, INT32_MAX);
    for (std::size_t i = 0; i < count; ++i) {
      mx[i] = mn[i] = static_cast<std::int32_t>((r * 31 + static_cast<int>(i) * 17) % 23) - 11;
      for (int p = 0; p < n; ++p) {
        const std::int32_t v =
            static_cast<std::int32_t>((p * 31 + static_cast<int>(i) * 17) % 23) - 11;
        wmx[i] = std::max(wmx[i], v);
        wmn[i] = std::min(wmn[i], v);
      }
    }
    coll::allreduce(k.ctx("allreduce"), mx.data(), count, DataType::kInt32, ReduceOp::kMax);
    coll::allreduce(k.ctx("allreduce"), mn.data(), count, DataType::kInt32, ReduceOp::kMin);
    check_eq(mx, wmx, tag("allreduce int32 MAX", count));
    check_eq(mn, wmn, tag("allreduce int32 MIN", count));
  }
  {  // int64 PRODUCT (wraps; the same on every rank) and BXOR
    std::vector<std::int64_t> pr(count), bx(count), wpr(count, 1), wbx(count, 0);
    for (std::size_t i = 0; i < count; ++i) {
      pr[i] = static_cast<std::int64_t>(i) * 1000003 + r + 2;
      bx[i] = static_cast<std::int64_t>(i) << (r % 8);
      for (int p = 0; p < n; ++p) {
        wpr[i] = static_cast<std::int64_t>(
            static_cast<std::uint64_t>(wpr[i]) *
            static_cast<std::uint64_t>(static_cast<std::int64_t>(i) * 1000003 + p + 2));
        wbx[i] ^= static_cast<std::int64_t>(i) << (p % 8);
      }
    }
    coll::allreduce(k.ctx("allreduce"), pr.data(), count, DataType::kInt64, ReduceOp::kProduct);
    coll::allreduce(k.ctx("allreduce"), bx.data(), count, DataType::kInt64, ReduceOp::kBxor);
    check_eq(pr, wpr, tag("allreduce int64 PRODUCT", count));
    check_eq(bx, wbx, tag("allreduce int64 BXOR", count));
  }
  {  // bool: SUM is logical or, PRODUCT logical and
    std::vector<std::uint8_t> any(count), all(count), wany(count, 0), wall(count, 1);
    for (std::size_t i = 0; i < count; ++i) {
      any[i] = static_cast<std::uint8_t>((i % static_cast<std::size_t>(n + 1)) ==
                                         static_cast<std::size_t>(r));
      all[i] = static_cast<std::uint8_t>(i % 3 != 0 || r != n - 1);
      for (int p = 0; p < n; ++p) {
        wany[i] |= static_cast<std::uint8_t>((i % static_cast<std::size_t>(n + 1)) ==
                                             static_cast<std::size_t>(p));
        wall[i] &= static_cast<std::uint8_t>(i % 3 != 0 || p != n - 1);
      }
    }
    coll::allreduce(k.ctx("allreduce"), any.data(), count, DataType::kBool, ReduceOp::kSum);
    coll::allreduce(k.ctx("allreduce"), all.data(), count, DataType::kBool, ReduceOp::kProduct);
    check_eq(any, wany, tag("allreduce bool SUM", count));
    check_eq(all, wall, tag("allreduce bool PRODUCT", count));
  }
  {  // complex64 SUM, float64 MIN
    std::vector<std::complex<float>> c(count), wc(count);
    std::vector<double> m(count), wm(count, 1e300);
    for (std::size_t i = 0; i < count; ++i) {
      c[i] = {val(r, i), val(r, i + 1)};
      m[i] = val(r, i) * 0.5;
      for (int p = 0; p < n; ++p) {
        wc[i] += std::complex<float>(val(p, i), val(p, i + 1));
        wm[i] = std::min(wm[i], val(p, i) * 0.5);
      }
    }
    coll::allreduce(k.ctx("allreduce"), c.data(), count, DataType::kComplex64, ReduceOp::kSum);
    coll::allreduce(k.ctx("allreduce"), m.data(), count, DataType::kFloat64, ReduceOp::kMin);
    for (std::size_t i = 0; i < count; ++i) {
      if (c[i] != wc[i]) check_failed(__FILE__, __LINE__, tag("allreduce complex64 SUM", count));
    }
    check_eq(m, wm, tag("allreduce float64 MIN", count));
  }
}

void check_reduce(Rank& k, std::size_t count, int root) {
  std::vector<float> buf = contribution(k.r(), count), want(count, 0.0f);
  for (int p = 0; p < k.n(); ++p) {
    for (std::size_t i = 0; i < count; ++i) want[i] += val(p, i);
  }
  coll::reduce(k.ctx("reduce"), buf.data(), count, DataType::kFloat32, ReduceOp::kSum, root);
  if (k.r() == root) {
    check_eq(buf, want, tag("reduce float32 SUM", count, root));
  } else {  // a non-root's buffer is only read
    check_eq(buf, contribution(k.r(), count), tag("reduce leaves a non-root's input", count, root));
  }
}

void check_allgatherv(Rank& k, const std::vector<std::size_t>& counts, bool in_place) {
  const int n = k.n(), r = k.r();
  std::vector<std::size_t> displs(counts.size());
  std::size_t total = 0;
  for (std::size_t p = 0; p < counts.size(); ++p) {
    displs[p] = total + 3;  // gaps between the parts stay untouched
    total = displs[p] + counts[p];
  }
  std::vector<unsigned char> out(total + 5, 0xAB), want(total + 5, 0xAB);
  for (int p = 0; p < n; ++p) {
    const auto part = bytes_of(p, counts[static_cast<std::size_t>(p)], 2);
    std::copy(part.begin(), part.end(),
              want.begin() + static_cast<std::ptrdiff_t>(displs[static_cast<std::size_t>(p)]));
  }
  const auto mine = bytes_of(r, counts[static_cast<std::size_t>(r)], 2);
  const void* in = mine.data();
  if (in_place) {
    std::copy(mine.begin(), mine.end(),
              out.begin() + static_cast<std::ptrdiff_t>(displs[static_cast<std::size_t>(r)]));
    in = out.data() + displs[static_cast<std::size_t>(r)];
  }
  coll::allgatherv(k.ctx("allgatherv"), in, out.data(), counts.data(), displs.data());
  if (out != want) check_failed(__FILE__, __LINE__, "allgatherv: wrong data");
}

void check_allgather(Rank& k, std::size_t bytes) {
  const int n = k.n();
  std::vector<unsigned char> out(bytes * static_cast<std::size_t>(n)), want;
  for (int p = 0; p < n; ++p) {
    const auto part = bytes_of(p, bytes, 3);
    want.insert(want.end(), part.begin(), part.end());
  }
  const auto mine = bytes_of(k.r(), bytes, 3);
  coll::allgather(k.ctx("allgather"), mine.data(), bytes, out.data());
  if (out != want) check_failed(__FILE__, __LINE__, tag("allgather", bytes) + ": wrong data");
  // In place: `in` aliases the rank's own slot of `out`.
  std::vector<unsigned char> out2(out.size(), 0);
  std::copy(mine.begin(), mine.end(),
            out2.begin() + static_cast<std::ptrdiff_t>(bytes * static_cast<std::size_t>(k.r())));
  coll::allgather(k.ctx("allgather"), out2.data() + bytes * static_cast<std::size_t>(k.r()), bytes,
                  out2.data());
  if (out2 != want)
    check_failed(__FILE__, __LINE__, tag("allgather in place", bytes) + ": wrong data");
}

void check_gather_scatter(Rank& k, std::size_t bytes, int root) {
  const int n = k.n(), r = k.r();
  const auto nn = static_cast<std::size_t>(n);
  std::vector<unsigned char> want;
  for (int p = 0; p < n; ++p) {
    const auto part = bytes_of(p, bytes, 4);
    want.insert(want.end(), part.begin(), part.end());
  }
  const auto mine = bytes_of(r, bytes, 4);
  std::vector<unsigned char> out(r == root ? bytes * nn : 0);
  coll::gather(k.ctx("gather"), mine.data(), bytes, r == root ? out.data() : nullptr, root);
  if (r == root && out != want)
    check_failed(__FILE__, __LINE__, tag("gather", bytes, root) + ": wrong data");
  // Scatter the same concatenation back out.
  std::vector<unsigned char> got(bytes, 0xCD);
  coll::scatter(k.ctx("scatter"), r == root ? want.data() : nullptr, got.data(), bytes, root);
  if (got != mine) check_failed(__FILE__, __LINE__, tag("scatter", bytes, root) + ": wrong data");
}

void check_reduce_scatter(Rank& k, const std::vector<std::size_t>& counts) {
  const int n = k.n(), r = k.r();
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  std::size_t my_off = 0;
  for (int p = 0; p < r; ++p) my_off += counts[static_cast<std::size_t>(p)];
  const std::size_t mine = counts[static_cast<std::size_t>(r)];
  const std::vector<float> in = contribution(r, total);
  std::vector<float> out(mine, -99.0f), want(mine, 0.0f);
  for (int p = 0; p < n; ++p) {
    for (std::size_t i = 0; i < mine; ++i) want[i] += val(p, my_off + i);
  }
  coll::reduce_scatter(k.ctx("reduce_scatter"), in.data(), out.data(), counts.data(),
                       DataType::kFloat32, ReduceOp::kSum);
  check_eq(out, want, "reduce_scatter count " + std::to_string(total));
  if (in != contribution(r, total))
    check_failed(__FILE__, __LINE__, "reduce_scatter modified its input");
  // In place: out is the rank's own block of the input.
  std::vector<float> io = contribution(r, total);
  coll::reduce_scatter(k.ctx("reduce_scatter"), io.data(), io.data() + my_off, counts.data(),
                       DataType::kFloat32, ReduceOp::kSum);
  check_eq(std::vector<float>(io.begin() + static_cast<std::ptrdiff_t>(my_off),
                              io.begin() + static_cast<std::ptrdiff_t>(my_off + mine)),
           want, "reduce_scatter in place");
}

// Rank s sends split(s, d) bytes to rank d; some splits are zero.
std::size_t split(int s, int d, int salt) {
  return static_cast<std::size_t>(((s * 5 + d * 3 + salt) % 7) == 0 ? 0
                                                                    : (s * 13 + d * 7 + salt) % 29);
}

void check_alltoallv(Rank& k, int salt) {
  const int n = k.n(), r = k.r();
  const auto nn = static_cast<std::size_t>(n);
  std::vector<std::size_t> sc(nn), sd(nn), rc(nn), rd(nn);
  std::size_t in_total = 0, out_total = 0;
  for (int p = 0; p < n; ++p) {
    const auto pu = static_cast<std::size_t>(p);
    sc[pu] = split(r, p, salt);
    rc[pu] = split(p, r, salt);
  }
  // Displacements in reverse rank order, with gaps, to check they are honoured.
  for (int p = n - 1; p >= 0; --p) {
    const auto pu = static_cast<std::size_t>(p);
    sd[pu] = in_total + 1;
    in_total = sd[pu] + sc[pu];
    rd[pu] = out_total + 2;
    out_total = rd[pu] + rc[pu];
  }
  std::vector<unsigned char> in(in_total + 1, 0x11), out(out_total + 1, 0x22),
      want(out_total + 1, 0x22);
  for (int p = 0; p < n; ++p) {
    const auto pu = static_cast<std::size_t>(p);
    const auto to = bytes_of(r * 100 + p, sc[pu], 5);
    std::copy(to.begin(), to.end(), in.begin() + static_cast<std::ptrdiff_t>(sd[pu]));
    const auto from = bytes_of(p * 100 + r, rc[pu], 5);
    std::copy(from.begin(), from.end(), want.begin() + static_cast<std::ptrdiff_t>(rd[pu]));
  }
  coll::alltoallv(k.ctx("alltoallv"), in.data(), sc.data(), sd.data(), out.data(), rc.data(),
                  rd.data());
  if (out != want)
    check_failed(__FILE__, __LINE__, "alltoallv salt " + std::to_string(salt) + ": wrong data");
}

void check_invalid_arguments(Rank& k) {
  const int n = k.n();
  float f[4] = {};
  // Every rank rejects the same bad arguments before posting anything: nothing hangs.
  std::string m =
      expect_error(Errc::kInvalidArgument, [&] { coll::broadcast(k.ctx("broadcast"), f, 4, n); });
  CX_CHECK_HAS(m, "commux broadcast: root");
  m = expect_error(Errc::kInvalidArgument, [&] {
    coll::allreduce(k.ctx("allreduce"), f, 2, DataType::kComplex64, ReduceOp::kMin);
  });
  CX_CHECK_HAS(m, "commux allreduce: ReduceOp MIN is not defined for complex64");
  m = expect_error(Errc::kInvalidArgument, [&] {
    coll::reduce(k.ctx("reduce"), f, 4, DataType::kFloat32, ReduceOp::kBand, 0);
  });
  CX_CHECK_HAS(m, "commux reduce:");
  coll::Context none;
  none.op_name = "barrier";
  m = expect_error(Errc::kInvalidArgument, [&] { coll::barrier(none); });
  CX_CHECK_HAS(m, "commux barrier:");
  // Sizes that wrap around a size_t: before, the byte count came out at a few bytes and the
  // algorithms (which use the count) ran past the buffer.
  const std::size_t wraps = SIZE_MAX / 4 + 2;  // x 4 bytes = 4 (mod 2^64)
  m = expect_error(Errc::kInvalidArgument, [&] {
    coll::allreduce(k.ctx("allreduce"), f, wraps, DataType::kFloat32, ReduceOp::kSum);
  });
  CX_CHECK_HAS(m, "commux allreduce: count x element size (4611686018427387905 x 4) overflows");
  m = expect_error(Errc::kInvalidArgument, [&] {
    coll::reduce(k.ctx("reduce"), f, wraps, DataType::kFloat32, ReduceOp::kSum, 0);
  });
  CX_CHECK_HAS(m, "commux reduce: count x element size");
  std::vector<std::size_t> counts(static_cast<std::size_t>(n), 1);
  counts[0] = SIZE_MAX;  // the sum wraps (with n > 1) to n - 2
  if (n > 1) {
    m = expect_error(Errc::kInvalidArgument, [&] {
      coll::reduce_scatter(k.ctx("reduce_scatter"), f, f, counts.data(), DataType::kFloat32,
                           ReduceOp::kSum);
    });
    CX_CHECK_HAS(m, "commux reduce_scatter: the counts' sum");
    std::vector<std::size_t> displs(static_cast<std::size_t>(n), 0);
    m = expect_error(Errc::kInvalidArgument, [&] {
      coll::allgatherv(k.ctx("allgatherv"), f, f, counts.data(), displs.data());
    });
    CX_CHECK_HAS(m, "commux allgatherv: the counts' sum");
    m = expect_error(Errc::kInvalidArgument,
                     [&] { coll::gather(k.ctx("gather"), f, SIZE_MAX / 2 + 1, f, 0); });
    CX_CHECK_HAS(m, "commux gather: bytes x ranks");
  }
  std::vector<std::size_t> sc(static_cast<std::size_t>(n), 0), sd(static_cast<std::size_t>(n), 0);
  sc[0] = 8;
  sd[0] = SIZE_MAX - 3;  // + 8 wraps to 4
  m = expect_error(Errc::kInvalidArgument, [&] {
    coll::alltoallv(k.ctx("alltoallv"), f, sc.data(), sd.data(), f, sc.data(), sd.data());
  });
  CX_CHECK_HAS(m, "commux alltoallv: a send displacement + count");
}

// The whole sequence, for one world.
void all_collectives(Rank& k, bool large) {
  const int n = k.n();
  const auto nn = static_cast<std::size_t>(n);
  const std::vector<int> roots = n == 1 ? std::vector<int>{0} : std::vector<int>{0, n - 1, n / 2};
  const std::size_t not_div = nn * 3 + 1;  // not divisible by n (for n > 1)
  check_barrier(k);
  for (std::size_t bytes :
       {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div, std::size_t{5000}}) {
    for (int root : roots) check_broadcast(k, bytes, root);
  }
  // Scatter + ring allgather path (>= 512 KiB), uneven blocks.
  check_broadcast(k, (std::size_t{600} << 10) + 3, n - 1);
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div,
                            nn > 1 ? nn - 1 : 1 /* fewer elements than ranks */,
                            std::size_t{20011} /* ring / halves, uneven */}) {
    check_allreduce_sum(k, count);
  }
  check_allreduce_identical(k, 13);
  check_allreduce_identical(k, 20011);
  check_allreduce_types(k, 7);
  check_allreduce_types(k, 9001);  // 9001 int64 = 72 KB: ring / halves
  for (int root : roots) {
    for (std::size_t count :
         {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div, std::size_t{20011}}) {
      check_reduce(k, count, root);
    }
  }
  for (std::size_t bytes :
       {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div, std::size_t{70001}}) {
    check_allgather(k, bytes);
  }
  {
    std::vector<std::size_t> uneven(nn);
    for (std::size_t p = 0; p < nn; ++p) uneven[p] = (p % 3 == 1) ? 0 : p * 11 + 5;
    check_allgatherv(k, uneven, false);
    check_allgatherv(k, uneven, true);
    check_allgatherv(k, counts_for(n, 0), false);
  }
  for (int root : roots) {
    for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{70001}}) {
      check_gather_scatter(k, bytes, root);
    }
  }
  {
    std::vector<std::size_t> uneven(nn);
    for (std::size_t p = 0; p < nn; ++p) uneven[p] = (p % 3 == 1) ? 0 : p * 7 + 3;
    check_reduce_scatter(k, uneven);
    check_reduce_scatter(k, counts_for(n, 0));
    check_reduce_scatter(k, counts_for(n, 1));
    check_reduce_scatter(k, counts_for(n, 5003));
  }
  for (int salt : {0, 1, 2}) check_alltoallv(k, salt);
  check_invalid_arguments(k);
  check_barrier(k);
  if (large) {
    check_allreduce_sum(k, std::size_t{1} << 20);
    check_allreduce_sum(k, (std::size_t{1} << 20) + 3);  // 2 ranks: 3 uneven chunks per half
    check_allreduce_identical(k, (std::size_t{1} << 20) + 3);
    check_reduce(k, (std::size_t{1} << 20) + 3, n - 1);  // pipelined in 5 uneven chunks
    std::vector<std::size_t> big = counts_for(n, (std::size_t{1} << 20) / nn);
    big[0] += 5;
    check_reduce_scatter(k, big);
  }
}

// ---- every algorithm of every collective, forced ------------------------------------------------

// Whether `name` handles a call on n ranks (uniform: equal, contiguous allgather parts). Mirrors the
// algorithms' accepts(); a declined algorithm falls back to the selector's choice.
bool handles(const std::string& op, const std::string& name, int n, bool uniform = true) {
  const bool pow2 = (n & (n - 1)) == 0;
  if (op == "allreduce" && name == "halves") return n == 2;
  if (op == "broadcast" && name == "scatter_allgather") return n >= 2;
  if (op == "allgather" && name == "recursive_doubling") return pow2 && uniform;
  if (op == "allgather" && name == "bruck") return uniform;
  if (op == "reduce_scatter" && name == "recursive_halving") return pow2;
  return true;
}

// The algorithm that ran must be the forced one when it handles the call, another one otherwise.
void check_ran(Rank& k, const std::string& op, const std::string& name, bool handled) {
  const std::string ran = coll::last_algorithm();
  if (handled ? ran != name : ran == name) {
    check_failed(__FILE__, __LINE__,
                 op + " forced to " + name + " on " + std::to_string(k.n()) + " ranks ran '" + ran +
                     "'");
  }
}

// Counts 0, 1, odd, not divisible by n, and (large) a few MiB, several roots, the ops and dtypes
// that exercise the algorithm's code paths (the kernels are tested in test_kernels).
void forced_suite(Rank& k, const std::string& op, const std::string& name, bool large) {
  const int n = k.n();
  const auto nn = static_cast<std::size_t>(n);
  const std::size_t not_div = nn * 3 + 1;
  const std::vector<int> roots = n == 1 ? std::vector<int>{0} : std::vector<int>{0, n - 1, n / 2};
  k.forced.clear();
  k.forced[op] = name;
  k.label = op + "/" + name + ": ";
  const bool h = handles(op, name, n);
  if (op == "allreduce") {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div,
                              nn > 1 ? nn - 1 : 1, std::size_t{20011}}) {
      check_allreduce_sum(k, count);
      check_ran(k, op, name, h);
    }
    check_allreduce_identical(k, 13);
    check_allreduce_identical(k, 20011);
    check_allreduce_types(k, 9001);
    if (large) {
      check_allreduce_sum(k, (std::size_t{1} << 20) + 3);
      check_allreduce_identical(k, (std::size_t{1} << 20) + 3);
      check_ran(k, op, name, h);
    }
  } else if (op == "broadcast") {
    for (std::size_t bytes :
         {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div, std::size_t{5000}}) {
      for (int root : roots) check_broadcast(k, bytes, root);
    }
    check_ran(k, op, name, h);
    if (large) check_broadcast(k, (std::size_t{3} << 20) + 3, n / 2);
  } else if (op == "reduce") {
    for (int root : roots) {
      for (std::size_t count :
           {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div, std::size_t{20011}}) {
        check_reduce(k, count, root);
      }
    }
    check_ran(k, op, name, h);
    if (large) {
      check_reduce(k, (std::size_t{1} << 20) + 3, n - 1);
      check_reduce(k, (std::size_t{1} << 20) + 5, 0);
    }
  } else if (op == "allgather") {
    for (std::size_t bytes :
         {std::size_t{0}, std::size_t{1}, std::size_t{7}, not_div, std::size_t{70001}}) {
      check_allgather(k, bytes);
    }
    check_ran(k, op, name, h);
    std::vector<std::size_t> uneven(nn);
    for (std::size_t p = 0; p < nn; ++p) uneven[p] = (p % 3 == 1) ? 0 : p * 11 + 5;
    check_allgatherv(k, uneven, false);
    check_ran(k, op, name, handles(op, name, n, false));  // gaps: not uniform
    check_allgatherv(k, uneven, true);
    if (large) check_allgather(k, (std::size_t{512} << 10) + 1);
  } else if (op == "reduce_scatter") {
    std::vector<std::size_t> uneven(nn);
    for (std::size_t p = 0; p < nn; ++p) uneven[p] = (p % 3 == 1) ? 0 : p * 7 + 3;
    check_reduce_scatter(k, uneven);
    check_ran(k, op, name, h);
    check_reduce_scatter(k, counts_for(n, 0));
    check_reduce_scatter(k, counts_for(n, 1));
    check_reduce_scatter(k, counts_for(n, 5003));
    if (large) {
      std::vector<std::size_t> big = counts_for(n, (std::size_t{1} << 20) / nn);
      big[0] += 5;
      check_reduce_scatter(k, big);
    }
  } else if (op == "alltoall") {
    for (int salt : {0, 1, 2}) check_alltoallv(k, salt);
    check_ran(k, op, name, h);
  } else if (op == "barrier") {
    check_barrier(k);
    check_ran(k, op, name, h);
  } else if (op == "gather" || op == "scatter") {
    k.forced["gather"] = k.forced["scatter"] = name;  // both have binomial and linear
    for (int root : roots) {
      for (std::size_t bytes :
           {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{70001}}) {
        check_gather_scatter(k, bytes, root);
      }
    }
    check_ran(k, "scatter", name, h);
    if (large) check_gather_scatter(k, (std::size_t{1} << 20) + 3, n - 1);
  }
  k.forced.clear();
  k.label.clear();
}

const std::vector<std::string> kOps = {"allreduce", "broadcast",      "reduce",
                                       "allgather", "reduce_scatter", "alltoall",
                                       "barrier",   "gather",         "scatter"};

}  // namespace

class Threads : public ::testing::TestWithParam<int> {};

TEST_P(Threads, EveryCollective) {
  const int n = GetParam();
  const bool large = n == 2 || n == 5;
  const auto t0 = Clock::now();
  run_world(n, [&](Rank& k) { all_collectives(k, large); });
  std::fprintf(stderr, "[world %d] every collective in %.2f s\n", n,
               std::chrono::duration<double>(Clock::now() - t0).count());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Threads, ::testing::Values(1, 2, 3, 4, 5, 8));

class Forced : public ::testing::TestWithParam<int> {};

// Every algorithm of every collective, forced through Context::algorithm, on worlds of 1..8 ranks.
TEST_P(Forced, EveryAlgorithmOfEveryCollective) {
  const int n = GetParam();
  const bool large = n >= 2 && n <= 5;
  const auto t0 = Clock::now();
  run_world(n, [&](Rank& k) {
    for (const auto& op : kOps) {
      if (op == "scatter") continue;  // run together with gather
      for (const auto& name : coll::algorithms(op.c_str())) forced_suite(k, op, name, large);
    }
  });
  std::fprintf(stderr, "[world %d] every algorithm in %.2f s\n", n,
               std::chrono::duration<double>(Clock::now() - t0).count());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Forced, ::testing::Values(1, 2, 3, 4, 5, 6, 7, 8));

// The same on the non-host path (host buffers labelled kUnknown: staging, local copies as
// messages to the rank itself), small counts only.
TEST(Algorithms, EveryAlgorithmOnTheNonHostPath) {
  for (int n : {3, 4}) {
    run_world(
        n,
        [&](Rank& k) {
          for (const auto& op : kOps) {
            if (op == "scatter") continue;
            for (const auto& name : coll::algorithms(op.c_str())) forced_suite(k, op, name, false);
          }
        },
        MemoryType::kUnknown);
  }
}

TEST(Algorithms, ListedPerCollective) {
  EXPECT_EQ(coll::algorithms("allreduce"),
            (std::vector<std::string>{"recursive_doubling", "halves", "ring", "rabenseifner"}));
  EXPECT_EQ(coll::algorithms("ALLGATHER"),
            (std::vector<std::string>{"ring", "recursive_doubling", "bruck"}));
  EXPECT_EQ(coll::algorithms("allgatherv"), coll::algorithms("allgather"));
  EXPECT_EQ(coll::algorithms("alltoallv"), (std::vector<std::string>{"pairwise", "linear"}));
  for (const auto& op : kOps) EXPECT_FALSE(coll::algorithms(op.c_str()).empty()) << op;
  const std::string m =
      expect_error(Errc::kInvalidArgument, [] { coll::algorithms("allscatter"); });
  EXPECT_NE(m.find("unknown collective 'allscatter'"), std::string::npos) << m;
  EXPECT_NE(m.find("reduce_scatter"), std::string::npos) << m;
  EXPECT_EQ(std::string(coll::last_algorithm()), "");  // nothing ran on this thread yet
}

// A forced algorithm that declines falls back to the selector; the selector's choices by size;
// unknown names fail on every rank before anything is posted, listing the valid names;
// force_algorithm() and COMMUX_ALGO_<OP> force the same way as Context::algorithm.
TEST(Algorithms, FallbackSelectionAndUnknownNames) {
  ::unsetenv("COMMUX_ALGO_ALLREDUCE");
  run_world(3, [](Rank& k) {
    std::vector<float> v = contribution(k.r(), 100);
    auto allreduce = [&](const char* algo, std::size_t count) {
      coll::Context c = k.ctx("allreduce");
      c.algorithm = algo;
      std::vector<float> b = contribution(k.r(), count);
      coll::allreduce(c, b.data(), count, DataType::kFloat32, ReduceOp::kSum);
      return std::string(coll::last_algorithm());
    };
    CX_CHECK_EQ(allreduce("halves", 100), "recursive_doubling");  // declines 3 ranks: small -> rd
    CX_CHECK_EQ(allreduce("halves", 100000), "ring");             // large -> ring
    CX_CHECK_EQ(allreduce(nullptr, 100000), "ring");
    CX_CHECK_EQ(allreduce("auto", 10), "recursive_doubling");
    CX_CHECK_EQ(allreduce("rabenseifner", 10), "rabenseifner");
    {
      std::vector<unsigned char> in(10, 1), out(30);
      coll::Context c = k.ctx("allgather");
      c.algorithm = "recursive_doubling";  // declines 3 ranks: small -> bruck
      coll::allgather(c, in.data(), 10, out.data());
      CX_CHECK_EQ(std::string(coll::last_algorithm()), "bruck");
      c = k.ctx("allgather");
      coll::allgather(c, in.data(), 10, out.data());
      CX_CHECK_EQ(std::string(coll::last_algorithm()), "bruck");
    }
    {
      std::vector<std::size_t> counts(3, 4);
      std::vector<float> in(12, 1.0f), out(4);
      coll::Context c = k.ctx("reduce_scatter");
      c.algorithm = "recursive_halving";  // declines 3 ranks -> ring
      coll::reduce_scatter(c, in.data(), out.data(), counts.data(), DataType::kFloat32,
                           ReduceOp::kSum);
      CX_CHECK_EQ(std::string(coll::last_algorithm()), "ring");
    }
    std::string m = expect_error(Errc::kInvalidArgument, [&] {
      coll::Context c = k.ctx("allreduce");
      c.algorithm = "butterfly";
      coll::allreduce(c, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    });
    CX_CHECK_HAS(
        m, "commux allreduce: unknown allreduce algorithm 'butterfly' (from Context::algorithm)");
    CX_CHECK_HAS(m, "recursive_doubling, halves, ring, rabenseifner");
    m = expect_error(Errc::kInvalidArgument, [&] {
      coll::Context c = k.ctx("gather");
      c.algorithm = "ring";
      std::vector<unsigned char> out(12);
      coll::gather(c, v.data(), 4, out.data(), 0);
    });
    CX_CHECK_HAS(m, "unknown gather algorithm 'ring'");
    CX_CHECK_HAS(m, "binomial, linear");
    coll::barrier(k.ctx("barrier"));  // nothing was left posted: the world still works
  });
  // force_algorithm(): process-wide, validated at once, cleared by nullptr / "auto".
  std::string m =
      expect_error(Errc::kInvalidArgument, [] { coll::force_algorithm("allreduce", "tree"); });
  EXPECT_NE(m.find("recursive_doubling, halves, ring, rabenseifner"), std::string::npos) << m;
  coll::force_algorithm("allreduce", "rabenseifner");
  EXPECT_EQ(coll::forced_algorithm("allreduce"), "rabenseifner");
  run_world(3, [](Rank& k) {
    std::vector<float> v = contribution(k.r(), 100000);
    coll::allreduce(k.ctx("allreduce"), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    CX_CHECK_EQ(std::string(coll::last_algorithm()), "rabenseifner");
    coll::Context c = k.ctx("allreduce");
    c.algorithm = "ring";  // Context::algorithm wins
    coll::allreduce(c, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    CX_CHECK_EQ(std::string(coll::last_algorithm()), "ring");
  });
  coll::force_algorithm("allreduce", "auto");
  EXPECT_EQ(coll::forced_algorithm("allreduce"), "");
}

// COMMUX_ALGO_ALLREDUCE, read once per process (commux::settings()): this test checks what the
// environment it started with asks for -- unset (the selector), a name (that algorithm) or an unknown
// name (every call fails naming the variable). ctest runs it once more with each of the latter two
// (tests/CMakeLists.txt: collectives.env_algo_*); a name must be one that handles 3 ranks.
TEST(Algorithms, FromEnvironmentReadOnce) {
  const char* raw = std::getenv("COMMUX_ALGO_ALLREDUCE");
  const std::string asked = raw != nullptr && std::string(raw) != "auto" ? raw : "";
  const auto names = coll::algorithms("allreduce");
  const bool known = std::find(names.begin(), names.end(), asked) != names.end();
  EXPECT_EQ(coll::forced_algorithm("allreduce"), asked);
  // Read once: a later change of the environment is not seen.
  ::setenv("COMMUX_ALGO_ALLREDUCE", asked == "ring" ? "halves" : "ring", 1);
  EXPECT_EQ(coll::forced_algorithm("allreduce"), asked);
  run_world(3, [&](Rank& k) {
    std::vector<float> v = contribution(k.r(), 100000);
    if (asked.empty() || known) {
      coll::allreduce(k.ctx("allreduce"), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
      CX_CHECK_EQ(std::string(coll::last_algorithm()), asked.empty() ? "ring" : asked);
    } else {
      const std::string msg = expect_error(Errc::kInvalidArgument, [&] {
        coll::allreduce(k.ctx("allreduce"), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
      });
      CX_CHECK_HAS(msg, "unknown allreduce algorithm '" + asked + "' (from COMMUX_ALGO_ALLREDUCE)");
      coll::barrier(k.ctx("barrier"));  // nothing was left posted
    }
  });
  if (raw != nullptr) {
    ::setenv("COMMUX_ALGO_ALLREDUCE", raw, 1);
  } else {
    ::unsetenv("COMMUX_ALGO_ALLREDUCE");
  }
}

// Buffers of a memory type other than kHost take the device path: reductions staged through host
// scratch, local copies as messages to the rank itself. Host memory labelled kUnknown (UCX finds
// out what it is) runs that path without a GPU.
TEST(Collectives, NonHostMemoryPathOnHostBuffers) {
  for (int n : {1, 2, 3}) {
    run_world(n, [&](Rank& k) { all_collectives(k, n == 2); }, MemoryType::kUnknown);
  }
}

// With Context::device set, a collective works in the user's memory: scratch from the DeviceOps
// (every buffer released again), reductions and local copies through it, nothing staged through
// host scratch. Host memory labelled kUnknown stands in for device memory.
TEST(Collectives, DeviceOpsDoTheWorkInDeviceMemory) {
  for (int n : {1, 2, 3, 4}) {
    run_world(
        n,
        [&](Rank& k) {
          auto& ops = *static_cast<CountingDeviceOps*>(k.device);
          all_collectives(k, n == 2);
          EXPECT_EQ(ops.live(), 0u);
          EXPECT_EQ(ops.bad_releases, 0u);
          // Each reducing collective on its own: it reduces through the DeviceOps on 2+ ranks.
          for (const char* op : {"allreduce", "reduce", "reduce_scatter"}) {
            for (std::size_t count : {std::size_t{7}, std::size_t{70000}}) {
              const std::size_t before = ops.reductions, syncs_before = ops.syncs;
              if (std::string(op) == "allreduce") check_allreduce_sum(k, count);
              if (std::string(op) == "reduce") check_reduce(k, count, n - 1);
              if (std::string(op) == "reduce_scatter")
                check_reduce_scatter(k, counts_for(n, count));
              // Who reduces: every rank in a reduce-scatter; the root of a reduce; in an allreduce
              // every rank, except the ranks folded out by recursive doubling on 3 ranks.
              const std::string o = op;
              const bool must = o == "reduce"      ? k.r() == n - 1
                                : o == "allreduce" ? (n != 3 || count >= 70000)
                                                   : true;
              if (n > 1 && must) {
                EXPECT_GT(ops.reductions, before) << op << " count " << count << " rank " << k.r();
              }
              EXPECT_EQ(ops.live(), 0u) << op;
              EXPECT_GT(ops.syncs, syncs_before)
                  << op << ": the caller's device work was not completed";
            }
          }
        },
        MemoryType::kUnknown, /*device_ops=*/true);
  }
  // Every algorithm, forced, on the device path.
  run_world(
      4,
      [&](Rank& k) {
        for (const auto& op : kOps) {
          if (op == "scatter") continue;
          for (const auto& name : coll::algorithms(op.c_str())) forced_suite(k, op, name, false);
        }
      },
      MemoryType::kUnknown, /*device_ops=*/true);
}

// Collectives with distinct tags may be in flight at once (the torch backend runs them on
// worker threads): two threads per rank, each running its own sequence.
// Reductions in device memory cut their ranges in 16 MiB chunks, not 1 MiB ones (internal.hpp):
// each device message and reduction has a fixed cost, and 1 MiB chunks made a 64 MiB all_reduce
// on one H200 7.7x slower. A 12 MiB allreduce of 2 ranks (halves: 6 MiB each) and a 12 MiB reduce
// therefore reduce once per rank, where host memory would take 6 and 12 steps.
TEST(Collectives, DeviceMemoryReductionsPipelineInLargeChunks) {
  constexpr std::size_t kCount = std::size_t{3} << 20;  // 12 MiB of float32
  run_world(
      2,
      [&](Rank& k) {
        auto& ops = *static_cast<CountingDeviceOps*>(k.device);
        std::size_t before = ops.reductions;
        check_allreduce_sum(k, kCount);
        EXPECT_EQ(ops.reductions - before, 1u) << "allreduce reductions on rank " << k.r();
        before = ops.reductions;
        check_reduce(k, kCount, 1);
        EXPECT_EQ(ops.reductions - before, k.r() == 1 ? 1u : 0u) << "reduce on rank " << k.r();
      },
      MemoryType::kUnknown, /*device_ops=*/true);
}

TEST(Collectives, ConcurrentCollectivesWithDistinctTags) {
  run_world(3, [](Rank& k) {
    std::atomic<int> failed{0};
    std::string why;
    std::mutex mu;
    auto worker = [&](std::uint32_t base) {
      try {
        for (int i = 0; i < 20; ++i) {
          coll::Context c;
          c.comm = &k.comm;
          c.tag = base + static_cast<std::uint32_t>(i);
          c.deadline = Clock::now() + std::chrono::seconds(30);
          c.op_name = "allreduce";
          std::vector<float> v = contribution(k.r(), 4099);
          coll::allreduce(c, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
          std::vector<float> want(v.size(), 0.0f);
          for (int p = 0; p < k.n(); ++p) {
            for (std::size_t j = 0; j < want.size(); ++j) want[j] += val(p, j);
          }
          check_eq(v, want, "concurrent allreduce");
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(mu);
        why = e.what();
        failed.fetch_add(1);
      }
    };
    std::thread a(worker, 1000u), b(worker, 2000u);
    a.join();
    b.join();
    if (failed.load() != 0) check_failed(__FILE__, __LINE__, why);
  });
}

// Schedules over UCX: 12 allreduces of each rank in flight at once, started on the rank's thread,
// then driven to their ends by two threads of the rank at the same time (each resumes whichever
// is ready; one thread at a time resumes a schedule), in different orders.
TEST(Collectives, SchedulesInFlightDrivenFromTwoThreads) {
  run_world(3, [](Rank& k) {
    constexpr int kCalls = 12;
    std::vector<std::vector<float>> bufs;
    std::vector<coll::Context> ctxs(kCalls);
    std::vector<std::unique_ptr<coll::Schedule>> ss;
    for (int i = 0; i < kCalls; ++i) bufs.push_back(contribution(k.r() + i, 1000 + 997 * i));
    for (int i = 0; i < kCalls; ++i) {
      coll::Context& c = ctxs[static_cast<std::size_t>(i)];
      c.comm = &k.comm;
      c.tag = 100 + static_cast<std::uint32_t>(i);
      c.deadline = Clock::now() + std::chrono::seconds(30);
      c.op_name = "allreduce";
      auto& v = bufs[static_cast<std::size_t>(i)];
      ss.push_back(std::make_unique<coll::Schedule>([&c, &v] {
        coll::allreduce(c, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
      }));
    }
    auto driver = [&](bool reverse) {
      for (;;) {
        int left = 0;
        for (int j = 0; j < kCalls; ++j) {
          auto& s = *ss[static_cast<std::size_t>(reverse ? kCalls - 1 - j : j)];
          if (!s.test()) ++left;
        }
        if (left == 0) return;
        for (auto& s : ss) {
          if (!s->done() && !s->ready()) {
            s->await(std::chrono::milliseconds(1));
            break;
          }
        }
      }
    };
    std::thread other(driver, true);
    driver(false);
    other.join();
    for (int i = 0; i < kCalls; ++i) {
      const auto& v = bufs[static_cast<std::size_t>(i)];
      if (ss[static_cast<std::size_t>(i)]->error())
        std::rethrow_exception(ss[static_cast<std::size_t>(i)]->error());
      std::vector<float> want(v.size(), 0.0f);
      for (int p = 0; p < k.n(); ++p) {
        const auto c = contribution(p + i, v.size());
        for (std::size_t j = 0; j < want.size(); ++j) want[j] += c[j];
      }
      check_eq(v, want, "scheduled allreduce");
    }
  });
}

// ---- forked processes: failures ---------------------------------------------------------------

namespace {

// Ranks 0 and 1 run an allreduce with a 1.5 s deadline; rank 2 never joins (it stays alive, or
// exits at once). The others must fail within the deadline plus a few seconds, naming the op.
void never_joins(bool exits, std::size_t count) {
  RunOptions o;
  o.timeout_s = 30;
  run_ranks(
      3,
      [exits, count](Communicator& c) {
        if (c.rank() == 2) {
          if (!exits) std::this_thread::sleep_for(std::chrono::milliseconds(4000));
          return;
        }
        std::vector<float> v(count, 1.0f);
        coll::Context ctx;
        ctx.comm = &c;
        ctx.tag = 7;
        ctx.op_name = "allreduce";
        const auto t0 = Clock::now();
        ctx.deadline = t0 + std::chrono::milliseconds(1500);
        std::string msg;
        Errc code = Errc::kTransport;
        try {
          coll::allreduce(ctx, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
          check_failed(__FILE__, __LINE__, "allreduce without rank 2 returned");
        } catch (const Error& e) {
          msg = e.what();
          code = e.code();
          // The collective names itself, keeps the failed request's peer and tag, and is not posted
          // any more (it cancelled its requests): neither the field nor the note says otherwise.
          CX_CHECK(e.op() == "allreduce");
          CX_CHECK(e.peer().has_value());
          CX_CHECK(e.tag().has_value());
          CX_CHECK(!e.still_posted());
          CX_CHECK(e.group() == std::to_string(c.options().group));
          CX_CHECK(msg.find("still posted") == std::string::npos);
        }
        const double took = std::chrono::duration<double>(Clock::now() - t0).count();
        std::fprintf(stderr, "[rank %d] after %.2f s (%s): %s\n", c.rank(), took, errc_name(code),
                     msg.c_str());
        CX_CHECK(code == Errc::kTimeout || (exits && code == Errc::kPeerFailed));
        CX_CHECK_HAS(msg, "commux allreduce: ");
        CX_CHECK_HAS(msg, "peer ");
        CX_CHECK(took < 1.5 + 3.0);
        if (!exits) CX_CHECK(took >= 1.4);
      },
      o);
}

}  // namespace

TEST(CollectiveFailures, RankNeverJoinsSmallAllreduceTimesOut) { never_joins(false, 16); }
TEST(CollectiveFailures, RankNeverJoinsLargeAllreduceTimesOut) { never_joins(false, 1 << 20); }
TEST(CollectiveFailures, RankExitsBeforeAllreduce) { never_joins(true, 16); }

// A rank reducing in device memory and one in host memory cut a large range into different
// chunks, so their messages could not pair: the call's fingerprint carries the memory class, and
// both ranks fail with the device rank's call named "in device memory". Small reductions (one
// chunk either way) and the group itself still work.
TEST(CollectiveFailures, LargeReductionOfHostAndDeviceRanksFailsOnBothRanks) {
  run_ranks(2, [](Communicator& c) {
    const int r = c.rank();
    CountingDeviceOps ops;
    ops.expect_released = false;  // the failed call's scratch is parked with its stuck send
    auto ctx = [&](std::uint32_t tag) {
      coll::Context x;
      x.comm = &c;
      x.tag = tag;
      x.op_name = "allreduce";
      x.deadline = Clock::now() + std::chrono::seconds(10);
      x.mem = r == 0 ? MemoryType::kUnknown : MemoryType::kHost;
      x.device = r == 0 ? &ops : nullptr;
      return x;
    };
    std::vector<float> big(std::size_t{1} << 20, 1.0f);  // 4 MiB
    std::string msg;
    try {
      coll::allreduce(ctx(5), big.data(), big.size(), DataType::kFloat32, ReduceOp::kSum);
      check_failed(__FILE__, __LINE__, "a 4 MiB allreduce of a device and a host rank returned");
    } catch (const Error& e) {
      msg = e.what();
    }
    std::fprintf(stderr, "[rank %d] %s\n", r, msg.c_str());
    CX_CHECK_HAS(msg, "commux allreduce");
    CX_CHECK_HAS(msg, "in device memory");
    std::vector<float> small(1000, static_cast<float>(r + 1));
    coll::allreduce(ctx(6), small.data(), small.size(), DataType::kFloat32, ReduceOp::kSum);
    for (float v : small) CX_CHECK(v == 3.0f);
    // A send of the failed call stays posted (the peer never received it): its buffers must
    // outlive the communicator's shutdown.
    c.shutdown();
  });
}

// A broadcast root whose receiver comes late times out with its rendezvous send still posted:
// freeing the buffer then would let the transport read freed memory when the receive comes. What
// the caller hands to coll::hold_while_posted for that call stays alive while the transfer may
// still read it, and is released once it has finished (here the receiver drops the call's
// messages, which completes the transfer).
TEST(CollectiveFailures, WhatIsHeldForAFailedCallsTransfersIsReleasedWhenTheyFinish) {
  run_ranks(2, [](Communicator& c) {
    constexpr std::size_t kBytes = std::size_t{8} << 20;  // a rendezvous, whatever the transport
    auto ctx = [&](std::uint32_t tag, std::chrono::milliseconds limit) {
      coll::Context x;
      x.comm = &c;
      x.tag = tag;
      x.op_name = "broadcast";
      x.deadline = Clock::now() + limit;
      return x;
    };
    const auto sync = [&](std::uint32_t tag) { coll::barrier(ctx(tag, std::chrono::seconds(20))); };
    if (c.rank() == 0) {
      auto buf = std::make_shared<std::vector<char>>(kBytes, 'x');
      bool failed = false;
      try {
        coll::broadcast(ctx(3, std::chrono::milliseconds(300)), buf->data(), kBytes, 0);
      } catch (const Error& e) {
        failed = true;
        const std::string msg = e.what();
        std::fprintf(stderr, "[rank 0] %s\n", msg.c_str());
        CX_CHECK_HAS(msg, "stay posted");
        // How long the call waited, not the last slice of its wait ("Timed out after 8 ms").
        const std::size_t at = msg.find("Timed out after ");
        const long waited = at == std::string::npos ? -1 : std::stol(msg.substr(at + 16));
        CX_CHECK(waited >= 250 && waited < 1000);
      }
      CX_CHECK(failed);
      const std::weak_ptr<const std::vector<char>> watch = buf;
      CX_CHECK(!coll::hold_while_posted(c, 4, 1, {}));  // another call left nothing
      CX_CHECK(coll::hold_while_posted(c, 2, 2, std::move(buf)));
      CX_CHECK(!watch.expired());  // the transfer may still read it
      sync(10);
      sync(11);  // rank 1 has taken the call's messages
      const auto until = Clock::now() + std::chrono::seconds(10);
      while (coll::hold_while_posted(c, 3, 1, {}) && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      CX_CHECK(watch.expired());
    } else {
      sync(10);  // rank 0's broadcast has failed
      CX_CHECK(coll::discard_call(ctx(3, std::chrono::seconds(10))) >= 1);
      sync(11);
    }
  });
}

// Rank 0 believes the pair exchanges `a` bytes each way, rank 1 believes `b`: rank 0 receives a
// message longer than it posted (kTruncated), rank 1 a shorter one (kInvalidArgument); both name
// the peer and both sizes.
TEST(CollectiveFailures, AlltoallvMismatchedSplitsFailOnBothRanks) {
  for (auto [a, b] : {std::pair<std::size_t, std::size_t>{3, 5}, {0, 4}, {100, 70000}}) {
    run_ranks(2, [a = a, b = b](Communicator& c) {
      const int r = c.rank(), peer = 1 - r;
      const std::size_t mine = r == 0 ? a : b, theirs = r == 0 ? b : a;
      // Its own block (4 bytes) first, the peer's after it.
      std::vector<std::size_t> sc(2, 4), rc(2, 4), sd(2, 0), rd(2, 0);
      sc[static_cast<std::size_t>(peer)] = rc[static_cast<std::size_t>(peer)] = mine;
      sd[static_cast<std::size_t>(peer)] = rd[static_cast<std::size_t>(peer)] = 4;
      std::vector<unsigned char> in(4 + mine + 4, 1), out(4 + mine + 4, 0);
      coll::Context ctx;
      ctx.comm = &c;
      ctx.tag = 3;
      ctx.op_name = "alltoall";
      ctx.deadline = Clock::now() + std::chrono::seconds(10);
      std::string msg;
      Errc code = Errc::kTransport;
      try {
        coll::alltoallv(ctx, in.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data());
      } catch (const Error& e) {
        msg = e.what();
        code = e.code();
      }
      std::fprintf(stderr, "[rank %d] %s: %s\n", r, errc_name(code), msg.c_str());
      CX_CHECK(code == (theirs > mine ? Errc::kTruncated : Errc::kCallMismatch));
      CX_CHECK_HAS(msg, "commux alltoall: ");
      CX_CHECK_HAS(msg, "peer " + std::to_string(peer));
      CX_CHECK_HAS(msg, std::to_string(mine));
      CX_CHECK_HAS(msg, std::to_string(theirs));
      // The communicator is still usable: a barrier with a fresh tag completes.
      coll::Context bc;
      bc.comm = &c;
      bc.tag = 4;
      bc.op_name = "barrier";
      bc.deadline = Clock::now() + std::chrono::seconds(10);
      coll::barrier(bc);
    });
  }
}
