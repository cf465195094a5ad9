// Point-to-point semantics across processes: matching, ordering, any-source, multi-buffer,
// zero bytes, world sizes 1..4, threads, background progress.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <numeric>
#include <random>
#include <vector>

#include "channel.hpp"
#include "checks.hpp"
#include "world.hpp"

using namespace commux;
using namespace commux::test;

// Every check runs for world sizes 1..4 (self-messages included).
class WorldSize : public ::testing::TestWithParam<int> {};

TEST_P(WorldSize, AllPairsAllCounts) { run_ranks(GetParam(), check_all_pairs); }
TEST_P(WorldSize, OutOfOrderTags) { run_ranks(GetParam(), check_out_of_order_tags); }
TEST_P(WorldSize, SameTagKeepsOrder) { run_ranks(GetParam(), check_same_tag_order); }
TEST_P(WorldSize, AnySourceReportsSender) { run_ranks(GetParam(), check_any_source); }

INSTANTIATE_TEST_SUITE_P(Sizes, WorldSize, ::testing::Values(1, 2, 3, 4));

// A list of buffers is one operation, in separate parts (default) and packed (COMMUX_COALESCE).
class MultiBuffer : public ::testing::TestWithParam<std::tuple<Packing, int>> {};

TEST_P(MultiBuffer, ListIsOneOperation) {
  RunOptions o;
  o.comm.packing = std::get<0>(GetParam());
  run_ranks(std::get<1>(GetParam()), check_multi_buffer, o);
}

INSTANTIATE_TEST_SUITE_P(Packings, MultiBuffer,
                         ::testing::Combine(::testing::Values(Packing::kParts, Packing::kIov),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& p) {
                           return std::string(std::get<0>(p.param) == Packing::kIov ? "iov"
                                                                                    : "parts") +
                                  "_" + std::to_string(std::get<1>(p.param)) + "ranks";
                         });

namespace {
// Rank 0 packs multi-buffer messages into one (COMMUX_COALESCE), rank 1 does not.
RunOptions packing_on_rank_0() {
  RunOptions o;
  o.comm_for_rank = [](int rank) {
    Options x = default_test_options();
    x.packing = rank == 0 ? Packing::kIov : Packing::kParts;
    return x;
  };
  return o;
}
}  // namespace

// A rank that packs multi-buffer messages while its peer does not gets a clear error, not garbage.
TEST(P2P, PackingMismatchIsReported) {
  run_ranks(
      2,
      [](Communicator& c) {
        std::vector<unsigned char> a(16, 1), b(16, 2);
        std::vector<Buffer> bufs = {buf(a), buf(b)};
        if (c.rank() == 0) {
          c.send(bufs, 1, 4);
        } else {
          const std::string msg = expect_error(Errc::kWireMismatch, [&] { c.recv(bufs, 0, 4); });
          CX_CHECK_HAS(msg, "COMMUX_COALESCE");
          CX_CHECK_HAS(msg, "peer 0");
        }
      },
      packing_on_rank_0());
}

// Several threads per rank post and wait at once.
TEST(P2P, ManyThreadsPostAndWait) {
  run_ranks(2, [](Communicator& c) {
    const int peer = 1 - c.rank();
    const int kThreads = 4, kMsgs = 100;
    const auto errors = run_threads(kThreads, [&](int t) {
      for (int i = 0; i < kMsgs; ++i) {
        const int tag = t * 1000 + i;
        const std::size_t n = static_cast<std::size_t>((i * 977) % 20000);
        auto out = filled(static_cast<std::uint64_t>(c.rank() * 100000 + tag), n);
        std::vector<unsigned char> in(n);
        Request r = c.irecv(buf(in), peer, tag);
        Request s = c.isend(buf(out), peer, tag);
        s.wait();
        r.wait();
        check_filled(in, static_cast<std::uint64_t>(peer * 100000 + tag), n);
      }
    });
    for (int t = 0; t < kThreads; ++t) CX_CHECK_EQ(errors[static_cast<std::size_t>(t)], "");
  });
}

