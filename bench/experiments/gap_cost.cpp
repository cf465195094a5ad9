// gap_cost: what a pause between a rank's blocking collectives costs beyond the pause itself,
// through the C++ API alone: 2 ranks forked on this host run N blocking allreduces of each size
// back to back, then with G µs of work between calls (a spin, touching nothing; or a walk over
// TOUCH bytes of other memory, as an interpreter between calls evicts the caches), in the same
// run. A torch-level call pays torch's own few microseconds between the backend's calls: this
// says how much of the torch-level time beyond the C++ API's (bench/coll_bench.py, ucx−noop)
// such a pause accounts for, with no torch code involved.
//
//   scripts/build.sh build            (builds it as build/bench/gap_cost)
//   UCX_NET_DEVICES=lo build/bench/gap_cost [GAP_US] [TOUCH_BYTES] [ROUNDS]
//                                     (default 3.5 262144 5)
//
// (MAX, so that every call's result is the same and checked.) Prints rank 0's medians over rounds of µs per call: back to back; with the spin, less the spin's
// own time measured alone; with the walk, less the walk's own time; and the two differences from
// back to back (the cost the pause adds). Every result is checked (a wrong sum fails the run).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
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

int rank_main(const std::string& dir, int rank, const Args& a) {
  commux::Communicator comm(std::make_shared<commux::FileStore>(dir), rank, 2);
  std::uint32_t tag = 1;
  long wrong = 0;
  std::vector<unsigned char> other(a.touch, 1);
  if (rank == 0) {
    std::printf(
        "2 ranks, blocking allreduce (float32 MAX), µs per call (rank 0, median of %d "
        "rounds); pause %.1f µs spin, or a walk over %zu B\n",
        a.rounds, a.gap_us, a.touch);
    std::printf(
        "| bytes | back to back | spin: call | walk: call | spin adds | walk adds |\n"
        "|---:|---:|---:|---:|---:|---:|\n");
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
    auto timed = [&](int way) {  // 0: back to back, 1: spin, 2: walk, 3: spin alone, 4: walk alone
      std::fill(buf.begin(), buf.end(), static_cast<float>(rank + 1));
      commux::coll::barrier([&] {
        commux::coll::Context c;
        c.comm = &comm;
        c.tag = tag++;
        return c;
      }());
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        if (way < 3) call();
        if (way == 1 || way == 3) spin(a.gap_us);
        if (way == 2 || way == 4) walk(other);
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (way < 3) {  // MAX of 1 and 2, every call: the same result however many ran
        for (float x : buf) wrong += x != 2.0f;
      }
      return us / iters;
    };
    std::vector<double> t[5];
    for (int r = 0; r < a.rounds + 1; ++r) {
      double us[5];
      for (int way = 0; way < 5; ++way) us[way] = timed(way);
      if (r == 0) continue;  // warm-up
      for (int way = 0; way < 5; ++way) t[way].push_back(us[way]);
    }
    const double b = median(t[0]), s = median(t[1]) - median(t[3]), w = median(t[2]) - median(t[4]);
    if (rank == 0) {
      std::printf("| %zu | %.2f | %.2f | %.2f | %+.2f | %+.2f |\n", bytes, b, s, w, s - b, w - b);
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
