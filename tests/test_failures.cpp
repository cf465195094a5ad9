// Failures: truncation, timeouts, cancellation, dead peers, bounded shutdown, idle waiting.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <thread>
#include <vector>

#include "harness.hpp"

using namespace commux;
using namespace commux::test;
using Clock = std::chrono::steady_clock;

namespace {

Buffer buf(std::vector<unsigned char>& v) { return Buffer{v.data(), v.size()}; }

double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);  // all threads of the process, the progress thread included
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// Both ranks know each other is up and wired before a test kills one of them.
void handshake(Communicator& c) {
  std::vector<unsigned char> a(1), b(1);
  const int peer = 1 - c.rank();
  Request r = c.irecv(buf(b), peer, 999);
  c.send({buf(a)}, peer, 999);
  r.wait();
}

}  // namespace

class Truncation : public ::testing::TestWithParam<std::size_t> {};

// A message longer than the posted buffer fails the receive, naming peer, tag and both sizes.
TEST_P(Truncation, NamesPeerTagAndSizes) {
  const std::size_t sent = GetParam();
  run_ranks(2, [sent](Communicator& c) {
    if (c.rank() == 0) {
      std::vector<unsigned char> out(sent, 7);
      Request s = c.isend(buf(out), 1, 9);
      try {
        s.wait();  // the sender may or may not see an error; it must not hang
      } catch (const Error&) {
      }
      handshake(c);
    } else {
      std::vector<unsigned char> in(sent / 2);
      const std::string msg = expect_error(Errc::kTruncated, [&] { c.recv({buf(in)}, 0, 9); });
      CX_CHECK_HAS(msg, "commux recv");
      CX_CHECK_HAS(msg, "peer 0");
      CX_CHECK_HAS(msg, "tag 9");
      CX_CHECK_HAS(msg, std::to_string(sent / 2));
      CX_CHECK_HAS(msg, std::to_string(sent));
      std::fprintf(stderr, "[rank 1] %s\n", msg.c_str());
      handshake(c);  // the communicator is still usable afterwards
    }
  });
}

INSTANTIATE_TEST_SUITE_P(EagerAndRendezvous, Truncation,
                         ::testing::Values(std::size_t{2048}, std::size_t{4} << 20));

// A wait past its deadline names op, peer, tag and bytes; the op can then be cancelled.
TEST(Failures, TimeoutThenCancel) {
  run_ranks(2, [](Communicator& c) {
    if (c.rank() == 1) {
      std::vector<unsigned char> in(1024);
      Request r = c.irecv(buf(in), 0, 77);
      const auto t0 = Clock::now();
      const std::string msg =
          expect_error(Errc::kTimeout, [&] { r.wait(std::chrono::milliseconds(300)); });
      const auto waited = Clock::now() - t0;
      CX_CHECK(waited >= std::chrono::milliseconds(300));
      CX_CHECK(waited < std::chrono::seconds(5));
      CX_CHECK_HAS(msg, "commux irecv: Timed out after 300 ms");
      CX_CHECK_HAS(msg, "peer 0");
      CX_CHECK_HAS(msg, "tag 77");
      CX_CHECK_HAS(msg, "1024 bytes");
      CX_CHECK_HAS(msg, "; the operation is still posted: wait again or cancel it");
      // The same as fields: the operation is still posted, and what it is.
      try {
        r.wait(std::chrono::milliseconds(10));
        check_failed(__FILE__, __LINE__, "a second wait returned");
      } catch (const Error& e) {
        CX_CHECK(e.code() == Errc::kTimeout);
        CX_CHECK(e.still_posted());
        CX_CHECK(e.op() == "irecv");
        CX_CHECK(e.peer() == 0);
        CX_CHECK(e.tag() == std::uint64_t{77});
        CX_CHECK(e.bytes() == std::size_t{1024});
        CX_CHECK(e.group() == std::to_string(c.options().group));
      }
      CX_CHECK(!r.test());
      r.cancel();
      CX_CHECK_HAS(expect_error(Errc::kCanceled, [&] { r.wait(std::chrono::seconds(5)); }),
                   "irecv");
    }
    handshake(c);
  });
}