// A large transfer completes while both callers compute without calling into commux.
TEST(P2P, ProgressesWhileCallerComputes) {
  run_ranks(2, [](Communicator& c) {
    const std::size_t n = std::size_t{16} << 20;
    std::vector<unsigned char> data = c.rank() == 0 ? filled(9, n) : std::vector<unsigned char>(n);
    Request r = c.rank() == 0 ? c.isend(buf(data), 1, 1) : c.irecv(buf(data), 0, 1);
    // "Compute" for up to 3 s; done() only reads a flag, it drives no progress.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    volatile double sink = 0;
    while (!r.done() && std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 100000; ++i) sink = sink + i * 0.5;
    }
    CX_CHECK(r.done());
    r.wait(std::chrono::milliseconds(0));
    if (c.rank() == 1) check_filled(data, 9, n);
  });
}

// Invalid input is rejected before anything is posted, naming the operation.
TEST(P2P, InvalidArgumentsAreRejected) {
  run_ranks(2, [](Communicator& c) {
    std::vector<unsigned char> v(8);
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.isend(buf(v), 2, 1); }),
                 "isend: peer 2");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.isend(buf(v), kAnySource, 1); }),
                 "isend");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.irecv(buf(v), -5, 1); }),
                 "irecv: peer -5");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.isend(buf(v), 0, -1); }), "tag -1");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument,
                              [&] { c.irecv(buf(v), 0, std::int64_t{1} << 32); }),
                 "tag 4294967296");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.isend(Buffer{nullptr, 4}, 0, 1); }),
                 "null");
    // The largest tag is fine.
    const std::int64_t top = tag_layout::kMaxUserTag;
    std::vector<unsigned char> in(8);
    Request r = c.irecv(buf(in), c.rank(), top);
    c.send({buf(v)}, c.rank(), top);
    r.wait();
  });
}

// --- Posts held back behind a gate (detail::Channel::post_after) ------------------------------
// The torch adapter holds a device tensor's post until the kernels queued before it are done, so
// that isend returns at once; these check core's part with a gate the test opens by hand.

namespace {
class TestGate final : public detail::Gate {
 public:
  explicit TestGate(std::string name) : name_(std::move(name)) {}
  bool open() override {
    polls.fetch_add(1);
    if (fail.load()) throw std::runtime_error("the test gate broke");
    return is_open.load();
  }
  std::string describe() const override { return name_; }
  std::atomic<bool> is_open{false};
  std::atomic<bool> fail{false};
  std::atomic<int> polls{0};

 private:
  std::string name_;
};

Request post_held(Communicator& c, std::shared_ptr<TestGate> gate, detail::Direction dir,
                  std::vector<unsigned char>& data, int peer, std::uint32_t tag) {
  Buffer b = buf(data);
  return detail::channel(c).post_after(std::move(gate), dir,
                                       dir == detail::Direction::kSend ? "isend" : "irecv", &b, 1,
                                       peer, TagKind::kUser, tag, false);
}

// Flag-only waits (done() drives no progress): what completes here was posted by the progress
// thread.
bool done_within(const Request& r, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!r.done() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return r.done();
}
}  // namespace

