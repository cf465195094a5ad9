// Shutdown racing other threads of the same process: Communicator::shutdown() called by one thread
// while others are blocked in Request::wait or are busy posting and waiting. Every thread must end
// with an error (Errc::kCanceled), not hang and not crash. These run in the `tsan` stage of
// scripts/test.sh (ThreadSanitizer) besides the ordinary C++ suites.
//
// The world is one rank (a receive from oneself on a tag nobody sends never matches), so the tests
// need no second process and no network.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "commux/collectives.hpp"
#include "commux/communicator.hpp"
#include "channel.hpp"
#include "commux/store.hpp"
#include "harness.hpp"

namespace commux::test {
namespace {

using Clock = std::chrono::steady_clock;
// How long a thread may take to notice the shutdown (a generous bound: TSan slows everything).
constexpr auto kDeadline = std::chrono::seconds(20);

// What a thread ended with.
struct Outcome {
  bool error = false;
  Errc code = Errc::kTransport;
  std::string message;
  std::chrono::milliseconds after_shutdown{0};
  std::size_t late_bytes = 0;  // bytes of a buffer written after its Request had completed
};

std::unique_ptr<Communicator> one_rank_world(const TempDir& dir) {
  Options o = default_test_options();
  o.timeout = std::chrono::seconds(60);  // far beyond the test: only shutdown can end the wait
  return std::make_unique<Communicator>(dir.store(), 0, 1, o);
}

// Waits for every future within kDeadline; a thread still running then is a hang, and the
// process exits at once (it cannot be joined, and a detached thread would outlive the test).
std::vector<Outcome> collect(std::vector<std::future<Outcome>>& futures,
                             std::vector<std::thread>& threads) {
  std::vector<Outcome> out;
  const auto until = Clock::now() + kDeadline;
  for (std::size_t i = 0; i < futures.size(); ++i) {
    if (futures[i].wait_until(until) != std::future_status::ready) {
      std::fprintf(stderr, "thread %zu still blocked %lld s after shutdown(): a hang\n", i,
                   static_cast<long long>(kDeadline.count()));
      std::fflush(stderr);
      std::_Exit(kHangExit);
    }
    out.push_back(futures[i].get());
  }
  for (auto& t : threads) t.join();
  return out;
}

// One thread is blocked in Request::wait on a receive that never matches; another thread calls
// shutdown(). The waiter gets Errc::kCanceled, naming the shutdown, soon after.
TEST(Threads, ShutdownWakesAThreadBlockedInWait) {
  TempDir dir;
  auto comm = one_rank_world(dir);
  std::atomic<bool> posted{false};
  std::atomic<Clock::rep> shutdown_at{0};
  std::vector<std::future<Outcome>> futures;
  std::vector<std::thread> threads;
  std::packaged_task<Outcome()> waiter([&] {
    Outcome o;
    std::vector<unsigned char> in(64);
    Request r = comm->irecv(Buffer{in.data(), in.size()}, 0, 7);
    posted.store(true);
    try {
      r.wait();
    } catch (const Error& e) {
      o.error = true;
      o.code = e.code();
      o.message = e.what();
    }
    o.after_shutdown = std::chrono::duration_cast<std::chrono::milliseconds>(
        Clock::now() - Clock::time_point(Clock::duration(shutdown_at.load())));
    return o;
  });
  futures.push_back(waiter.get_future());
  threads.emplace_back(std::move(waiter));
  while (!posted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Long enough for the waiter to stop spinning and go to sleep on the completion condition.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  shutdown_at.store(Clock::now().time_since_epoch().count());
  std::thread closer([&] { comm->shutdown(); });
  const std::vector<Outcome> out = collect(futures, threads);
  closer.join();
  ASSERT_TRUE(out[0].error) << "the wait returned normally after shutdown()";
  EXPECT_EQ(out[0].code, Errc::kCanceled) << out[0].message;
  EXPECT_NE(out[0].message.find("shut down"), std::string::npos) << out[0].message;
  EXPECT_LT(out[0].after_shutdown.count(), 10000) << "woken only after a long delay";
}

// A world of two ranks as threads of this process. On each rank, threads exchange messages with
// the other rank (64 KiB: a wait spins, completes, and hands progress back to the progress
// thread); on rank 0 one more thread is blocked on a receive that never matches. Then both
// communicators are shut down at once, each by its own thread. Every thread ends with an error:
// Errc::kCanceled (a wait on an operation that shutdown() finished, a post after it), or
// Errc::kPeerFailed where the other rank went first; the blocked one with kCanceled. Once its
// Requests have completed, no buffer may be written any more (a receive whose wait returned while
// UCX was still filling it, fragments on their way, wrote into freed memory).
// Repeated, so that shutdown() lands at different points of the others' loops.
TEST(Threads, ShutdownWhileOtherThreadsPostAndWait) {
  constexpr int kRounds = 4;
  constexpr int kBusy = 2;  // per rank
  constexpr std::size_t kBytes = std::size_t{64} << 10;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    TempDir dir;
    auto store = dir.store();
    std::unique_ptr<Communicator> comms[2];
    {
      Options o = default_test_options();
      o.timeout = std::chrono::seconds(60);
      std::thread r1([&] { comms[1] = std::make_unique<Communicator>(store, 1, 2, o); });
      comms[0] = std::make_unique<Communicator>(store, 0, 2, o);
      r1.join();
    }
    std::atomic<int> started{0};
    std::atomic<long> messages{0};
    std::atomic<bool> closed{false};
    std::vector<std::future<Outcome>> futures;
    std::vector<std::thread> threads;
    auto capture = [](Outcome& o, const Error& e) {
      o.error = true;
      o.code = e.code();
      o.message = e.what();
    };
    std::packaged_task<Outcome()> blocked([&] {
      Outcome o;
      std::vector<unsigned char> in(16);
      Request r = comms[0]->irecv(Buffer{in.data(), in.size()}, 0, 999999);
      started.fetch_add(1);
      try {
        r.wait();
      } catch (const Error& e) {
        capture(o, e);
      }
      return o;
    });
    futures.push_back(blocked.get_future());
    threads.emplace_back(std::move(blocked));
    for (int rank = 0; rank < 2; ++rank) {
      for (int t = 0; t < kBusy; ++t) {
        std::packaged_task<Outcome()> busy([&, rank, t] {
          Outcome o;
          Communicator& c = *comms[rank];
          std::vector<unsigned char> out(kBytes, static_cast<unsigned char>(t)), in(kBytes);
          started.fetch_add(1);
          for (std::int64_t i = 0; !o.error; ++i) {
            const std::int64_t tag = t * 100000 + i % 100000;
            Request r, s;
            try {
              r = c.irecv(Buffer{in.data(), in.size()}, 1 - rank, tag);
              s = c.isend(Buffer{out.data(), out.size()}, 1 - rank, tag);
            } catch (const Error& e) {
              capture(o, e);
            }
            // Both are waited for after a failure too: a buffer is the caller's again only
            // once its Request has completed (communicator.hpp).
            for (Request* q : {&s, &r}) {
              if (!q->valid()) continue;
              try {
                q->wait();
              } catch (const Error& e) {
                if (!o.error) capture(o, e);
              }
            }
            if (!o.error) messages.fetch_add(1);
          }
          // Every Request of this thread has completed, so nothing may write into `in` now: a
          // canary catches a receive that UCX was still filling when its wait returned.
          std::fill(in.begin(), in.end(), static_cast<unsigned char>(0xEE));
          while (!closed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          o.late_bytes = static_cast<std::size_t>(
              std::count_if(in.begin(), in.end(), [](unsigned char b) { return b != 0xEE; }));
          return o;
        });
        futures.push_back(busy.get_future());
        threads.emplace_back(std::move(busy));
      }
    }
    while (started.load() < 2 * kBusy + 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // Let the busy threads run a while (some traffic must have completed), then shut down.
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (messages.load() < 20 * kBusy && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10 * round));
    std::thread closer1([&] { comms[1]->shutdown(); });
    comms[0]->shutdown();
    closer1.join();
    closed.store(true);
    const std::vector<Outcome> out = collect(futures, threads);
    EXPECT_GE(messages.load(), 20 * kBusy) << "too little traffic before shutdown()";
    for (std::size_t i = 0; i < out.size(); ++i) {
      ASSERT_TRUE(out[i].error) << "thread " << i << " ended without an error";
      if (i == 0) {
        EXPECT_EQ(out[i].code, Errc::kCanceled) << "the blocked thread: " << out[i].message;
      } else {
        EXPECT_TRUE(out[i].code == Errc::kCanceled || out[i].code == Errc::kPeerFailed)
            << "thread " << i << ": " << out[i].message;
        EXPECT_EQ(out[i].late_bytes, 0u)
            << "thread " << i << ": its receive buffer was written after its wait returned";
      }
    }
  }
}

// The threads of this process, from /proc/self/status.
int process_threads() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

std::unique_ptr<Communicator> one_rank_comm(const std::shared_ptr<Store>& store, int i) {
  Options o = default_test_options();
  o.store_prefix = "comm" + std::to_string(i);  // one store, separate keys
  return std::make_unique<Communicator>(store, 0, 1, o);
}

// The communicators of one process share one UCX worker and its progress thread: the 2nd to 16th
// add no thread, each takes its own group id, and a message sent on one is received on that one
// only, although every one receives from the same peer (itself) on the same user tag. Shutting
// one down cancels its own receive and leaves the others' working.
TEST(Threads, CommunicatorsOfAProcessShareOneWorker) {
  constexpr int kComms = 16;
  TempDir dir;
  auto store = dir.store();
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.push_back(one_rank_comm(store, 0));
  const int threads = process_threads();
  for (int i = 1; i < kComms; ++i) comms.push_back(one_rank_comm(store, i));
  EXPECT_EQ(process_threads(), threads)
      << "each communicator added threads (its own UCX worker and progress thread?)";
  std::set<int> ids;
  for (auto& c : comms) ids.insert(c->options().group);
  EXPECT_EQ(ids.size(), static_cast<std::size_t>(kComms)) << "two communicators share a group id";

  std::vector<std::int32_t> in(kComms, -1), out(kComms);
  std::vector<Request> recvs;
  for (int i = 0; i < kComms; ++i) recvs.push_back(comms[i]->irecv(Buffer{&in[i], 4}, 0, 5));
  for (int i = kComms - 1; i >= 0; --i) {
    out[i] = 1000 + i;
    comms[i]->send({Buffer{&out[i], 4}}, 0, 5);
  }
  for (int i = 0; i < kComms; ++i) {
    recvs[i].wait(std::chrono::seconds(20));
    EXPECT_EQ(in[i], 1000 + i) << "communicator " << i << " received another one's message";
  }

  std::int32_t a = -1, b = -1, v = 7;
  Request survives = comms[1]->irecv(Buffer{&b, 4}, 0, 6);
  Request doomed = comms[0]->irecv(Buffer{&a, 4}, 0, 6);
  comms[0]->shutdown();
  try {
    doomed.wait(std::chrono::seconds(20));
    ADD_FAILURE() << "the shut-down communicator's receive completed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCanceled) << e.what();
  }
  comms[1]->send({Buffer{&v, 4}}, 0, 6);
  survives.wait(std::chrono::seconds(20));
  EXPECT_EQ(b, 7);
  EXPECT_EQ(a, -1);
}

// Every live communicator of a process holds one of the 256 group ids: the 257th fails with an
// error saying so (and creates nothing); once one is shut down, its id serves a new one.
TEST(Threads, GroupIdsRunOutWithAClearError) {
  TempDir dir;
  auto store = dir.store();
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int i = 0; i < tag_layout::kMaxGroups; ++i) comms.push_back(one_rank_comm(store, i));
  try {
    one_rank_comm(store, tag_layout::kMaxGroups);
    ADD_FAILURE() << "a 257th communicator was created";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("no free group id"), std::string::npos) << e.what();
  }
  const int freed = comms[5]->options().group;
  comms[5].reset();
  auto again = one_rank_comm(store, tag_layout::kMaxGroups + 1);
  EXPECT_EQ(again->options().group, freed);
  std::int32_t x = 3, y = 0;
  Request r = again->irecv(Buffer{&y, 4}, 0, 1);
  again->send({Buffer{&x, 4}}, 0, 1);
  r.wait(std::chrono::seconds(20));
  EXPECT_EQ(y, 3);
}

// Runs `body` with this thread's CPU affinity (inherited by the threads it starts) set to the
// first `n` CPUs of the current mask, then restores the mask. False when the mask has fewer.
template <typename Body>
bool with_cpus(int n, Body body) {
  cpu_set_t old;
  CPU_ZERO(&old);
  if (::sched_getaffinity(0, sizeof(old), &old) != 0 || CPU_COUNT(&old) < n) return false;
  cpu_set_t few;
  CPU_ZERO(&few);
  for (int c = 0, taken = 0; c < CPU_SETSIZE && taken < n; ++c) {
    if (CPU_ISSET(c, &old)) {
      CPU_SET(c, &few);
      ++taken;
    }
  }
  EXPECT_EQ(::sched_setaffinity(0, sizeof(few), &few), 0);
  body();
  EXPECT_EQ(::sched_setaffinity(0, sizeof(old), &old), 0);
  return true;
}

// Two ranks (threads of this process) and `yield`: each rank's resolved mode, after a checked
// exchange in both directions.
std::array<Options::Yield, 2> yield_modes(Options::Yield yield) {
  TempDir dir;
  auto store = dir.store();
  std::unique_ptr<Communicator> comms[2];
  Options o = default_test_options();
  o.yield = yield;
  std::thread r1([&] { comms[1] = std::make_unique<Communicator>(store, 1, 2, o); });
  comms[0] = std::make_unique<Communicator>(store, 0, 2, o);
  r1.join();
  for (int i = 0; i < 200; ++i) {
    std::int64_t a = -1, b = -1, x = 2 * i, y = 2 * i + 1;
    Request ra = comms[0]->irecv(Buffer{&a, 8}, 1, i);
    Request rb = comms[1]->irecv(Buffer{&b, 8}, 0, i);
    comms[0]->send({Buffer{&x, 8}}, 1, i);
    comms[1]->send({Buffer{&y, 8}}, 0, i);
    ra.wait(std::chrono::seconds(20));
    rb.wait(std::chrono::seconds(20));
    EXPECT_EQ(a, y);
    EXPECT_EQ(b, x);
  }
  return {comms[0]->options().yield, comms[1]->options().yield};
}

// COMMUX_YIELD=auto (Options::Yield::kAuto) turns yielding on at once when the group's ranks on
// this host outnumber the CPUs of the affinity mask (2 ranks on 1 CPU), not otherwise (2 on 2,
// which stays kAuto); on and off are taken as given. options().yield says which mode was taken.
TEST(Threads, RanksOutnumberingCpusYield) {
  using Y = Options::Yield;
  ASSERT_TRUE(with_cpus(1, [] {
    EXPECT_EQ(yield_modes(Y::kAuto), (std::array<Y, 2>{Y::kOn, Y::kOn}));
    EXPECT_EQ(yield_modes(Y::kOff), (std::array<Y, 2>{Y::kOff, Y::kOff}));
  }));
  if (!with_cpus(2, [] {
        EXPECT_EQ(yield_modes(Y::kAuto), (std::array<Y, 2>{Y::kAuto, Y::kAuto}));
        EXPECT_EQ(yield_modes(Y::kOn), (std::array<Y, 2>{Y::kOn, Y::kOn}));
      })) {
    std::printf("only 1 CPU: the 2-on-2 half is skipped\n");
  }
}

// A waiter blocked for a second, in yield mode, sleeps once its spin is over: it uses under 5% of
// a core (its thread's CPU time), and so does the rest of the process (the progress thread).
TEST(Threads, AWaiterBlockedInYieldModeUsesLittleCpu) {
  TempDir dir;
  Options o = default_test_options();
  o.yield = Options::Yield::kOn;
  Communicator c(dir.store(), 0, 1, o);
  ASSERT_EQ(c.options().yield, Options::Yield::kOn);
  std::int64_t x = 0;
  Request r = c.irecv(Buffer{&x, 8}, 0, 1);  // never sent
  const auto cpu_now = [](clockid_t id) {
    timespec ts{};
    ::clock_gettime(id, &ts);
    return std::chrono::nanoseconds(std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec);
  };
  const auto thread0 = cpu_now(CLOCK_THREAD_CPUTIME_ID);
  const auto process0 = cpu_now(CLOCK_PROCESS_CPUTIME_ID);
  const auto wall0 = Clock::now();
  try {
    r.wait(std::chrono::milliseconds(1000));
    ADD_FAILURE() << "a receive nobody sent completed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
  }
  const auto wall = Clock::now() - wall0;
  const auto thread = cpu_now(CLOCK_THREAD_CPUTIME_ID) - thread0;
  const auto process = cpu_now(CLOCK_PROCESS_CPUTIME_ID) - process0;
  EXPECT_GE(wall, std::chrono::milliseconds(900));
  EXPECT_LT(thread * 20, wall) << "the waiter used " << thread.count() / 1000 << " us of CPU in "
                               << wall.count() / 1000 << " us";
  EXPECT_LT((process - thread) * 20, wall)
      << "the rest of the process used " << (process - thread).count() / 1000 << " us of CPU";
}

// A collective that waits for a late rank waits in 10 ms slices (to look for another call's
// messages between them): each slice's wait must leave the progress thread's backoff alone.
// Before, every slice kicked it back to polling from 5 us, and a 2-rank allreduce blocked for a
// late peer cost the process 6% of a core (4 kicks of ~30 polls each per 40 ms).
// `scheduled`: rank 0 runs it as a coll::Schedule and waits with Schedule::wait(), which sleeps
// on the request between the call's checks and spins only while the wait is young (25 ms), as a
// blocking wait does: 2.0% of a core here, 3.2-3.5% when every sleep started with a spin.
void blocked_for_a_late_rank(bool scheduled) {
  TempDir dir;
  auto store = dir.store();
  std::unique_ptr<Communicator> comms[2];
  Options o = default_test_options();
  o.timeout = std::chrono::seconds(30);
  std::thread r1([&] { comms[1] = std::make_unique<Communicator>(store, 1, 2, o); });
  comms[0] = std::make_unique<Communicator>(store, 0, 2, o);
  r1.join();
  const auto process_cpu = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return std::chrono::nanoseconds(std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec);
  };
  auto reduce = [&](int rank, std::vector<float>& x) {
    coll::Context ctx;
    ctx.comm = comms[rank].get();
    ctx.tag = 1;
    ctx.op_name = "allreduce";
    coll::allreduce(ctx, x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
  };
  std::vector<float> x0(1000, 1.0f), x1(1000, 2.0f);
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    reduce(1, x1);
  });
  const auto cpu0 = process_cpu();
  const auto wall0 = Clock::now();
  if (scheduled) {
    coll::Schedule s([&] { reduce(0, x0); });
    EXPECT_FALSE(s.done());
    EXPECT_TRUE(s.wait(std::chrono::seconds(20)));
  } else {
    reduce(0, x0);
  }
  const auto wall = Clock::now() - wall0;
  const auto cpu = process_cpu() - cpu0;
  late.join();
  std::printf("blocked %lld ms, the process used %lld us of CPU\n",
              static_cast<long long>(
                  std::chrono::duration_cast<std::chrono::milliseconds>(wall).count()),
              static_cast<long long>(cpu.count() / 1000));
  EXPECT_GE(wall, std::chrono::milliseconds(1300));
  EXPECT_EQ(x0, std::vector<float>(1000, 3.0f));
  EXPECT_EQ(x1, std::vector<float>(1000, 3.0f));
  // Under 5% of a core; under a sanitizer 20%: ThreadSanitizer's instrumentation and its own
  // thread made the process use 7% in a CI run on a slow machine (the plain build 2.4% here). A
  // waiter that spun would still use most of a core either way.
  const int share = kSanitized ? 5 : 20;
  EXPECT_LT(cpu * share, wall)
      << "the process used " << cpu.count() / 1000 << " us of CPU in "
      << std::chrono::duration_cast<std::chrono::microseconds>(wall).count() << " us of waiting";
}

