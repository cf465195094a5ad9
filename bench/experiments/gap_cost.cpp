// gap_cost: what a pause between a rank's blocking collectives costs beyond the pause itself,
// through the C++ API alone: 2 ranks forked on this host run N blocking allreduces of each size
// back to back, then with work between calls, in the same run:
//   spin  G µs of spinning, touching nothing;
//   walk  a walk over TOUCH bytes of other memory (an interpreter's data footprint);
//   code  a run through about 160 KiB of distinct code, 2048 small functions (an interpreter's
//         code footprint: it pushes commux's and UCX's code out of the instruction cache).
// A torch-level call pays torch's own few microseconds of Python and C++ between the backend's
// calls: this says how much of the torch-level time beyond the C++ API's (bench/coll_bench.py,
// ucx−noop) such a pause accounts for, with no torch code involved.
//
//   scripts/build.sh build            (builds it as build/bench/gap_cost)
//   UCX_NET_DEVICES=lo build/bench/gap_cost [GAP_US] [TOUCH_BYTES] [ROUNDS]
//                                     (default 3.5 262144 5)
//
// Prints rank 0's medians over rounds of µs per call: back to back; with each pause, less the
// pause's own time measured alone; and the differences from back to back (what the pause adds).
// The allreduce is a MAX of 1 and 2, so every call's result is the same: each is checked (a wrong
// element fails the run).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commux/collectives.hpp"
#include "commux/communicator.hpp"
#include "commux/store.hpp"
#include "forked_ranks.hpp"

namespace {

using Clock = std::chrono::steady_clock;

using commux_bench::median;

struct Args {
  double gap_us = 3.5;
  std::size_t touch = 262144;
  int rounds = 5;
};

void spin(double us) {
  const auto until = Clock::now() + std::chrono::duration<double, std::micro>(us);
  while (Clock::now() < until) {
  }
}

volatile unsigned long g_sink = 0;

void walk(const std::vector<unsigned char>& mem) {
  unsigned long s = 0;
  for (std::size_t i = 0; i < mem.size(); i += 64) s += mem[i];
  g_sink = g_sink + s;
}

// One of kPieces distinct small functions (their constants differ, so none is folded into
// another): a run through all of them executes about 160 KiB of code once (their symbols span
// 160 KiB in the project's build: nm -S build/bench/gap_cost).
constexpr std::size_t kPieces = 2048;

template <std::size_t N>
__attribute__((noinline)) unsigned long code_piece(unsigned long x) {
  x = x * 0x9E3779B97F4A7C15ul + N;
  x ^= x >> (N % 23 + 7);
  x = x * (2 * N + 1);
  x ^= x << (N % 11 + 3);
  x += N * 0x2545F4914F6CDD1Dul;
  x ^= x >> (N % 13 + 5);
  return x;
}

template <std::size_t... I>
unsigned long code_run(unsigned long x, std::index_sequence<I...>) {
  ((x = code_piece<I>(x)), ...);
  return x;
}

void code_walk() { g_sink = g_sink + code_run(g_sink, std::make_index_sequence<kPieces>{}); }

int rank_main(const std::string& dir, int rank, const Args& a) {
  commux::Communicator comm(std::make_shared<commux::FileStore>(dir), rank, 2);
  std::uint32_t tag = 1;
  long wrong = 0;
  std::vector<unsigned char> other(a.touch, 1);
  if (rank == 0) {
    std::printf(
        "2 ranks, blocking allreduce (float32 MAX), µs per call (rank 0, median of %d rounds); "
        "pauses: %.1f µs spin, a walk over %zu B, a run through %zu functions\n",
        a.rounds, a.gap_us, a.touch, kPieces);
    std::printf(
        "| bytes | back to back | spin: call | walk: call | code: call | spin adds | walk adds | "
        "code adds |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (std::size_t bytes : {8, 512, 4096, 32768, 262144}) {
    const std::size_t n = std::max<std::size_t>(1, bytes / sizeof(float));
    std::vector<float> buf(n);
    const int iters = bytes <= 32768 ? 2000 : 400;
    auto call = [&] {
      commux::coll::Context c;
      c.comm = &comm;
      c.tag = tag++;
      c.op_name = "allreduce";
      commux::coll::allreduce(c, buf.data(), n, commux::DataType::kFloat32, commux::ReduceOp::kMax);
    };
    // 0: back to back; 1, 2, 3: with the spin, the walk, the code; 4, 5, 6: each pause alone.
    auto timed = [&](int way) {
      std::fill(buf.begin(), buf.end(), static_cast<float>(rank + 1));
      commux::coll::barrier([&] {
        commux::coll::Context c;
        c.comm = &comm;
        c.tag = tag++;
        return c;
      }());
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        if (way < 4) call();
        if (way == 1 || way == 4) spin(a.gap_us);
        if (way == 2 || way == 5) walk(other);
        if (way == 3 || way == 6) code_walk();
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (way < 4) {  // MAX of 1 and 2, every call: the same result however many ran
        for (float x : buf) wrong += x != 2.0f;
      }
      return us / iters;
    };
    std::vector<double> t[7];
    for (int r = 0; r < a.rounds + 1; ++r) {
      double us[7];
      for (int way = 0; way < 7; ++way) us[way] = timed(way);
      if (r == 0) continue;  // warm-up
      for (int way = 0; way < 7; ++way) t[way].push_back(us[way]);
    }
    const double b = median(t[0]), s = median(t[1]) - median(t[4]), w = median(t[2]) - median(t[5]),
                 c = median(t[3]) - median(t[6]);
    if (rank == 0) {
      std::printf("| %zu | %.2f | %.2f | %.2f | %.2f | %+.2f | %+.2f | %+.2f |\n", bytes, b, s, w,
                  c, s - b, w - b, c - b);
    }
  }
  if (wrong > 0) std::fprintf(stderr, "rank %d: %ld wrong results\n", rank, wrong);
  return wrong > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (argc > 1) a.gap_us = std::atof(argv[1]);
  if (argc > 2) a.touch = std::strtoull(argv[2], nullptr, 10);
  if (argc > 3) a.rounds = std::atoi(argv[3]);
  if (a.gap_us < 0 || a.touch < 64 || a.rounds < 1) {
    std::fprintf(stderr, "usage: gap_cost [GAP_US>=0] [TOUCH_BYTES>=64] [ROUNDS>=1]\n");
    return 2;
  }
  return commux_bench::run_forked_ranks(2, "commux_gap", [&](const std::string& dir, int rank) {
    return rank_main(dir, rank, a);
  });
}