// Sends: a held send and the plain and held sends of its tag after it leave in call order once
// the gate opens, posted by the progress thread while the caller never calls into commux; the
// receiver sees none of them before, while a send of another tag is not held up. Receives: a held receive and a plain one after it match the messages in
// call order (the plain one does not take the first message while the held one waits).
TEST(HeldPosts, GoOutInCallOrderWhenTheGateOpens) {
  run_ranks(2, [](Communicator& c) {
    using detail::Direction;
    std::vector<unsigned char> ack(1, 1);
    if (c.rank() == 0) {
      auto gate = std::make_shared<TestGate>("the test's send gate");
      auto a = filled(1, 1000), b = filled(2, 100000), d = filled(3, 10);
      Request ra = post_held(c, gate, Direction::kSend, a, 1, 7);
      Request rb = c.isend(buf(b), 1, 7);
      auto open_gate = std::make_shared<TestGate>("an open gate");
      open_gate->is_open = true;
      Request rd = post_held(c, open_gate, Direction::kSend, d, 1, 7);
      CX_CHECK(!ra.done() && !rb.done() && !rd.done());
      auto e = filled(6, 300);
      c.send({buf(e)}, 1, 11);    // another tag: not held up by them
      c.recv({buf(ack)}, 1, 99);  // rank 1 saw none of them arrive
      CX_CHECK(!ra.done());
      CX_CHECK(gate->polls.load() > 0);  // polled all along, by the progress thread
      gate->is_open = true;
      CX_CHECK(done_within(ra, std::chrono::seconds(5)));
      CX_CHECK(done_within(rb, std::chrono::seconds(5)));
      CX_CHECK(done_within(rd, std::chrono::seconds(5)));
      ra.wait(), rb.wait(), rd.wait();
      // Receives: two messages of one tag; the held receive must get the first.
      auto m1 = filled(4, 5000), m2 = filled(5, 5000);
      Request s1 = c.isend(buf(m1), 1, 8), s2 = c.isend(buf(m2), 1, 8);
      c.send({buf(ack)}, 1, 98);
      s1.wait(), s2.wait();
    } else {
      std::vector<unsigned char> a(1000), b(100000), d(10);
      Request ra = c.irecv(buf(a), 0, 7), rb = c.irecv(buf(b), 0, 7), rd = c.irecv(buf(d), 0, 7);
      std::vector<unsigned char> e(300);
      c.recv({buf(e)}, 0, 11);
      check_filled(e, 6, 300);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      for (int i = 0; i < 10; ++i) CX_CHECK(!ra.test() && !rb.test() && !rd.test());
      c.send({buf(ack)}, 0, 99);
      ra.wait(), rb.wait(), rd.wait();
      check_filled(a, 1, 1000);
      check_filled(b, 2, 100000);
      check_filled(d, 3, 10);
      auto gate = std::make_shared<TestGate>("the test's receive gate");
      std::vector<unsigned char> r1(5000), r2(5000);
      Request h1 = post_held(c, gate, Direction::kRecv, r1, 0, 8);
      Request h2 = c.irecv(buf(r2), 0, 8);
      c.recv({buf(ack)}, 0, 98);  // both messages have been sent
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      for (int i = 0; i < 10; ++i) CX_CHECK(!h1.test() && !h2.test());
      gate->is_open = true;
      h1.wait(), h2.wait();
      check_filled(r1, 4, 5000);
      check_filled(r2, 5, 5000);
    }
  });
}

