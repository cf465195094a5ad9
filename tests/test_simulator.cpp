// The real collectives (include/commux/collectives.hpp, every algorithm of src/collectives/algo
// forced through Context::algorithm) over in-process loopback worlds (tests/loopback_channel.hpp),
// without UCX.
//
// Simulator: rendezvous worlds (a send completes only once its receive is posted: nothing is
// buffered, the worst case for deadlock) of 1..64 ranks as threads. For every algorithm of every
// collective: no deadlock (the world reports one instead of hanging), results equal a serial
// reference, and nothing is left unmatched at the end. Rooted collectives run for every root up to
// kEveryRootUpTo ranks (all 64: the whole sweep takes about 15 s on 2 cores; lower it to cover
// roots 0, 1, n/2 and n-1 only above it, should the sweep grow). Counts are small and uneven (1 element, n + 3,
// 2n + 3, zero-sized blocks in the v-collectives), so blocks differ in size and some are empty.
//
// Loopback: the channel's own semantics (matching order, any-source, truncation, multi-buffer,
// cancel, deadlock report, traces), a deliberately broken collective that the simulator catches,
// and every collective over eager worlds with each ReduceOp on several dtypes and a size mismatch
// that fails every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <complex>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "commux/collectives.hpp"
#include "harness.hpp"
#include "loopback_channel.hpp"
#include "schedule.hpp"

using namespace commux;
using namespace commux::test;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxWorld = 64;
constexpr int kEveryRootUpTo = 64;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

// One rank's calls: distinct tags, a deadline, the forced algorithm and a label for messages.
struct Caller {
  Communicator& comm;
  const char* algorithm = nullptr;
  std::uint32_t next_tag = 1;
  std::string label;
  int r() const { return comm.rank(); }
  int n() const { return comm.size(); }
  coll::Context ctx(const std::string& what) {
    label = what + (algorithm != nullptr ? std::string("[") + algorithm + "]" : std::string());
    coll::Context c;
    c.comm = &comm;
    c.tag = next_tag++;
    c.deadline = Clock::now() + std::chrono::seconds(60);
    c.op_name = label.c_str();
    c.algorithm = algorithm;
    return c;
  }
};

// Integer-valued contribution of rank r to element i (-5 .. 5): sums are exact in every type.
int val(int r, std::size_t i) {
  return static_cast<int>((static_cast<std::size_t>(r) * 7 + i * 3) % 11) - 5;
}
unsigned char byte_of(int from, int to, std::size_t i) {
  return pattern(static_cast<std::uint64_t>(from) * 1000 + static_cast<std::uint64_t>(to + 1), i);
}

template <class T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  if (got.size() != want.size())
    fail(what + ": " + std::to_string(got.size()) + " elements, expected " +
         std::to_string(want.size()));
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(got[i] == want[i]))
      fail(what + ": element " + std::to_string(i) + " differs from the serial reference");
  }
}

// The serial reference of a reduction: contributions of ranks 0 .. n-1 folded left in rank order.
template <class T>
std::vector<T> reference(int n, std::size_t first, std::size_t count, DataType t, ReduceOp op,
                         const std::function<T(int, std::size_t)>& contrib) {
  std::vector<T> acc(count), next(count);
  for (std::size_t i = 0; i < count; ++i) acc[i] = contrib(0, first + i);
  for (int r = 1; r < n; ++r) {
    for (std::size_t i = 0; i < count; ++i) next[i] = contrib(r, first + i);
    reduce_into(acc.data(), next.data(), count, t, op);
  }
  return acc;
}

std::vector<int> roots_of(int n) {
  std::vector<int> v;
  if (n <= kEveryRootUpTo) {
    for (int root = 0; root < n; ++root) v.push_back(root);
  } else {
    v = {0, 1, n / 2, n - 1};
  }
  return v;
}

// ---- the checks, one per collective (int32 sums where a reduction is involved) -----------------

template <class T>
void check_allreduce(Caller& k, std::size_t count, DataType t, ReduceOp op,
                     const std::function<T(int, std::size_t)>& contrib) {
  std::vector<T> buf(count);
  for (std::size_t i = 0; i < count; ++i) buf[i] = contrib(k.r(), i);
  coll::allreduce(k.ctx("allreduce"), buf.data(), count, t, op);
  expect_equal(buf, reference<T>(k.n(), 0, count, t, op, contrib),
               k.label + " " + dtype_name(t) + " " + reduce_op_name(op) + " count " +
                   std::to_string(count));
}

std::function<std::int32_t(int, std::size_t)> int_contrib() {
  return [](int r, std::size_t i) { return static_cast<std::int32_t>(val(r, i)); };
}

void check_reduce(Caller& k, std::size_t count, int root) {
  std::vector<std::int32_t> buf(count);
  for (std::size_t i = 0; i < count; ++i) buf[i] = val(k.r(), i);
  coll::reduce(k.ctx("reduce"), buf.data(), count, DataType::kInt32, ReduceOp::kSum, root);
  if (k.r() == root) {
    expect_equal(buf,
                 reference<std::int32_t>(k.n(), 0, count, DataType::kInt32, ReduceOp::kSum,
                                         int_contrib()),
                 k.label + " root " + std::to_string(root));
  }
}

void check_broadcast(Caller& k, std::size_t bytes, int root) {
  std::vector<unsigned char> buf(bytes, 0xEE), want(bytes);
  for (std::size_t i = 0; i < bytes; ++i) want[i] = byte_of(root, -1, i);
  if (k.r() == root) buf = want;
  coll::broadcast(k.ctx("broadcast"), buf.data(), bytes, root);
  expect_equal(buf, want, k.label + " root " + std::to_string(root));
}