// Two ranks of one group in this process, each with its own worker and progress thread (as two
// processes have), created with `o` and a 30 s timeout.
std::array<std::unique_ptr<Communicator>, 2> two_ranks_in_process(const TempDir& dir, Options o) {
  o.timeout = std::chrono::seconds(30);
  auto store = dir.store();
  std::array<std::unique_ptr<Communicator>, 2> comms;
  std::thread r1([&] { comms[1] = std::make_unique<Communicator>(store, 1, 2, o); });
  comms[0] = std::make_unique<Communicator>(store, 0, 2, o);
  r1.join();
  return comms;
}

// Wake-ups (voluntary context switches) of this process's progress threads so far, or -1 when
// none runs: they are named "commux-progress".
long progress_thread_wakeups() {
  long total = -1;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (!std::getline(comm, name) || name != "commux-progress") continue;
    std::ifstream status(task.path() / "status");
    const std::string key = "voluntary_ctxt_switches:";
    for (std::string line; std::getline(status, line);) {
      if (line.rfind(key, 0) == 0) total = std::max(total, 0L) + std::stol(line.substr(key.size()));
    }
  }
  return total;
}

// Two ranks (two threads of this process, each with its own worker and progress thread, as two
// processes would have) run 4-byte allreduces in a loop for half a second, with 5 us of their own
// work between calls. Their waits progress their workers, and the progress threads stay parked,
// looking again every few ms, without taking the worker. Before, a progress thread took it
// whenever it found no spinner at that instant (between two of its caller's waits), then slept and
// looked again: thousands of wake-ups a second, each a preemption of a caller where the cores are
// few. Here (2 CPUs), before: 5600-7300 passes in the half second, 6000-7400 wake-ups a second,
// 6.9-7.6 us per iteration; now no pass, 200 wake-ups a second, 5.8-6.5 us. Beside a second copy of
// the test, before: 250-1100 passes; now 0-120 (so ctest runs it alone: tests/CMakeLists.txt).
TEST(Threads, TheProgressThreadStaysParkedWhileCallersWaitBackToBack) {
  TempDir dir;
  Options o = default_test_options();
  // Waits spin to the end, even on a machine busy with other tests: a wait that went to sleep
  // would kick the progress thread (rightly: then it must progress), which is not what this
  // counts.
  o.spin = std::chrono::seconds(1);
  auto comms = two_ranks_in_process(dir, o);
  const auto passes_now = [&] {
    return detail::channel(*comms[0]).progress_thread_passes() +
           detail::channel(*comms[1]).progress_thread_passes();
  };
  constexpr auto kRun = std::chrono::milliseconds(500);
  std::atomic<bool> timing{false};
  Clock::time_point t0;
  long wake0 = 0;
  std::uint64_t passes0 = 0;
  long calls[2] = {0, 0};
  // Each call is an allreduce (MAX) of rank 0's "stop" flag, so both ranks make the same calls;
  // the first 200 warm up.
  auto loop = [&](int rank) {
    coll::Context ctx;
    ctx.comm = comms[rank].get();
    ctx.op_name = "allreduce";
    for (std::uint32_t tag = 1;; ++tag) {
      std::int32_t stop = 0;
      if (rank == 0 && tag == 200) {
        wake0 = progress_thread_wakeups();
        passes0 = passes_now();
        t0 = Clock::now();
        timing = true;
      }
      if (rank == 0 && timing && Clock::now() - t0 >= kRun) stop = 1;
      ctx.tag = tag;
      coll::allreduce(ctx, &stop, 1, DataType::kInt32, ReduceOp::kMax);
      ++calls[rank];
      if (stop != 0) return;
      // A little work of the caller's own between calls (most of its time is not spent waiting,
      // as in a real loop): the progress thread finds no spinner at nearly every look.
      for (const auto until = Clock::now() + std::chrono::microseconds(5); Clock::now() < until;) {
      }
    }
  };
  std::thread other([&] { loop(1); });
  loop(0);
  const auto wall = Clock::now() - t0;
  const std::uint64_t passes = passes_now() - passes0;
  const long wakeups = progress_thread_wakeups() - wake0;
  other.join();
  ASSERT_GE(wake0, 0) << "no thread named commux-progress";
  EXPECT_EQ(calls[0], calls[1]);
  const double seconds = std::chrono::duration<double>(wall).count();
  std::printf(
      "%ld calls per rank in %.3f s (%.2f us each); the progress threads took their worker "
      "%llu times and woke %ld times (%.0f a second)\n",
      calls[0], seconds, 1e6 * seconds / static_cast<double>(calls[0]),
      static_cast<unsigned long long>(passes), wakeups, static_cast<double>(wakeups) / seconds);
  // They take the worker only after a look that found no progress call since the one before
  // (both callers off the CPU for a millisecond or more: on a machine busy with other work).
  EXPECT_LT(static_cast<double>(passes), 400 * seconds);
}