// A gate that never opens: the wait times out naming what the post waits for, and the post stays
// held (cancel finishes it); a gate that throws fails its own post loudly while the posts behind
// it go on in order; shutdown fails a post still held.
TEST(HeldPosts, FailuresAreLoudAndNamed) {
  run_ranks(1, [](Communicator& c) {
    using detail::Direction;
    std::vector<unsigned char> a = filled(1, 64), in(64);
    auto stuck = std::make_shared<TestGate>("the work queued on the stuck test stream");
    Request r = post_held(c, stuck, Direction::kSend, a, 0, 3);
    const std::string t =
        expect_error(Errc::kTimeout, [&] { r.wait(std::chrono::milliseconds(100)); });
    CX_CHECK_HAS(t, "isend");
    CX_CHECK_HAS(t, "not posted yet: waiting for the work queued on the stuck test stream");
    r.cancel();
    CX_CHECK_HAS(expect_error(Errc::kCanceled, [&] { r.wait(std::chrono::seconds(5)); }), "isend");

    auto broken = std::make_shared<TestGate>("the broken test stream");
    broken->fail = true;
    std::vector<unsigned char> b = filled(2, 64), d = filled(3, 64);
    Request rb = post_held(c, broken, Direction::kSend, b, 0, 4);
    Request rd = c.isend(buf(d), 0, 4);  // behind it: goes once the broken one is failed
    CX_CHECK_HAS(expect_error(Errc::kTransport, [&] { rb.wait(std::chrono::seconds(5)); }),
                 "checking the broken test stream failed: the test gate broke");
    c.recv({buf(in)}, 0, 4);  // the only message of tag 4 is d's
    check_filled(in, 3, 64);
    rd.wait();

    auto never = std::make_shared<TestGate>("a test stream that never finishes");
    Request rn = post_held(c, never, Direction::kRecv, in, 0, 5);
    c.shutdown();
    const std::string s = expect_error(Errc::kCanceled, [&] { rn.wait(std::chrono::seconds(5)); });
    CX_CHECK_HAS(s, "shut down");
    CX_CHECK_HAS(s, "not posted yet: waiting for a test stream that never finishes");
  });
}

// ---- Messages sent and received inside the call (Channel::send_now, recv_now) ----------------
// The collectives send small messages with send_now and receive those already there with
// recv_now: no Request, no Op. These check what they promise: the data and length, a decline
// that sends or posts nothing, and the errors of a message that does not fit, which must be as
// loud as post()'s.
namespace {
// Waits (bounded) until a user message of `tag` from `peer` has arrived unmatched.
void await_arrival(Communicator& c, int peer, std::uint32_t tag) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!detail::channel(c).probe(TagKind::kUser, peer, tag, ~std::uint32_t{0}, nullptr)) {
    CX_CHECK(std::chrono::steady_clock::now() < until);
    std::this_thread::yield();
  }
}
}  // namespace

// Sizes that UCX sends eagerly in fragments or by rendezvous.
const std::vector<std::size_t> kLarge = {8 << 10, 16 << 10, 40 << 10, 80 << 10, 256 << 10, 1 << 20};

namespace {
// Two messages on one tag, kLarge[k] bytes and then 8 (each filled from its own seed), received
// by two irecvs posted before either is waited: each must get its own, the large one first.
void recv_large_then_small(Communicator& c, std::uint32_t k, std::int64_t tag) {
  std::vector<unsigned char> in_large(kLarge[k]), in_small(8);
  Request rl = c.irecv(buf(in_large), 0, tag);
  Request rs = c.irecv(buf(in_small), 0, tag);
  rl.wait();
  rs.wait();
  CX_CHECK_EQ(rl.bytes(), kLarge[k]);
  CX_CHECK_EQ(rs.bytes(), std::size_t{8});
  check_filled(in_large, 100 + k, kLarge[k]);
  check_filled(in_small, 200 + k, 8);
}

// A Request whose message moved inside its call: finished at once, a success from `source` of
// `bytes`, and still one after wait() and a cancel() that comes too late.
void check_done_inside_call(Request& r, int source, std::size_t bytes) {
  CX_CHECK(r.done());
  CX_CHECK(r.test());
  CX_CHECK(r.error() == nullptr);
  CX_CHECK_EQ(r.source(), source);
  CX_CHECK_EQ(r.bytes(), bytes);
  r.wait();
  r.cancel();
  CX_CHECK(r.error() == nullptr);
}
}  // namespace

