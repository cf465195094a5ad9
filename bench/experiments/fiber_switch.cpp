// fiber_switch: what a coll::Schedule's fiber switch costs, jumps (sigsetjmp/siglongjmp, the
// default) against swapcontext() (which sets the signal mask, a system call, on every switch),
// in one run: 2 ranks forked on this host, each running rounds of 8-byte allreduces as schedules
// waited at once (each suspends at its waits and is resumed as its messages arrive), the two
// switching modes alternating round by round (both ranks alike), beside the same allreduces
// called blocking (no fiber) as the floor.
//
//   scripts/build.sh build            (builds it as build/bench/fiber_switch)
//   UCX_NET_DEVICES=lo build/bench/fiber_switch [ROUNDS] [CALLS]       (default 20 2000)
//
// Prints rank 0's median µs per call over the rounds of each mode, and the median of the rounds'
// ratios jump / swapcontext. Every result is checked (a wrong sum fails the run).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "commux/collectives.hpp"
#include "commux/communicator.hpp"
#include "commux/store.hpp"
#include "forked_ranks.hpp"
#include "schedule.hpp"

namespace {

using Clock = std::chrono::steady_clock;

using commux_bench::median;

int rank_main(const std::string& dir, int rank, int rounds, int calls) {
  commux::Communicator comm(std::make_shared<commux::FileStore>(dir), rank, 2);
  std::uint32_t tag = 1;
  std::vector<float> v(2);
  int wrong = 0;
  // kind 0: blocking; 1: schedule, jumps; 2: schedule, swapcontext
  auto run = [&](int kind) {
    const auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) {
      commux::coll::Context c;
      c.comm = &comm;
      c.tag = tag++;
      c.deadline = Clock::now() + std::chrono::seconds(30);
      c.op_name = "allreduce";
      v.assign(2, static_cast<float>(rank + 1));
      auto call = [&] {
        commux::coll::allreduce(c, v.data(), v.size(), commux::DataType::kFloat32,
                                commux::ReduceOp::kSum);
      };
      if (kind == 0) {
        call();
      } else {
        commux::coll::Schedule s(call);
        if (!s.wait(std::chrono::seconds(30))) {
          throw std::runtime_error("allreduce #" + std::to_string(i) +
                                   " as a schedule did not finish within 30 s");
        }
      }
      if (v[0] != 3.0f || v[1] != 3.0f) ++wrong;
    }
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / calls;
  };
  std::vector<double> t[3], ratio;
  for (int r = 0; r < rounds + 1; ++r) {  // round 0 warms up
    double us[3];
    for (int kind : {0, 1, 2}) {
      commux::coll::detail::set_fiber_switch_jumps(kind != 2);
      us[kind] = run(kind);
    }
    if (r == 0) continue;
    for (int kind : {0, 1, 2}) t[kind].push_back(us[kind]);
    ratio.push_back(us[1] / us[2]);
  }
  if (rank == 0) {
    std::printf(
        "2 ranks, 8 B allreduce, %d rounds of %d calls each way; µs per call (rank 0, median):\n"
        "  blocking %.2f | schedule, jumps %.2f | schedule, swapcontext %.2f | jumps / "
        "swapcontext %.3f (median of the rounds' ratios)\n",
        rounds, calls, median(t[0]), median(t[1]), median(t[2]), median(ratio));
  }
  if (wrong > 0) std::fprintf(stderr, "rank %d: %d wrong results\n", rank, wrong);
  return wrong > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  const int calls = argc > 2 ? std::atoi(argv[2]) : 2000;
  if (rounds < 1 || calls < 1) return 2;
  commux::coll::detail::set_fiber_switch_jumps(true);
  if (!commux::coll::detail::fiber_switch_jumps()) {
    std::fprintf(stderr, "fiber_switch: this thread has a shadow stack: fibers never jump here\n");
    return 2;
  }
  return commux_bench::run_forked_ranks(2, "commux_fiber", [&](const std::string& dir, int rank) {
    return rank_main(dir, rank, rounds, calls);
  });
}