// The halo-exchange pattern: each iteration posts a 1 MiB exchange with the neighbour, computes
// for 5 ms (without calling commux) and only then waits; then a small blocking allreduce, as a
// residual check would be, in which rank 0 waits (spins) for rank 1. A transfer of that size
// moves only while someone progresses the worker, and during the computation only the progress
// thread can. But it had parked (for up to 10 ms) for rank 0's spinning wait in the allreduce,
// and so left the exchange to the wait after the computation. Here (2 CPUs), before: finished by
// the wait in 2-17 of the 40 checks (two ranks, 20 iterations); now 39-40, the exchange
// finishing 0.2-0.7 ms after the post. Not judged under a sanitizer (its slowdown leaves the
// progress thread no time to speak of).
TEST(Threads, AnExchangePostedRightAfterAWaitMovesWhileTheCallerComputes) {
  TempDir dir;
  Options o = default_test_options();
  o.spin = std::chrono::milliseconds(2);  // a wait spins through rank 1's lateness (below)
  auto comms = two_ranks_in_process(dir, o);
  constexpr int kIters = 20;
  constexpr int kWarmUp = 2;  // the first exchanges set up the transports
  constexpr std::size_t kBytes = std::size_t{1} << 20;
  constexpr auto kCompute = std::chrono::milliseconds(5);
  constexpr auto kLate = std::chrono::microseconds(300);
  int finished[2] = {0, 0};
  std::size_t wrong[2] = {0, 0};
  auto loop = [&](int rank) {
    Communicator& comm = *comms[rank];
    const int peer = 1 - rank;
    std::vector<std::uint8_t> out(kBytes), in(kBytes);
    coll::Context ctx;
    ctx.comm = &comm;
    ctx.op_name = "allreduce";
    for (int it = -kWarmUp; it < kIters; ++it) {
      for (std::size_t i = 0; i < kBytes; i += 4096) out[i] = static_cast<std::uint8_t>(it + rank);
      Request r = comm.irecv(Buffer{in.data(), kBytes}, peer, it + kWarmUp);
      Request s = comm.isend(Buffer{out.data(), kBytes}, peer, it + kWarmUp);
      for (const auto until = Clock::now() + kCompute; Clock::now() < until;) {
      }
      if (r.done() && s.done() && it >= 0) ++finished[rank];
      r.wait();
      s.wait();
      for (std::size_t i = 0; i < kBytes; i += 4096) {
        wrong[rank] += in[i] != static_cast<std::uint8_t>(it + peer);
      }
      // Rank 1 reaches the allreduce later, so rank 0's wait there spins (the progress thread
      // parks for it) and returns only when rank 1 arrives.
      if (rank == 1) {
        for (const auto until = Clock::now() + kLate; Clock::now() < until;) {
        }
      }
      double residual = 1.0;
      ctx.tag = static_cast<std::uint32_t>(it + kWarmUp + 1);
      coll::allreduce(ctx, &residual, 1, DataType::kFloat64, ReduceOp::kSum);
      wrong[rank] += residual != 2.0;
    }
  };
  std::thread other([&] { loop(1); });
  loop(0);
  other.join();
  std::printf("the exchange had finished by the wait in %d and %d of %d iterations\n", finished[0],
              finished[1], kIters);
  EXPECT_EQ(wrong[0] + wrong[1], 0u);
  if (!kSanitized) {
    EXPECT_GE(finished[0] + finished[1], 2 * kIters * 3 / 4);
  }
}