TEST(InsideTheCall, SmallMessagesAreSentAndReceivedWhole) {
  run_ranks(2, [](Communicator& c) {
    detail::Channel& ch = detail::channel(c);
    std::vector<unsigned char> go(1, 1);
    if (c.rank() == 0) {
      std::vector<unsigned char> a = filled(7, 8);
      CX_CHECK(ch.send_now(buf(a), 1, TagKind::kUser, 7));
      // Too large for the transport's short protocol: declined, nothing sent (tag 8's first
      // message is the posted one below).
      std::vector<unsigned char> big = filled(8, 1 << 20);
      CX_CHECK(!ch.send_now(buf(big), 1, TagKind::kUser, 8));
      std::vector<unsigned char> small = filled(9, 16);
      c.send({buf(small)}, 1, 8);
      // Bad arguments and a device buffer are declined: post() reports them.
      CX_CHECK(!ch.send_now(buf(a), 2, TagKind::kUser, 7));
      CX_CHECK(!ch.send_now(Buffer{nullptr, 8, MemoryType::kHost}, 1, TagKind::kUser, 7));
      CX_CHECK(!ch.send_now(Buffer{a.data(), 8, MemoryType::kCuda}, 1, TagKind::kUser, 7));
      c.recv({buf(go)}, 1, 1);  // rank 1 has posted its receive of tag 9
      std::vector<unsigned char> later = filled(10, 24);
      c.send({buf(later)}, 1, 9);
      // Larger messages there already: eager in fragments (UCX 1.13 completes those through the
      // callback inside the receive call) and rendezvous (UCX keeps the receive).
      std::vector<std::vector<unsigned char>> large;
      std::vector<Request> sends;
      for (std::uint32_t k = 0; k < kLarge.size(); ++k) {
        large.push_back(filled(11 + k, kLarge[k]));
        sends.push_back(c.isend(buf(large.back()), 1, 10 + k));
      }
      // Behind every fragment of those, in the endpoint's order.
      Request marker = c.isend(buf(go), 1, 30);
      for (Request& r : sends) r.wait();
      marker.wait();
    } else {
      await_arrival(c, 0, 7);
      std::vector<unsigned char> in(8);
      std::size_t got = 0;
      Request posted;
      CX_CHECK(ch.recv_now("recv", buf(in), 0, TagKind::kUser, 7, &got, &posted));
      CX_CHECK(!posted.valid());
      CX_CHECK_EQ(got, std::size_t{8});
      check_filled(in, 7, 8);
      std::vector<unsigned char> in8(16);
      c.recv({buf(in8)}, 0, 8);
      check_filled(in8, 9, 16);
      // Not there yet: posted, and it completes like any receive.
      std::vector<unsigned char> in9(32);
      Request r;
      CX_CHECK(!ch.recv_now("recv", buf(in9), 0, TagKind::kUser, 9, &got, &r));
      CX_CHECK(r.valid());
      c.send({buf(go)}, 0, 1);
      r.wait();
      CX_CHECK_EQ(r.bytes(), std::size_t{24});
      CX_CHECK_EQ(r.source(), 0);
      in9.resize(24);
      check_filled(in9, 10, 24);
      await_arrival(c, 0, 30);  // so every eager fragment before it has arrived
      for (std::uint32_t k = 0; k < kLarge.size(); ++k) {
        const std::uint32_t t = 10 + k;
        const std::size_t n = kLarge[k];
        const std::uint64_t id = 11 + k;
        await_arrival(c, 0, t);
        std::vector<unsigned char> in_large(n);
        Request rl;
        if (ch.recv_now("recv", buf(in_large), 0, TagKind::kUser, t, &got, &rl)) {
          CX_CHECK(!rl.valid());
          CX_CHECK_EQ(got, n);
        } else {
          CX_CHECK(rl.valid());
          rl.wait();
          CX_CHECK_EQ(rl.bytes(), n);
        }
        check_filled(in_large, id, n);
      }
      c.recv({buf(go)}, 0, 30);
    }
  });
}