void check_allgatherv(Caller& k, const std::vector<std::size_t>& counts) {
  const int n = k.n();
  std::vector<std::size_t> displs(counts.size());
  // Blocks placed in reverse rank order, so displacements are not the prefix sums.
  std::size_t at = 0;
  for (int p = n - 1; p >= 0; --p) {
    displs[static_cast<std::size_t>(p)] = at;
    at += counts[static_cast<std::size_t>(p)];
  }
  std::vector<unsigned char> in(counts[static_cast<std::size_t>(k.r())]), out(at, 0xEE), want(at);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = byte_of(k.r(), -1, i);
  for (int p = 0; p < n; ++p) {
    for (std::size_t i = 0; i < counts[static_cast<std::size_t>(p)]; ++i)
      want[displs[static_cast<std::size_t>(p)] + i] = byte_of(p, -1, i);
  }
  const bool uniform =
      std::all_of(counts.begin(), counts.end(), [&](std::size_t c) { return c == counts[0]; });
  if (uniform) {
    // A plain allgather (rank order).
    std::vector<unsigned char> o(counts[0] * static_cast<std::size_t>(n), 0xEE), w(o.size());
    for (int p = 0; p < n; ++p) {
      for (std::size_t i = 0; i < counts[0]; ++i)
        w[static_cast<std::size_t>(p) * counts[0] + i] = byte_of(p, -1, i);
    }
    coll::allgather(k.ctx("allgather"), in.data(), counts[0], o.data());
    expect_equal(o, w, k.label + " bytes " + std::to_string(counts[0]));
  } else {
    coll::allgatherv(k.ctx("allgatherv"), in.data(), out.data(), counts.data(), displs.data());
    expect_equal(out, want, k.label);
  }
}

void check_gather_scatter(Caller& k, std::size_t bytes, int root) {
  const int n = k.n();
  std::vector<unsigned char> in(bytes), all(bytes * static_cast<std::size_t>(n), 0xEE),
      want(all.size());
  for (std::size_t i = 0; i < bytes; ++i) in[i] = byte_of(k.r(), root, i);
  for (int p = 0; p < n; ++p) {
    for (std::size_t i = 0; i < bytes; ++i)
      want[static_cast<std::size_t>(p) * bytes + i] = byte_of(p, root, i);
  }
  coll::gather(k.ctx("gather"), in.data(), bytes, all.data(), root);
  if (k.r() == root) expect_equal(all, want, k.label + " root " + std::to_string(root));
  // Scatter back what the root gathered: every rank gets its own block again.
  std::vector<unsigned char> out(bytes, 0xEE);
  coll::scatter(k.ctx("scatter"), k.r() == root ? want.data() : nullptr, out.data(), bytes, root);
  expect_equal(out, in, k.label + " root " + std::to_string(root));
}

void check_reduce_scatter(Caller& k, const std::vector<std::size_t>& counts) {
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  std::size_t first = 0;
  for (int p = 0; p < k.r(); ++p) first += counts[static_cast<std::size_t>(p)];
  std::vector<std::int32_t> in(total), out(counts[static_cast<std::size_t>(k.r())], -99);
  for (std::size_t i = 0; i < total; ++i) in[i] = val(k.r(), i);
  coll::reduce_scatter(k.ctx("reduce_scatter"), in.data(), out.data(), counts.data(),
                       DataType::kInt32, ReduceOp::kSum);
  expect_equal(out,
               reference<std::int32_t>(k.n(), first, out.size(), DataType::kInt32, ReduceOp::kSum,
                                       int_contrib()),
               k.label);
}

// Rank s sends (s + 2d + salt) % 3 bytes to rank d (zeros included).
std::size_t a2a_bytes(int s, int d, int salt) {
  return static_cast<std::size_t>((s + 2 * d + salt) % 3);
}

void check_alltoallv(Caller& k, int salt) {
  const int n = k.n();
  const auto un = static_cast<std::size_t>(n);
  std::vector<std::size_t> sc(un), sd(un), rc(un), rd(un);
  std::size_t st = 0, rt = 0;
  for (int p = 0; p < n; ++p) {
    const auto up = static_cast<std::size_t>(p);
    sc[up] = a2a_bytes(k.r(), p, salt);
    rc[up] = a2a_bytes(p, k.r(), salt);
    sd[up] = st;
    rd[up] = rt;
    st += sc[up];
    rt += rc[up];
  }
  std::vector<unsigned char> in(st), out(rt, 0xEE), want(rt);
  for (int p = 0; p < n; ++p) {
    const auto up = static_cast<std::size_t>(p);
    for (std::size_t i = 0; i < sc[up]; ++i) in[sd[up] + i] = byte_of(k.r(), p, i);
    for (std::size_t i = 0; i < rc[up]; ++i) want[rd[up] + i] = byte_of(p, k.r(), i);
  }
  coll::alltoallv(k.ctx("alltoallv"), in.data(), sc.data(), sd.data(), out.data(), rc.data(),
                  rd.data());
  expect_equal(out, want, k.label + " salt " + std::to_string(salt));
}

// One algorithm of one collective and the checks that run it (the same list on every rank).
struct Case {
  std::string op;
  std::string algorithm;
  std::function<void(Caller&)> body;
};