// Waits that do not spin (Options::spin 0, COMMUX_SPIN_US=0: the setting for ranks that must
// leave the CPU alone) sleep at once and leave the completion to the progress thread. Each such
// wait still progresses the worker once on the caller's thread, and the progress thread used to
// take that as a caller progressing the worker back to back and park for 1-10 ms without looking
// at it, though the caller had gone to sleep and the message it waited for had arrived: nobody
// progressed until the park ended. Two ranks (threads of this process) run 300 8-byte allreduces
// with spin 0. Here (2 CPUs), before: 0.6 ms a call, 150 of each rank's 300 took a millisecond
// or more; now 67-69 us a call and 0-3 (a call that takes that long was starved of CPU: a few
// are allowed).
TEST(Threads, AWaitThatDoesNotSpinIsCompletedWhenItsMessageArrives) {
  TempDir dir;
  Options o = default_test_options();
  o.spin = std::chrono::microseconds(0);
  auto comms = two_ranks_in_process(dir, o);
  constexpr int kWarmUp = 20;
  constexpr int kCalls = 300;
  int slow[2] = {0, 0};
  int wrong[2] = {0, 0};
  Clock::duration total[2] = {};
  auto loop = [&](int rank) {
    coll::Context ctx;
    ctx.comm = comms[rank].get();
    ctx.op_name = "allreduce";
    for (int i = -kWarmUp; i < kCalls; ++i) {
      std::int32_t v = rank + i;
      ctx.tag = static_cast<std::uint32_t>(i + kWarmUp + 1);
      const auto t0 = Clock::now();
      coll::allreduce(ctx, &v, 1, DataType::kInt32, ReduceOp::kSum);
      const auto took = Clock::now() - t0;
      wrong[rank] += v != 2 * i + 1;
      if (i < 0) continue;
      total[rank] += took;
      slow[rank] += took >= std::chrono::milliseconds(1);
    }
  };
  std::thread other([&] { loop(1); });
  loop(0);
  other.join();
  std::printf("spin 0: %.1f us a call; %d and %d of %d calls took 1 ms or more\n",
              std::chrono::duration<double, std::micro>(total[0]).count() / kCalls, slow[0],
              slow[1], kCalls);
  EXPECT_EQ(wrong[0] + wrong[1], 0);
  if (!kSanitized) {
    EXPECT_LE(slow[0] + slow[1], 2 * kCalls / 20);
  }
}