// A peer that dies fails the other rank's pending receive and send within the deadline.
TEST(Failures, DeadPeerFailsPendingOps) {
  RunOptions o;
  o.expect_killed = {1};
  run_ranks(
      2,
      [](Communicator& c) {
        handshake(c);
        if (c.rank() == 1) {
          ::raise(SIGKILL);
        }
        std::vector<unsigned char> in(64);
        Request r = c.irecv(buf(in), 1, 3);
        const auto t0 = Clock::now();
        const std::string msg =
            expect_error(Errc::kPeerFailed, [&] { r.wait(std::chrono::seconds(20)); });
        const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        std::fprintf(stderr, "[rank 0] dead peer detected after %.2f s: %s\n", secs, msg.c_str());
        CX_CHECK_HAS(msg, "peer 1");
        CX_CHECK_HAS(msg, "tag 3");
        // Sends to the dead peer now fail at once rather than hang.
        std::vector<unsigned char> out(std::size_t{1} << 20);
        expect_error(Errc::kPeerFailed,
                     [&] { c.isend(buf(out), 1, 4).wait(std::chrono::seconds(20)); });
        // Shutdown with a dead peer is bounded by the shutdown timeout.
        const auto s0 = Clock::now();
        c.shutdown();
        CX_CHECK(Clock::now() - s0 < c.options().shutdown_timeout + std::chrono::seconds(1));
      },
      o);
}

// Ranks that finish at different times, with receives still posted, shut down promptly.
TEST(Failures, ShutdownIsBoundedWhenRanksFinishApart) {
  run_ranks(3, [](Communicator& c) {
    std::vector<unsigned char> in(32);
    Request pending = c.irecv(buf(in), (c.rank() + 1) % c.size(), 55);  // never satisfied
    std::this_thread::sleep_for(std::chrono::milliseconds(300 * c.rank()));
    const auto t0 = Clock::now();
    c.shutdown();
    CX_CHECK(Clock::now() - t0 < c.options().shutdown_timeout + std::chrono::seconds(1));
    // Either this rank's shutdown cancelled it, or a peer that shut down first failed it.
    CX_CHECK(pending.done());
    CX_CHECK(pending.error() != nullptr);
    expect_error(Errc::kCanceled, [&] { c.isend(buf(in), 0, 1); });
  });
}

// A waiter blocked for 5 s sleeps: the whole process uses less than 5% of a core.
TEST(Failures, BlockedWaiterDoesNotSpin) {
  run_ranks(2, [](Communicator& c) {
    handshake(c);
    if (c.rank() == 0) {
      std::vector<unsigned char> in(16);
      Request r = c.irecv(buf(in), 1, 8);
      const double cpu0 = cpu_seconds();
      const auto t0 = Clock::now();
      expect_error(Errc::kTimeout, [&] { r.wait(std::chrono::seconds(5)); });
      const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      const double cpu = cpu_seconds() - cpu0;
      std::fprintf(stderr, "[rank 0] blocked 5 s wait: %.3f s CPU over %.2f s (%.2f%% of a core)\n",
                   cpu, wall, 100.0 * cpu / wall);
      CX_CHECK(cpu < 0.05 * wall);
      r.cancel();
      std::vector<unsigned char> go(1);
      c.send({buf(go)}, 1, 9);
    } else {
      std::vector<unsigned char> go(1);
      c.recv({buf(go)}, 0, 9);
    }
  });
}

// A blocking recv() that times out is cancelled, not left posted: the message that arrives later
// goes to the next recv(), never into the first one's (possibly freed) buffer.
TEST(Failures, BlockingRecvTimeoutCancels) {
  RunOptions o;
  o.comm.timeout = std::chrono::milliseconds(300);
  run_ranks(
      2,
      [](Communicator& c) {
        std::vector<unsigned char> first(4, 0), second(4, 0), one(4, 42);
        if (c.rank() == 1) {
          CX_CHECK_HAS(expect_error(Errc::kTimeout, [&] { c.recv({buf(first)}, 0, 7); }),
                       "the operation was cancelled");
          std::vector<unsigned char> go(1);
          c.send({buf(go)}, 0, 8);
          Request r = c.irecv(buf(second), 0, 7);
          r.wait(std::chrono::seconds(10));
          CX_CHECK_EQ(int(first[0]), 0);
          CX_CHECK_EQ(int(second[0]), 42);
        } else {
          std::vector<unsigned char> go(1);
          c.irecv(buf(go), 1, 8).wait(std::chrono::seconds(10));
          c.send({buf(one)}, 1, 7);
        }
      },
      o);
}