std::vector<Case> every_case(int n) {
  const auto un = static_cast<std::size_t>(n);
  std::vector<Case> cases;
  auto each = [&](const char* op, const std::function<void(Caller&)>& body) {
    for (const std::string& name : coll::algorithms(op)) cases.push_back(Case{op, name, body});
  };
  each("barrier", [](Caller& k) { coll::barrier(k.ctx("barrier")); });
  each("allreduce", [un](Caller& k) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, 2 * un + 3}) {
      check_allreduce<std::int32_t>(k, count, DataType::kInt32, ReduceOp::kSum, int_contrib());
    }
  });
  each("reduce", [n, un](Caller& k) {
    for (int root : roots_of(n)) check_reduce(k, un + 3, root);
  });
  each("broadcast", [n, un](Caller& k) {
    for (int root : roots_of(n)) check_broadcast(k, un + 3, root);
    check_broadcast(k, 0, n - 1);
  });
  each("allgather", [n, un](Caller& k) {
    check_allgatherv(k, std::vector<std::size_t>(un, 3));
    std::vector<std::size_t> counts(un);
    for (int p = 0; p < n; ++p)
      counts[static_cast<std::size_t>(p)] = static_cast<std::size_t>((p * 3) % 4);
    check_allgatherv(k, counts);
  });
  each("gather", [n](Caller& k) {
    for (int root : roots_of(n)) check_gather_scatter(k, 5, root);
  });
  each("scatter", [n](Caller& k) {
    for (int root : roots_of(n)) check_gather_scatter(k, 5, root);
  });
  each("reduce_scatter", [n, un](Caller& k) {
    check_reduce_scatter(k, std::vector<std::size_t>(un, 2));
    std::vector<std::size_t> counts(un);
    for (int p = 0; p < n; ++p)
      counts[static_cast<std::size_t>(p)] = static_cast<std::size_t>((p * 5 + 1) % 4);
    check_reduce_scatter(k, counts);
  });
  each("alltoall", [](Caller& k) {
    check_alltoallv(k, 0);
    check_alltoallv(k, 1);
  });
  return cases;
}

// Every algorithm of every collective, on this rank, one after another.
void every_algorithm(Communicator& comm) {
  Caller k{comm, nullptr, 1, {}};
  for (const Case& c : every_case(k.n())) {
    k.algorithm = c.algorithm.c_str();
    c.body(k);
  }
}

// Fails the test with every rank's failure, a deadlock report or anything left unmatched.
void expect_clean(LoopbackWorld& w, const std::vector<std::string>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r << " of " << errors.size();
  }
  EXPECT_EQ(w.deadlocks(), 0);
  EXPECT_EQ(w.unmatched(), "");
}

class Simulator : public ::testing::TestWithParam<int> {};

TEST_P(Simulator, EveryAlgorithmCompletesCorrectlyWithNothingUnmatched) {
  const int n = GetParam();
  LoopbackWorld w(n, LoopMode::kRendezvous);
  expect_clean(w, w.run(every_algorithm));
}

std::vector<int> sizes_1_to_64() {
  std::vector<int> v(kMaxWorld);
  std::iota(v.begin(), v.end(), 1);
  return v;
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, Simulator, ::testing::ValuesIn(sizes_1_to_64()));

// ---- schedules: every algorithm as a resumable coll::Schedule, all in flight at once -----------

// Drives `ss` to their ends: each sweep resumes the ready ones in an order of its own (random,
// differing between ranks); a sweep that leaves some not ready sleeps on one of them.
void drive(const std::vector<std::unique_ptr<coll::Schedule>>& ss, std::mt19937& rng) {
  std::vector<std::size_t> order(ss.size());
  std::iota(order.begin(), order.end(), 0);
  for (;;) {
    std::shuffle(order.begin(), order.end(), rng);
    std::size_t left = 0;
    coll::Schedule* idle = nullptr;
    for (std::size_t i : order) {
      if (ss[i]->test()) continue;
      ++left;
      if (!ss[i]->ready()) idle = ss[i].get();
    }
    if (left == 0) return;
    if (idle != nullptr) idle->await(std::chrono::milliseconds(1));
  }
}

// Each rank starts every case as a schedule (each with tags of its own), in the same order on
// every rank, then drives them all in a random order of its own; on odd ranks another thread
// drives them, so every schedule starts on one thread and finishes on another; ranks 2, 5, 8
// instead run each to its end in start order (run_to_end, as the torch backend's pool thread).
void every_algorithm_scheduled(Communicator& comm) {
  const std::vector<Case> cases = every_case(comm.size());
  std::vector<std::unique_ptr<Caller>> callers;
  std::vector<std::unique_ptr<coll::Schedule>> ss;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    callers.push_back(std::make_unique<Caller>(
        Caller{comm, cases[i].algorithm.c_str(), static_cast<std::uint32_t>(1 + i * 1000), {}}));
    Caller* k = callers.back().get();
    const Case* c = &cases[i];
    ss.push_back(std::make_unique<coll::Schedule>([k, c] { c->body(*k); }));
  }
  // In a rendezvous world no call of 2+ ranks can finish before its peers post: the constructor
  // must have returned at the first wait (suspended), not blocked there.
  const auto suspended =
      std::count_if(ss.begin(), ss.end(), [](const auto& s) { return !s->done(); });
  if (comm.size() > 1 && suspended == 0) fail("no schedule suspended at its first wait");
  std::mt19937 rng(static_cast<unsigned>(comm.rank()) * 7919u + 1u);
  if (comm.rank() % 3 == 2) {
    for (auto& s : ss) {
      if (!s->run_to_end()) fail("run_to_end refused a schedule nobody else resumes");
      if (!s->done()) fail("run_to_end returned before the call did");
    }
  } else if (comm.rank() % 2 == 1) {
    std::exception_ptr err;
    std::thread t([&] {
      try {
        drive(ss, rng);
      } catch (...) {
        err = std::current_exception();
      }
    });
    t.join();
    if (err) std::rethrow_exception(err);
  } else {
    drive(ss, rng);
  }
  for (std::size_t i = 0; i < ss.size(); ++i) {
    if (ss[i]->error()) {
      try {
        std::rethrow_exception(ss[i]->error());
      } catch (const std::exception& e) {
        fail(cases[i].op + "[" + cases[i].algorithm + "] as a schedule: " + e.what());
      }
    }
  }
}

class Schedules : public ::testing::TestWithParam<int> {};

TEST_P(Schedules, EveryAlgorithmInFlightAtOnceCompletesCorrectly) {
  LoopbackWorld w(GetParam(), LoopMode::kRendezvous);
  expect_clean(w, w.run(every_algorithm_scheduled));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Schedules, ::testing::Range(1, 9));

