// Point-to-point semantics across processes: matching, ordering, any-source, multi-buffer,
// zero bytes, world sizes 1..4, threads, background progress.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

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

// A rank that packs multi-buffer messages while its peer does not gets a clear error, not garbage.
TEST(P2P, PackingMismatchIsReported) {
  RunOptions o;
  o.comm_for_rank = [](int rank) {
    Options x = default_test_options();
    x.packing = rank == 0 ? Packing::kIov : Packing::kParts;
    return x;
  };
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
      o);
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