TEST(InsideTheCall, AReceivePostedThereIsCancelledAndFailedAsAnyOther) {
  run_ranks(2, [](Communicator& c) {
    std::vector<unsigned char> done(1, 1);
    if (c.rank() == 0) {  // stays until rank 1 is through (a peer that is gone: recv_now declines)
      c.recv({buf(done)}, 1, 23);
      return;
    }
    detail::Channel& ch = detail::channel(c);
    std::vector<unsigned char> in(8);
    std::size_t got = 0;
    Request r;
    CX_CHECK(!ch.recv_now("recv", buf(in), 0, TagKind::kUser, 21, &got, &r));
    CX_CHECK(r.valid() && !r.done());
    r.cancel();
    CX_CHECK_HAS(expect_error(Errc::kCanceled, [&] { r.wait(std::chrono::seconds(5)); }), "recv");
    Request s;
    CX_CHECK(!ch.recv_now("recv", buf(in), 0, TagKind::kUser, 22, &got, &s));
    CX_CHECK(s.valid());
    c.send({buf(done)}, 0, 23);
    c.shutdown();
    CX_CHECK_HAS(expect_error(Errc::kCanceled, [&] { s.wait(std::chrono::seconds(5)); }),
                 "shut down");
  });
}

// A message that is there but too long, or packed differently, is taken by recv_now and fails
// the receive it returns with post()'s error: never a silent short read.
TEST(InsideTheCall, AMessageThatDoesNotFitFailsLoudly) {
  run_ranks(
      2,
      [](Communicator& c) {
        detail::Channel& ch = detail::channel(c);
        if (c.rank() == 0) {
          std::vector<unsigned char> a = filled(1, 16);
          c.send({buf(a)}, 1, 31);
          std::vector<unsigned char> x(8, 1), y(8, 2);
          c.send({buf(x), buf(y)}, 1, 32);  // packed: one IOV message
          std::vector<unsigned char> done(1);
          c.recv({buf(done)}, 1, 33);  // (a peer that is gone makes recv_now decline)
        } else {
          std::vector<unsigned char> in(8), in16(16);
          std::size_t got = 0;
          await_arrival(c, 0, 31);
          Request r;
          CX_CHECK(!ch.recv_now("recv", buf(in), 0, TagKind::kUser, 31, &got, &r));
          CX_CHECK(r.valid() && r.done());
          const std::string t = expect_error(Errc::kTruncated, [&] { r.wait(); });
          CX_CHECK_HAS(t, "too long");
          CX_CHECK_HAS(t, "peer 0");
          CX_CHECK_HAS(t, "the message is 16 bytes but the posted buffer holds 8 bytes");
          await_arrival(c, 0, 32);
          Request p;
          CX_CHECK(!ch.recv_now("recv", buf(in16), 0, TagKind::kUser, 32, &got, &p));
          CX_CHECK(p.valid() && p.done());
          CX_CHECK_HAS(expect_error(Errc::kWireMismatch, [&] { p.wait(); }), "COMMUX_COALESCE");
          std::vector<unsigned char> done(1, 1);
          c.send({buf(done)}, 0, 33);
        }
      },
      packing_on_rank_0());
}