// Fibers switch by jumps (no system call) unless the thread runs with a shadow stack, where every
// switch is a swapcontext(): the same schedules, all in flight and resumed across threads, made
// while swapcontext() is forced, must complete alike.
TEST(Schedules, SwitchingBySwapcontextCompletesEveryAlgorithm) {
  const bool jumps = coll::detail::fiber_switch_jumps();
  coll::detail::set_fiber_switch_jumps(false);
  struct Restore {
    bool jumps;
    ~Restore() { coll::detail::set_fiber_switch_jumps(jumps); }
  } restore{jumps};
  ASSERT_FALSE(coll::detail::fiber_switch_jumps());
  for (int n : {3, 5}) {
    LoopbackWorld w(n, LoopMode::kRendezvous);
    expect_clean(w, w.run(every_algorithm_scheduled));
  }
}

// A fiber whose call returned waits parked for the next schedule, which runs on it from the start
// (schedule.cpp, Fiber::loop); the cache keeps 32 of each switching mode and unmaps the rest.
// Each way: 80 schedules in turn, every third throwing, each must report its own outcome and
// release its captures as it ends; then, on 2 ranks, 48 barriers in flight at once per rank
// (more than the cache keeps, so some fibers end instead of parking) driven to their ends, and
// one more allreduce on what the cache kept.
void reuse_fibers() {
  for (int i = 0; i < 80; ++i) {
    auto held = std::make_shared<int>(i);
    std::weak_ptr<int> watch = held;
    int seen = -1;
    coll::Schedule s([&seen, held = std::move(held), i] {
      seen = *held;
      if (i % 3 == 0) throw std::runtime_error("call " + std::to_string(i) + " failed");
    });
    if (!s.done()) fail("a call that never waits did not finish in the constructor");
    if (seen != i) fail("call " + std::to_string(i) + " ran with " + std::to_string(seen));
    if (!watch.expired()) fail("call " + std::to_string(i) + " kept its captures after it ended");
    if ((i % 3 == 0) != static_cast<bool>(s.error()))
      fail("call " + std::to_string(i) + "'s error");
    if (s.error()) {
      try {
        std::rethrow_exception(s.error());
      } catch (const std::runtime_error& e) {
        if (std::string(e.what()) != "call " + std::to_string(i) + " failed")
          fail(std::string("another call's error: ") + e.what());
      }
    }
  }
  LoopbackWorld w(2, LoopMode::kRendezvous);
  expect_clean(w, w.run([](Communicator& comm) {
    std::vector<std::unique_ptr<coll::Schedule>> ss;
    for (std::uint32_t i = 0; i < 48; ++i) {
      coll::Context c;
      c.comm = &comm;
      c.tag = 100 + i;
      c.op_name = "barrier";
      c.deadline = Clock::now() + std::chrono::seconds(20);
      ss.push_back(std::make_unique<coll::Schedule>([c] { coll::barrier(c); }));
    }
    std::mt19937 rng(static_cast<unsigned>(comm.rank()) + 3u);
    drive(ss, rng);
    for (auto& s : ss) {
      if (s->error()) std::rethrow_exception(s->error());
    }
    coll::Context c;
    c.comm = &comm;
    c.tag = 200;
    c.op_name = "allreduce";
    c.deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<float> v(3, static_cast<float>(comm.rank() + 1));
    coll::Schedule s(
        [&] { coll::allreduce(c, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum); });
    if (!s.wait(std::chrono::seconds(20))) fail("the allreduce did not finish");
    if (v != std::vector<float>(3, 3.0f)) fail("the allreduce on a reused fiber is wrong");
  }));
}

TEST(Schedules, FibersAreReusedByLaterCalls) {
  const bool jumps = coll::detail::fiber_switch_jumps();
  struct Restore {
    bool jumps;
    ~Restore() { coll::detail::set_fiber_switch_jumps(jumps); }
  } restore{jumps};
  for (bool mode : {true, false}) {
    SCOPED_TRACE(mode ? "jumps" : "swapcontext");
    coll::detail::set_fiber_switch_jumps(mode);
    reuse_fibers();
  }
}

