// schedule_burst: whether several collectives in flight as coll::Schedules overlap, through the
// C++ API alone (no torch, no threads of the torch backend): 2 ranks forked on this host, each
// round running K allreduces of N bytes three ways, one after another, in the same run:
//   blocking  K blocking calls;
//   inorder   K schedules started back to back, then each waited in turn (Schedule::wait: only
//             the one waited for is resumed, the others' posted messages move meanwhile);
//   drive     K schedules started back to back, then one thread resumes whichever is ready
//             (test()) and sleeps on the first unfinished one (await()), as a driver of several
//             schedules does;
//   serial    K schedules one at a time, each started once the one before it is done and then
//             waited (Schedule::wait): what a schedule costs beyond the blocking call with
//             nothing else in flight, apart from what several in flight cost each other.
//
//   scripts/build.sh build            (builds it as build/bench/schedule_burst)
//   UCX_NET_DEVICES=lo build/bench/schedule_burst [BYTES] [K] [ROUNDS] [PASSES] [WAYS]
//                                     (default 65536 8 20 20 bids)
//
// WAYS: which ways run, of b(locking), i(norder), d(rive) and s(erial) (ratios to a way not run
// mean nothing; for profiling one way alone). A pass's time is its calls' alone: the inputs' refill
// and the results' check are outside it. Prints rank 0's median µs per pass of K calls for each way
// and the medians of the rounds' ratios to blocking (below 1: the calls in flight overlapped).
// Every result is checked (a wrong sum fails the run).

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

namespace {

using Clock = std::chrono::steady_clock;

using commux_bench::median;

struct Args {
  std::size_t bytes = 65536;
  int k = 8;
  int rounds = 20;
  int passes = 20;
  std::string ways = "bids";  // which ways run (b blocking, i inorder, d drive, s serial)
};

int rank_main(const std::string& dir, int rank, const Args& a) {
  commux::Communicator comm(std::make_shared<commux::FileStore>(dir), rank, 2);
  const std::size_t n = std::max<std::size_t>(1, a.bytes / sizeof(float));
  std::uint32_t tag = 1;
  std::vector<std::vector<float>> bufs(a.k, std::vector<float>(n));
  long wrong = 0;
  auto context = [&] {
    commux::coll::Context c;
    c.comm = &comm;
    c.tag = tag++;
    c.deadline = Clock::now() + std::chrono::seconds(30);
    c.op_name = "allreduce";
    return c;
  };
  auto check = [&] {
    for (auto& b : bufs) {
      for (float x : b) wrong += x != 3.0f;
    }
  };
  // way 0: blocking; 1: inorder; 2: drive; 3: serial. Returns the µs of the calls alone (from the
  // first call to the last one's end, schedules destroyed): not the refill and the check around
  // them.
  // One allreduce of `p` started as a schedule; waiting for one (Schedule::wait, bounded).
  auto start = [&](float* p) {
    auto c = context();
    return std::make_unique<commux::coll::Schedule>([c, p, n] {
      commux::coll::allreduce(c, p, n, commux::DataType::kFloat32, commux::ReduceOp::kSum);
    });
  };
  auto wait_one = [](commux::coll::Schedule& x, std::size_t i) {
    if (!x.wait(std::chrono::seconds(30))) {
      throw std::runtime_error("allreduce " + std::to_string(i) + " did not finish within 30 s");
    }
  };
  auto pass = [&](int way) {
    for (auto& b : bufs) std::fill(b.begin(), b.end(), static_cast<float>(rank + 1));
    const auto t0 = Clock::now();
    std::vector<std::unique_ptr<commux::coll::Schedule>> s;
    if (way == 0) {
      for (auto& b : bufs) {
        commux::coll::allreduce(context(), b.data(), n, commux::DataType::kFloat32,
                                commux::ReduceOp::kSum);
      }
    } else if (way == 3) {
      for (std::size_t i = 0; i < bufs.size(); ++i) wait_one(*start(bufs[i].data()), i);
    } else {
      for (auto& b : bufs) s.push_back(start(b.data()));
    }
    const auto until = Clock::now() + std::chrono::seconds(30);
    if (way == 1) {
      for (std::size_t i = 0; i < s.size(); ++i) wait_one(*s[i], i);
    } else if (way == 2) {
      for (;;) {
        const commux::coll::Schedule* first = nullptr;
        for (auto& x : s) {
          if (!x->test() && first == nullptr) first = x.get();
        }
        if (first == nullptr) break;
        if (Clock::now() > until) throw std::runtime_error("the burst did not finish in 30 s");
        if (!first->ready()) first->await(std::chrono::milliseconds(1));
      }
      for (auto& x : s) {
        if (x->error()) std::rethrow_exception(x->error());
      }
    }
    s.clear();
    const auto t1 = Clock::now();
    check();
    return std::chrono::duration<double, std::micro>(t1 - t0).count();
  };
  auto run = [&](int way) {
    double us = 0;
    for (int p = 0; p < a.passes; ++p) us += pass(way);
    return us / a.passes;
  };
  std::vector<double> t[4], ratio[4];
  for (int r = 0; r < a.rounds + 1; ++r) {  // round 0 warms up
    double us[4] = {1, 1, 1, 1};
    for (int way : {0, 1, 2, 3}) {
      if (a.ways.find("bids"[way]) != std::string::npos) us[way] = run(way);
    }
    if (r == 0) continue;
    for (int way : {0, 1, 2, 3}) {
      t[way].push_back(us[way]);
      ratio[way].push_back(us[way] / us[0]);
    }
  }
  if (rank == 0) {
    std::printf(
        "2 ranks, %d allreduces of %zu B per pass, %d rounds of %d passes; µs per pass "
        "(rank 0, median):\n  blocking %.1f | inorder %.1f | drive %.1f | serial %.1f | inorder / "
        "blocking %.3f | drive / blocking %.3f | serial / blocking %.3f (medians of the rounds' "
        "ratios)\n",
        a.k, n * sizeof(float), a.rounds, a.passes, median(t[0]), median(t[1]), median(t[2]),
        median(t[3]), median(ratio[1]), median(ratio[2]), median(ratio[3]));
  }
  if (wrong > 0) std::fprintf(stderr, "rank %d: %ld wrong elements\n", rank, wrong);
  return wrong > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (argc > 1) a.bytes = std::strtoull(argv[1], nullptr, 10);
  if (argc > 2) a.k = std::atoi(argv[2]);
  if (argc > 3) a.rounds = std::atoi(argv[3]);
  if (argc > 4) a.passes = std::atoi(argv[4]);
  if (argc > 5) a.ways = argv[5];
  if (a.bytes < 4 || a.k < 1 || a.rounds < 1 || a.passes < 1) {
    std::fprintf(stderr,
                 "usage: schedule_burst [BYTES>=4] [K>=1] [ROUNDS>=1] [PASSES>=1] [WAYS]\n");
    return 2;
  }
  return commux_bench::run_forked_ranks(2, "commux_burst", [&](const std::string& dir, int rank) {
    return rank_main(dir, rank, a);
  });
}