// While a caller computes, nothing is in flight and the progress thread's idle naps grow towards
// 20 ms. A caller that then waits, spins and goes to sleep must not leave the message it sleeps
// on to the end of such a nap: it woke the progress thread only if it was parked for a spinner,
// and a barrier after a computation returned up to 20 ms after the last rank arrived (through
// torch: 64 MiB calls between computations took 1.1-1.3x their earlier time). Each round here
// waits until the progress thread sleeps 10 ms or more at a time, then a second thread waits
// for a receive nobody sends; within 5 ms of that thread going to sleep the progress thread
// must be awake or in a nap that ends within the 2 ms in-flight cap. Before: still asleep, with
// 6.3-6.7 ms of its nap left, in every round. (Polling mode: in wakeup mode the message itself
// wakes the progress thread.)
TEST(Threads, ACallerGoingToSleepCutsTheProgressThreadsLongNap) {
  TempDir dir;
  Options o = default_test_options();
  o.timeout = std::chrono::seconds(60);
  o.wakeup = Options::Wakeup::kOff;
  auto comm = std::make_unique<Communicator>(dir.store(), 0, 1, o);
  auto& ch = detail::channel(*comm);
  constexpr int kRounds = 5;
  int cut = 0;
  std::string missed;
  for (int round = 0; round < kRounds; ++round) {
    const auto give_up = Clock::now() + std::chrono::seconds(5);
    while (ch.progress_thread_nap_left() < std::chrono::milliseconds(10)) {
      ASSERT_LT(Clock::now(), give_up) << "the progress thread's idle naps never reached 10 ms";
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::vector<unsigned char> in(64);
    Request r = comm->irecv(Buffer{in.data(), in.size()}, 0, 100 + round);  // never sent
    std::atomic<bool> timed_out{false};
    std::thread waiter([&] {
      try {
        r.wait(std::chrono::milliseconds(200));
      } catch (const Error& e) {
        timed_out.store(e.code() == Errc::kTimeout);
      }
    });
    const auto asleep_by = Clock::now() + std::chrono::seconds(5);
    while (ch.sleeping_waiters() == 0 && Clock::now() < asleep_by) std::this_thread::yield();
    const bool asleep = ch.sleeping_waiters() > 0;
    const auto slept = Clock::now();
    auto left = ch.progress_thread_nap_left();
    while (asleep && left >= std::chrono::milliseconds(2) &&
           Clock::now() - slept < std::chrono::milliseconds(5)) {
      std::this_thread::yield();
      left = ch.progress_thread_nap_left();
    }
    waiter.join();  // (before any assertion: a test that returns with it joinable would abort)
    r.cancel();
    try {
      r.wait(std::chrono::seconds(5));
    } catch (const Error&) {  // kCanceled, as asked
    }
    ASSERT_TRUE(asleep) << "the waiter never went to sleep";
    EXPECT_TRUE(timed_out.load());
    if (left < std::chrono::milliseconds(2)) {
      ++cut;
    } else {
      missed += " " + std::to_string(left.count()) + " us";
    }
  }
  std::printf("the nap was cut in %d of %d rounds\n", cut, kRounds);
  EXPECT_EQ(cut, kRounds) << "nap left 5 ms after the waiter went to sleep:" << missed;
}

TEST(Threads, ACollectiveBlockedForALateRankUsesLittleCpu) { blocked_for_a_late_rank(false); }

TEST(Threads, AScheduleWaitedForALateRankUsesLittleCpu) { blocked_for_a_late_rank(true); }

// --- drivers: work of a layer above core on the progress thread (Channel::set_driver) ----------

// A driver that, on its first call, posts a receive of 1 MiB from this rank and waits for it
// with a plain blocking wait, as a collective's error path does on the progress thread. The send
// comes 100 ms later from another thread that does not progress. Nobody but the waiting progress
// thread can complete the receive, so its wait must progress the worker itself: a wait that
// slept for the progress thread (itself) would time out.
struct WaitingDriver final : detail::Driver {
  Communicator* comm = nullptr;
  std::vector<char>* in = nullptr;
  std::atomic<int> calls{0};
  std::atomic<bool> posted{false};
  std::atomic<bool> received{false};
  std::string error;  // written by the progress thread before `done`
  std::atomic<bool> done{false};
  bool drive() noexcept override {
    if (calls.fetch_add(1) > 0) return false;
    try {
      Request r = comm->irecv(Buffer{in->data(), in->size()}, 0, 9);
      posted.store(true);
      r.wait(std::chrono::seconds(10));
      received.store(true);
    } catch (const std::exception& e) {
      error = e.what();
    }
    done.store(true);
    return false;
  }
};

TEST(Threads, AWaitOnTheProgressThreadProgressesItself) {
  TempDir dir;
  auto comm = one_rank_world(dir);
  std::vector<char> in(1 << 20, 0), out(1 << 20, 'x');
  auto d = std::make_shared<WaitingDriver>();
  d->comm = comm.get();
  d->in = &in;
  const auto start = Clock::now();
  ASSERT_TRUE(detail::channel(*comm).set_driver(d)) << "the UCX channel has no progress thread";
  while (!d->posted.load() && Clock::now() - start < std::chrono::seconds(20)) {
    detail::channel(*comm).wake_driver();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(d->posted.load()) << "the progress thread never called the driver";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Request s = comm->isend(Buffer{out.data(), out.size()}, 0, 9);
  const auto sent = Clock::now();
  while (!d->done.load() && Clock::now() - sent < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - sent);
  ASSERT_TRUE(d->done.load()) << "the driver's wait never returned";
  EXPECT_TRUE(d->received.load()) << "the driver's wait failed: " << d->error;
  EXPECT_LT(took, std::chrono::seconds(5)) << "the driver's wait took " << took.count() << " ms";
  EXPECT_EQ(in, out);
  s.wait(std::chrono::seconds(20));
  detail::channel(*comm).set_driver(nullptr);
}

// set_driver(nullptr) returns only once the call of the old driver that is running has ended,
// and the old driver is not called after: its owner may then be destroyed.
struct SlowDriver final : detail::Driver {
  std::atomic<int> calls{0};
  std::atomic<bool> inside{false};
  std::atomic<bool> after_removal{false};
  std::atomic<bool> removed{false};
  bool drive() noexcept override {
    if (removed.load()) after_removal.store(true);
    inside.store(true);
    calls.fetch_add(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    inside.store(false);
    return false;
  }
};

TEST(Threads, RemovingADriverWaitsForItsRunningCall) {
  TempDir dir;
  auto comm = one_rank_world(dir);
  auto d = std::make_shared<SlowDriver>();
  ASSERT_TRUE(detail::channel(*comm).set_driver(d));
  const auto start = Clock::now();
  while (!d->inside.load() && Clock::now() - start < std::chrono::seconds(20)) {
    detail::channel(*comm).wake_driver();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(d->inside.load()) << "the progress thread never called the driver";
  detail::channel(*comm).set_driver(nullptr);
  EXPECT_FALSE(d->inside.load()) << "set_driver(nullptr) returned during a call of the old driver";
  d->removed.store(true);
  const int calls = d->calls.load();
  for (int i = 0; i < 20; ++i) {
    detail::channel(*comm).wake_driver();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(d->calls.load(), calls);
  EXPECT_FALSE(d->after_removal.load()) << "a removed driver was called";
  // A channel that has shut down takes no driver: its owner must drive its work itself.
  comm->shutdown();
  EXPECT_FALSE(detail::channel(*comm).set_driver(std::make_shared<SlowDriver>()));
}

}  // namespace
}  // namespace commux::test