// Context::call_text need only live until the call starts: a schedule's caller goes on (the
// torch backend builds it in a buffer its next call overwrites). Each rank overwrites its text
// once its allreduce has suspended; the ranks' calls differ (4 and 6 elements), and each rank's
// error must still describe its own call with its original text. (Before Exchange copied the
// text, the error read the overwritten buffer.)
TEST(Schedules, CallTextIsTheCallersAtTheStart) {
  LoopbackWorld w(2, LoopMode::kRendezvous);
  const auto errors = w.run([](Communicator& comm) {
    char text[64];
    std::snprintf(text, sizeof text, "%s", comm.rank() == 0 ? "four floats" : "six floats");
    coll::Context c;
    c.comm = &comm;
    c.tag = 11;
    c.op_name = "allreduce";
    c.call_text = text;
    c.deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<float> v(comm.rank() == 0 ? 4 : 6, 1.0f);
    coll::Schedule s(
        [&] { coll::allreduce(c, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum); });
    if (s.done()) fail("the call did not suspend");
    std::snprintf(text, sizeof text, "%s", "overwritten by the next call");
    try {
      s.wait(std::chrono::seconds(20));
      fail("calls of 4 and 6 elements completed");
    } catch (const Error& e) {
      const std::string msg = e.what();
      const std::string mine = comm.rank() == 0 ? "four floats" : "six floats";
      if (e.code() != Errc::kCallMismatch) fail("not a call mismatch: " + msg);
      if (msg.find("this rank is in allreduce") == std::string::npos ||
          msg.find(mine) == std::string::npos || msg.find("overwritten") != std::string::npos)
        fail("the error does not describe this rank's call as it started: " + msg);
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// A schedule keeps what its call threw (a size mismatch on every rank here) for error() and
// wait(); a call whose peer never comes fails at its deadline, driven by wait().
TEST(Schedules, FailuresAreKeptAndRethrown) {
  LoopbackWorld w(2, LoopMode::kEager);
  const auto errors = w.run([](Communicator& comm) {
    coll::Context c;
    c.comm = &comm;
    c.tag = 5;
    c.op_name = "allreduce";
    c.deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<float> v(comm.rank() == 0 ? 4 : 6, 1.0f);
    coll::Schedule s(
        [&] { coll::allreduce(c, v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum); });
    try {
      s.wait(std::chrono::seconds(20));
      fail("a size mismatch completed");
    } catch (const Error& e) {
      if (e.code() != Errc::kCallMismatch && e.code() != Errc::kTruncated)
        fail(std::string("unexpected error: ") + e.what());
    }
    if (!s.done() || !s.error()) fail("done() / error() do not report the failure");
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");

  LoopbackWorld late(2, LoopMode::kRendezvous);
  const auto late_errors = late.run([](Communicator& comm) {
    if (comm.rank() == 1) return;  // never joins
    coll::Context c;
    c.comm = &comm;
    c.tag = 9;
    c.op_name = "barrier";
    c.deadline = Clock::now() + std::chrono::milliseconds(300);
    const auto t0 = Clock::now();
    coll::Schedule s([&] { coll::barrier(c); });
    if (s.done()) fail("a barrier without its peer finished at once");
    try {
      s.wait(std::chrono::seconds(20));
      fail("a barrier without its peer completed");
    } catch (const Error& e) {
      if (std::string(e.what()).find("barrier") == std::string::npos)
        fail(std::string("the error does not name the call: ") + e.what());
    }
    if (Clock::now() - t0 > std::chrono::seconds(10))
      fail("the failure came long after the deadline");
  });
  for (const auto& e : late_errors) EXPECT_EQ(e, "");
}

// ---- the loopback channel itself ---------------------------------------------------------------

detail::Channel& chan(Communicator& c) { return detail::channel(c); }

Request post_send(Communicator& c, const void* data, std::size_t bytes, int peer,
                  std::uint32_t tag) {
  const Buffer b{const_cast<void*>(data), bytes, MemoryType::kHost};
  return chan(c).post_send(&b, 1, peer, TagKind::kInternal, tag);
}
Request post_recv(Communicator& c, void* data, std::size_t bytes, int peer, std::uint32_t tag) {
  const Buffer b{data, bytes, MemoryType::kHost};
  return chan(c).post_recv(&b, 1, peer, TagKind::kInternal, tag);
}

// A deliberately broken two-rank exchange: each rank sends (and waits for its send) before it
// receives. Over UCX this passes for small messages (eager sends complete at once) and hangs for
// large ones; an eager world passes it too, a rendezvous world deadlocks at any size and says so
// on every rank.
void send_before_recv(Communicator& c) {
  std::int32_t out = c.rank(), in = -1;
  const int peer = 1 - c.rank();
  post_send(c, &out, sizeof out, peer, 7).wait();
  post_recv(c, &in, sizeof in, peer, 7).wait();
  CX_CHECK_EQ(in, peer);
}

TEST(Loopback, BrokenExchangeIsReportedAsDeadlockOnEveryRank) {
  LoopbackWorld w(2, LoopMode::kRendezvous);
  const auto errors = w.run(send_before_recv);
  EXPECT_EQ(w.deadlocks(), 1);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("deadlock"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 0 waits for send to peer 1, tag 7 (internal), 4 bytes"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("rank 1 waits for send to peer 0, tag 7 (internal), 4 bytes"),
              std::string::npos)
        << e;
  }
  // The sends were left posted (the broken code does not cancel them): shutdown had to.
  EXPECT_NE(w.unmatched().find("cancelled at shutdown: send to peer 1, tag 7"), std::string::npos)
      << w.unmatched();
  // The same code over an eager world completes: only the rendezvous world catches it.
  LoopbackWorld eager(2, LoopMode::kEager);
  expect_clean(eager, eager.run(send_before_recv));
}

// The deadlock report reaches the real collectives: a rank that never joins a barrier while the
// others wait is not a deadlock until it leaves; then the others fail naming the barrier.
TEST(Loopback, CollectiveWaitingForARankThatLeftFailsAsDeadlock) {
  LoopbackWorld w(3, LoopMode::kRendezvous);
  const auto errors = w.run([](Communicator& c) {
    if (c.rank() == 2) return;  // never joins
    coll::Context ctx;
    ctx.comm = &c;
    ctx.tag = 1;
    ctx.op_name = "barrier";
    coll::barrier(ctx);
  });
  EXPECT_EQ(errors[2], "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[static_cast<std::size_t>(r)].find("commux barrier:"), std::string::npos)
        << errors[static_cast<std::size_t>(r)];
    EXPECT_NE(errors[static_cast<std::size_t>(r)].find("deadlock"), std::string::npos)
        << errors[static_cast<std::size_t>(r)];
  }
  EXPECT_GE(w.deadlocks(), 1);
  // The barrier cancelled what it had posted before it threw: nothing is left posted.
  EXPECT_EQ(w.unmatched().find("never matched: recv"), std::string::npos) << w.unmatched();
}

// A send nobody receives is reported as unmatched (an eager send completes, so nobody waits).
TEST(Loopback, SendNeverReceivedIsUnmatched) {
  LoopbackWorld w(2, LoopMode::kEager);
  const auto errors = w.run([](Communicator& c) {
    const std::int32_t x = 5;
    if (c.rank() == 0) post_send(c, &x, sizeof x, 1, 3).wait();
  });
  EXPECT_EQ(errors, std::vector<std::string>(2, ""));
  EXPECT_EQ(w.unmatched(),
            "never matched: send to peer 1, tag 3 (internal), 4 bytes, rank 0 of 2\n");
}

TEST(Loopback, MatchingOrderAnySourceTruncationAndBuffers) {
  LoopbackWorld w(3, LoopMode::kRendezvous);
  const auto errors = w.run([](Communicator& c) {
    if (c.rank() == 1) {
      // Two messages on one (sender, tag) match in posting order; another tag is apart.
      const std::int32_t a = 10, b = 20, other = 30;
      Request r1 = post_send(c, &a, 4, 0, 1);
      Request r2 = post_send(c, &b, 4, 0, 1);
      Request r3 = post_send(c, &other, 4, 0, 2);
      r1.wait();
      r2.wait();
      r3.wait();
      // Zero bytes, then a gathered message of three buffers, then one too long.
      post_send(c, nullptr, 0, 0, 4).wait();
      char p1[] = "ab", p2[] = "cde", p3[] = "f";
      const Buffer parts[3] = {{p1, 2, MemoryType::kHost},
                               {p2, 3, MemoryType::kHost},
                               {p3, 1, MemoryType::kHost}};
      chan(c).post_send(parts, 3, 0, TagKind::kInternal, 5).wait();
      const char big[8] = {};
      post_send(c, big, sizeof big, 0, 6).wait();
    } else if (c.rank() == 2) {
      const std::int32_t x = 99;
      post_send(c, &x, 4, 0, 9).wait();
    } else {
      std::int32_t other = 0, first = 0, second = 0, any = 0;
      Request ro = post_recv(c, &other, 4, 1, 2);
      Request r1 = post_recv(c, &first, 4, 1, 1);
      Request r2 = post_recv(c, &second, 4, 1, 1);
      Request ra = post_recv(c, &any, 4, kAnySource, 9);
      ro.wait();
      r1.wait();
      r2.wait();
      ra.wait();
      CX_CHECK_EQ(other, 30);
      CX_CHECK_EQ(first, 10);
      CX_CHECK_EQ(second, 20);
      CX_CHECK_EQ(any, 99);
      CX_CHECK_EQ(ra.source(), 2);
      Request z = post_recv(c, nullptr, 0, 1, 4);
      z.wait();
      CX_CHECK_EQ(z.bytes(), 0u);
      char q1[4] = {}, q2[3] = {};
      const Buffer into[2] = {{q1, 4, MemoryType::kHost}, {q2, 3, MemoryType::kHost}};
      Request g = chan(c).post_recv(into, 2, 1, TagKind::kInternal, 5);
      g.wait();
      CX_CHECK_EQ(g.bytes(), 6u);
      CX_CHECK_EQ(std::string(q1, 4) + std::string(q2, 2), "abcdef");
      char small[4];
      Request t = post_recv(c, small, sizeof small, 1, 6);
      const std::string msg = expect_error(Errc::kTruncated, [&] { t.wait(); });
      CX_CHECK_HAS(msg,
                   "message from peer 1 with tag 6 is too long: 8 bytes for a receive of 4 bytes");
      // User-tag traffic of the public API never matches internal traffic of the same number.
      std::int32_t u = 0;
      Request internal = post_recv(c, &u, 4, 2, 9);
      internal.cancel();
      CX_CHECK_HAS(expect_error(Errc::kCanceled, [&] { internal.wait(); }),
                   "canceled (recv from peer 2, tag 9 (internal)");
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(3, ""));
  EXPECT_EQ(w.unmatched(), "");
  EXPECT_EQ(w.deadlocks(), 0);
  // The trace of rank 2: one post and one wait of its send.
  const auto t = w.trace(2);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].what, TraceEvent::Kind::kPost);
  EXPECT_EQ(t[1].what, TraceEvent::Kind::kWait);
  EXPECT_EQ(t[0].dir, detail::Direction::kSend);
  EXPECT_EQ(t[0].peer, 0);
  EXPECT_EQ(t[0].tag, 9u);
  EXPECT_EQ(t[0].bytes, 4u);
}

TEST(Loopback, WaitRespectsItsTimeout) {
  LoopbackWorld w(2, LoopMode::kRendezvous);
  const auto errors = w.run([](Communicator& c) {
    if (c.rank() == 1) return;
    std::int32_t x = 0;
    Request r = c.irecv(Buffer{&x, 4, MemoryType::kHost}, 1, 3);
    // Rank 1 is still live (not yet left) or gone: either way the wait ends, by timeout or deadlock.
    const std::string msg =
        expect_error(Errc::kTimeout, [&] { r.wait(std::chrono::milliseconds(50)); });
    CX_CHECK_HAS(msg, "from peer 1, tag 3");
    r.cancel();
  });
  EXPECT_EQ(errors, std::vector<std::string>(2, ""));
  EXPECT_EQ(w.unmatched(), "");
}

// ---- every collective over eager worlds ----------------------------------------------------------

template <class T>
void allreduce_every_op(Caller& k, DataType t) {
  const std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin,
                                     ReduceOp::kMax, ReduceOp::kBand,    ReduceOp::kBor,
                                     ReduceOp::kBxor};
  const bool integral = !is_floating(t) && !is_complex(t);
  for (ReduceOp op : ops) {
    if (!integral && (op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor))
      continue;
    // Small magnitudes, so products of up to 5 ranks stay exact (and in range for int8).
    auto contrib = [](int r, std::size_t i) {
      return static_cast<T>((static_cast<int>(i) + 2 * r) % 5 - 2);
    };
    for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{37}}) {
      check_allreduce<T>(k, count, t, op, contrib);
    }
  }
}

void every_collective(Communicator& comm) {
  Caller k{comm, nullptr, 1, {}};
  const int n = k.n();
  const auto un = static_cast<std::size_t>(n);
  coll::barrier(k.ctx("barrier"));
  allreduce_every_op<std::int32_t>(k, DataType::kInt32);
  allreduce_every_op<std::int8_t>(k, DataType::kInt8);
  allreduce_every_op<float>(k, DataType::kFloat32);
  allreduce_every_op<double>(k, DataType::kFloat64);
  for (int root = 0; root < n; ++root) {
    check_broadcast(k, 13, root);
    check_reduce(k, 11, root);
    check_gather_scatter(k, 6, root);
  }
  check_allgatherv(k, std::vector<std::size_t>(un, 4));
  std::vector<std::size_t> counts(un);
  for (int p = 0; p < n; ++p)
    counts[static_cast<std::size_t>(p)] = static_cast<std::size_t>((p * 3) % 4);
  check_allgatherv(k, counts);
  check_reduce_scatter(k, std::vector<std::size_t>(un, 3));
  for (int p = 0; p < n; ++p)
    counts[static_cast<std::size_t>(p)] = static_cast<std::size_t>((p * 5 + 1) % 4);
  check_reduce_scatter(k, counts);
  check_alltoallv(k, 0);
  check_alltoallv(k, 2);
  coll::barrier(k.ctx("barrier"));
}

TEST(Loopback, EveryCollectiveOverEagerWorlds) {
  for (int n : {1, 2, 3, 5}) {
    SCOPED_TRACE("world size " + std::to_string(n));
    LoopbackWorld w(n, LoopMode::kEager);
    expect_clean(w, w.run(every_collective));
  }
}

// Ranks that disagree on the size of a collective fail, every one of them, naming the operation;
// nothing hangs and nothing is left posted.
TEST(Loopback, MismatchedSizesFailEveryRank) {
  for (LoopMode mode : {LoopMode::kEager, LoopMode::kRendezvous}) {
    LoopbackWorld w(2, mode);
    const auto errors = w.run([](Communicator& c) {
      Caller k{c, nullptr, 1, {}};
      // Rank 0 sends 1 byte to rank 1 and expects 1 back; rank 1 sends and expects 2.
      const std::size_t mine = c.rank() == 0 ? 1 : 2;
      std::vector<std::size_t> counts = {mine, mine}, displs = {0, mine};
      std::vector<unsigned char> in(2 * mine, 1), out(2 * mine, 0);
      coll::alltoallv(k.ctx("alltoallv"), in.data(), counts.data(), displs.data(), out.data(),
                      counts.data(), displs.data());
    });
    for (std::size_t r = 0; r < errors.size(); ++r) {
      EXPECT_NE(errors[r].find("commux alltoallv:"), std::string::npos)
          << "rank " << r << ": " << errors[r];
    }
    EXPECT_EQ(w.deadlocks(), 0);
    EXPECT_EQ(w.unmatched().find("never matched: recv"), std::string::npos) << w.unmatched();
  }
}

}  // namespace

// ---- cross-rank call checks ----------------------------------------------------------------------

namespace {

coll::Context call_ctx(Communicator& c, std::uint32_t tag, const char* op) {
  coll::Context ctx;
  ctx.comm = &c;
  ctx.tag = tag;
  ctx.op_name = op;
  ctx.deadline = Clock::now() + std::chrono::seconds(20);
  return ctx;
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Both ranks run `body`; then a correct allreduce (tag 2, after dropping call 1's leftovers)
// must give the right sum on both: the failed call leaves nothing that pairs with a later one.
std::vector<std::string> mismatched_then_healthy(LoopMode mode,
                                                 const std::function<void(Communicator&)>& body) {
  LoopbackWorld w(2, mode);
  std::vector<std::string> first(2);
  const auto errors = w.run([&](Communicator& c) {
    try {
      body(c);
    } catch (const Error& e) {
      first[static_cast<std::size_t>(c.rank())] =
          std::string(errc_name(e.code())) + ": " + e.what();
    }
    coll::discard_call(call_ctx(c, 1, "drop"));
    std::vector<float> x(64, static_cast<float>(c.rank() + 1));
    coll::allreduce(call_ctx(c, 2, "allreduce"), x.data(), x.size(), DataType::kFloat32,
                    ReduceOp::kSum);
    for (float v : x) {
      if (v != 3.0f) throw std::runtime_error("the allreduce after the mismatch is wrong");
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  return first;
}

}  // namespace

class CallChecks : public ::testing::TestWithParam<LoopMode> {};

// Rank 0 reduces 1000 floats while rank 1 broadcasts 1000 floats from rank 0: before the call
// checks, rank 1's broadcast took rank 0's data and returned success.
TEST_P(CallChecks, ACollectiveOfAnotherKindFailsOnBothRanksNamingBothCalls) {
  const auto errs = mismatched_then_healthy(GetParam(), [](Communicator& c) {
    std::vector<float> x(1000, 1.0f);
    if (c.rank() == 0) {
      coll::allreduce(call_ctx(c, 1, "allreduce"), x.data(), x.size(), DataType::kFloat32,
                      ReduceOp::kSum);
    } else {
      coll::broadcast(call_ctx(c, 1, "broadcast"), x.data(), x.size() * 4, 0);
    }
  });
  EXPECT_TRUE(has(errs[0], "call mismatch")) << errs[0];
  EXPECT_TRUE(has(errs[0], "rank 1 is in broadcast #1 (4000 bytes from root 0")) << errs[0];
  EXPECT_TRUE(has(errs[0], "this rank is in allreduce #1 (1000 float32 SUM")) << errs[0];
  EXPECT_TRUE(has(errs[1], "call mismatch")) << errs[1];
  EXPECT_TRUE(has(errs[1], "rank 0 is in allreduce #1 (1000 float32 SUM")) << errs[1];
  EXPECT_TRUE(has(errs[1], "this rank is in broadcast #1")) << errs[1];
}

// Same bytes, different element types: garbage on both ranks before.
TEST_P(CallChecks, SameBytesOfAnotherDataTypeFailOnBothRanks) {
  const auto errs = mismatched_then_healthy(GetParam(), [](Communicator& c) {
    if (c.rank() == 0) {
      std::vector<float> x(200, 1.0f);
      coll::allreduce(call_ctx(c, 1, "allreduce"), x.data(), x.size(), DataType::kFloat32,
                      ReduceOp::kSum);
    } else {
      std::vector<double> x(100, 1.0);
      coll::allreduce(call_ctx(c, 1, "allreduce"), x.data(), x.size(), DataType::kFloat64,
                      ReduceOp::kSum);
    }
  });
  EXPECT_TRUE(has(errs[0], "200 float32 SUM") && has(errs[0], "100 float64 SUM")) << errs[0];
  EXPECT_TRUE(has(errs[1], "200 float32 SUM") && has(errs[1], "100 float64 SUM")) << errs[1];
}

// Ranks that force different algorithms would exchange messages that do not fit each other.
TEST_P(CallChecks, DifferentAlgorithmsOfOneCollectiveFailOnBothRanks) {
  const auto errs = mismatched_then_healthy(GetParam(), [](Communicator& c) {
    std::vector<float> x(1u << 15, 1.0f);
    coll::Context ctx = call_ctx(c, 1, "allreduce");
    ctx.algorithm = c.rank() == 0 ? "ring" : "halves";
    coll::allreduce(ctx, x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
  });
  EXPECT_TRUE(has(errs[0], "ring") && has(errs[0], "halves")) << errs[0];
  EXPECT_TRUE(has(errs[1], "ring") && has(errs[1], "halves")) << errs[1];
}

// A rank that rejects its own call tells the others: their call fails at once naming it and the
// reason, instead of pairing with that rank's next call.
TEST_P(CallChecks, ACallRejectedOnOneRankFailsTheOthersWithItsReason) {
  const auto errs = mismatched_then_healthy(GetParam(), [](Communicator& c) {
    std::vector<float> x(16, 1.0f);
    float* buf = c.rank() == 1 ? nullptr : x.data();
    coll::allreduce(call_ctx(c, 1, "allreduce"), buf, x.size(), DataType::kFloat32, ReduceOp::kSum);
  });
  EXPECT_TRUE(has(errs[1], "invalid argument")) << errs[1];
  EXPECT_TRUE(has(errs[0], "call mismatch")) << errs[0];
  EXPECT_TRUE(has(errs[0], "rank 1 rejected its call allreduce #1: buf is null")) << errs[0];
}

// Context::poll: what it throws stops the collective on its rank, unchanged, and the other rank's
// call fails at once saying so (the torch backend's Ctrl-C in a collective run on the caller's
// thread). Rank 1 joins late, so rank 0 waits long enough to poll.
TEST_P(CallChecks, WhatPollThrowsStopsTheCallOnEveryRank) {
  struct Stopped {};
  bool stopped = false;
  bool completed = false;
  const auto errs = mismatched_then_healthy(GetParam(), [&](Communicator& c) {
    std::vector<float> x(1000, 1.0f);
    coll::Context ctx = call_ctx(c, 1, "allreduce");
    if (c.rank() == 0) {
      ctx.poll = [] { throw Stopped{}; };
      try {
        coll::allreduce(ctx, x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      } catch (const Stopped&) {
        stopped = true;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      coll::allreduce(ctx, x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      // Eager: rank 0's one message was sent before it stopped, and it is all rank 1 needs.
      if (std::any_of(x.begin(), x.end(), [](float v) { return v != 2.0f; })) {
        throw std::runtime_error("rank 1 completed the call with a wrong sum");
      }
      completed = true;
    }
  });
  EXPECT_TRUE(stopped);
  EXPECT_EQ(errs[0], "");
  if (GetParam() == LoopMode::kEager && completed) return;
  EXPECT_TRUE(has(errs[1], "call mismatch")) << errs[1];
  EXPECT_TRUE(has(errs[1], "rank 0 is in allreduce #1 (1000 float32 SUM")) << errs[1];
  EXPECT_TRUE(has(errs[1], "its caller stopped the call on that rank")) << errs[1];
}

INSTANTIATE_TEST_SUITE_P(Modes, CallChecks,
                         ::testing::Values(LoopMode::kEager, LoopMode::kRendezvous),
                         [](const ::testing::TestParamInfo<LoopMode>& p) {
                           return p.param == LoopMode::kEager ? "Eager" : "Rendezvous";
                         });

// The channel's default post_after (the loopback world has no progress path of its own): it waits
// for the gate on the caller's thread, then posts; a gate that stays shut past the channel's
// timeout is a timeout naming the operation and what it waited for, with nothing posted.
TEST(Channel, DefaultPostAfterWaitsForTheGateThenPosts) {
  struct FlagGate final : detail::Gate {
    std::atomic<bool> flag{false};
    bool open() override { return flag.load(); }
    std::string describe() const override { return "the test flag"; }
  };
  Options quick = LoopbackWorld::default_options();
  quick.timeout = std::chrono::milliseconds(200);
  LoopbackWorld w(2, LoopMode::kRendezvous, quick);
  const auto errors = w.run([](Communicator& comm) {
    auto& ch = detail::channel(comm);
    std::vector<int> v(8, comm.rank() == 0 ? 7 : 0);
    Buffer b{v.data(), v.size() * sizeof(int)};
    if (comm.rank() == 0) {
      auto gate = std::make_shared<FlagGate>();
      std::thread opener([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        gate->flag = true;
      });
      Request r = ch.post_after(gate, detail::Direction::kSend, "isend", &b, 1, 1, TagKind::kUser,
                                3, false);
      opener.join();
      r.wait();
      auto shut = std::make_shared<FlagGate>();
      try {
        ch.post_after(shut, detail::Direction::kSend, "isend", &b, 1, 1, TagKind::kUser, 4, false);
        fail("a gate that never opened posted");
      } catch (const Error& e) {
        const std::string m = e.what();
        if (e.code() != Errc::kTimeout || m.find("isend") == std::string::npos ||
            m.find("the test flag; nothing was posted") == std::string::npos)
          fail("unexpected error: " + m);
      }
    } else {
      ch.post_recv(&b, 1, 0, TagKind::kUser, 3).wait();
      for (int x : v)
        if (x != 7) fail("received " + std::to_string(x));
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}