// irecv and recv from a given peer take a message that is there already inside the call
// (recv_now): irecv returns a finished Request (source, bytes, no error), and recv returns
// without a post. Same-tag messages are still matched in the order they were sent: two small
// ones, and every size from eager fragments to a 1 MiB rendezvous ahead of a small one, each
// received only once it (and the marker behind it) has arrived. A message too long fails the
// irecv, named so, as a posted one would.
TEST(InsideTheCall, AReceiveOfAMessageThereIsTakenInsideTheCall) {
  run_ranks(2, [](Communicator& c) {
    std::vector<unsigned char> go(1, 1);
    if (c.rank() == 0) {
      std::vector<unsigned char> a = filled(3, 8), b = filled(4, 8), d = filled(5, 24);
      c.send({buf(a)}, 1, 5);
      c.send({buf(b)}, 1, 5);
      c.send({buf(d)}, 1, 6);
      c.send({buf(go)}, 1, 9);  // a marker: the messages before it have arrived with it
      for (std::uint32_t k = 0; k < kLarge.size(); ++k) {
        std::vector<unsigned char> large = filled(100 + k, kLarge[k]);
        std::vector<unsigned char> small = filled(200 + k, 8);
        Request rl = c.isend(buf(large), 1, 7);
        Request rs = c.isend(buf(small), 1, 7);
        c.send({buf(go)}, 1, 9);
        rs.wait();
        rl.wait();
      }
      std::vector<unsigned char> too_long = filled(6, 16);
      c.send({buf(too_long)}, 1, 8);
      c.send({buf(go)}, 1, 9);
      c.recv({buf(go)}, 1, 10);
    } else {
      await_arrival(c, 0, 9);
      c.recv({buf(go)}, 0, 9);
      std::vector<unsigned char> in_a(8), in_b(8), in_d(32);
      Request ra = c.irecv(buf(in_a), 0, 5);
      check_done_inside_call(ra, 0, 8);
      check_filled(in_a, 3, 8);
      Request rb = c.recv({buf(in_b)}, 0, 5);
      CX_CHECK_EQ(rb.bytes(), std::size_t{8});
      CX_CHECK_EQ(rb.source(), 0);
      check_filled(in_b, 4, 8);
      Request rd = c.irecv(buf(in_d), 0, 6);  // shorter than the buffer: its length is told
      check_done_inside_call(rd, 0, 24);
      in_d.resize(24);
      check_filled(in_d, 5, 24);
      for (std::uint32_t k = 0; k < kLarge.size(); ++k) {
        await_arrival(c, 0, 9);
        recv_large_then_small(c, k, 7);
        c.recv({buf(go)}, 0, 9);
      }
      await_arrival(c, 0, 9);
      std::vector<unsigned char> in8(8);
      Request rt = c.irecv(buf(in8), 0, 8);
      const std::string t = expect_error(Errc::kTruncated, [&] { rt.wait(); });
      CX_CHECK_HAS(t, "irecv");
      CX_CHECK_HAS(t, "the message is 16 bytes but the posted buffer holds 8 bytes");
      c.recv({buf(go)}, 0, 9);
      c.send({buf(go)}, 0, 10);
    }
  });
}

// isend of a small message the transport takes inside the call (send_now) returns a Request that
// is finished: source, bytes, no error, wait() and test() at once. (So did a posted 8-byte isend,
// which UCX completes at its post: what this guards is the order.) Behind a larger isend on the
// same tag, still in flight (eager fragments or rendezvous), it is matched second: a receive
// matches messages in the order they were sent, whichever path each took.
TEST(InsideTheCall, AnIsendTheTransportTakesReturnsAFinishedRequest) {
  run_ranks(2, [](Communicator& c) {
    std::vector<unsigned char> go(1, 1);
    if (c.rank() == 0) {
      std::vector<unsigned char> a = filled(3, 8);
      Request r = c.isend(buf(a), 1, 5);
      check_done_inside_call(r, 1, 8);
      for (int round = 0; round < 20; ++round) {
        for (std::uint32_t k = 0; k < kLarge.size(); ++k) {
          std::vector<unsigned char> large = filled(100 + k, kLarge[k]);
          std::vector<unsigned char> small = filled(200 + k, 8);
          Request rl = c.isend(buf(large), 1, 6);
          Request rs = c.isend(buf(small), 1, 6);
          rs.wait();
          rl.wait();
        }
        c.recv({buf(go)}, 1, 7);
      }
    } else {
      std::vector<unsigned char> in(8);
      c.recv({buf(in)}, 0, 5);
      check_filled(in, 3, 8);
      for (int round = 0; round < 20; ++round) {
        for (std::uint32_t k = 0; k < kLarge.size(); ++k) recv_large_then_small(c, k, 6);
        c.send({buf(go)}, 0, 7);
      }
    }
  });
}
