// Point-to-point semantics across processes: matching, ordering, any-source, multi-buffer,
// zero bytes, world sizes 1..4, threads, background progress.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "harness.hpp"

using namespace commux;
using namespace commux::test;

namespace {

std::vector<unsigned char> filled(std::uint64_t id, std::size_t n) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = pattern(id, i);
  return v;
}

void check_filled(const std::vector<unsigned char>& v, std::uint64_t id, std::size_t n) {
  CX_CHECK_EQ(v.size(), n);
  for (std::size_t i = 0; i < n; ++i) {
    if (v[i] != pattern(id, i)) {
      check_failed(__FILE__, __LINE__,
                   "byte " + std::to_string(i) + " of message " + std::to_string(id) + " is wrong");
    }
  }
}

Buffer buf(std::vector<unsigned char>& v) { return Buffer{v.data(), v.size()}; }

}  // namespace

// Every rank sends to every rank (itself included) for counts 0, 1, odd and large.
class WorldSize : public ::testing::TestWithParam<int> {};

TEST_P(WorldSize, AllPairsAllCounts) {
  const int n = GetParam();
  run_ranks(n, [](Communicator& c) {
    const int me = c.rank(), size = c.size();
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1001},
                              std::size_t{1} << 20}) {
      std::vector<std::vector<unsigned char>> out(size), in(size);
      std::vector<Request> reqs;
      for (int p = 0; p < size; ++p) {
        in[p].assign(count, 0);
        reqs.push_back(c.irecv(buf(in[p]), p, 7));
      }
      for (int p = 0; p < size; ++p) {
        out[p] = filled(static_cast<std::uint64_t>(me * 100 + p), count);
        reqs.push_back(c.isend(buf(out[p]), p, 7));
      }
      for (auto& r : reqs) r.wait();
      for (int p = 0; p < size; ++p) {
        check_filled(in[p], static_cast<std::uint64_t>(p * 100 + me), count);
        CX_CHECK_EQ(reqs[static_cast<std::size_t>(p)].bytes(), count);
        CX_CHECK_EQ(reqs[static_cast<std::size_t>(p)].source(), p);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Sizes, WorldSize, ::testing::Values(1, 2, 3, 4));

// Each side posts 16 tagged operations in its own shuffled order; sizes cross the eager /
// rendezvous boundary.
TEST(P2P, OutOfOrderTags) {
  run_ranks(2, [](Communicator& c) {
    const int peer = 1 - c.rank();
    std::vector<int> tags(16);
    std::iota(tags.begin(), tags.end(), 100);
    std::mt19937 rng(static_cast<unsigned>(1234 + c.rank()));
    std::shuffle(tags.begin(), tags.end(), rng);
    auto size_of = [](int tag) { return static_cast<std::size_t>((tag % 4) * 90000 + tag); };
    std::vector<std::vector<unsigned char>> data(16);
    std::vector<Request> reqs;
    for (std::size_t i = 0; i < tags.size(); ++i) {
      const int t = tags[i];
      if (c.rank() == 0) {
        data[i] = filled(static_cast<std::uint64_t>(t), size_of(t));
        reqs.push_back(c.isend(buf(data[i]), peer, t));
      } else {
        data[i].assign(size_of(t), 0);
        reqs.push_back(c.irecv(buf(data[i]), peer, t));
      }
    }
    for (auto& r : reqs) r.wait();
    if (c.rank() == 1) {
      for (std::size_t i = 0; i < tags.size(); ++i) {
        check_filled(data[i], static_cast<std::uint64_t>(tags[i]), size_of(tags[i]));
      }
    }
  });
}

// Messages on one (sender, tag) are received in posting order, eager and rendezvous mixed.
TEST(P2P, SameTagKeepsOrder) {
  run_ranks(2, [](Communicator& c) {
    const int peer = 1 - c.rank();
    const int kMsgs = 40;
    auto size_of = [](int i) { return static_cast<std::size_t>((i % 3 == 0) ? 200000 + i : 50 + i); };
    std::vector<std::vector<unsigned char>> data(kMsgs);
    std::vector<Request> reqs;
    for (int i = 0; i < kMsgs; ++i) {
      if (c.rank() == 0) {
        data[i] = filled(static_cast<std::uint64_t>(i), size_of(i));
        reqs.push_back(c.isend(buf(data[i]), peer, 3));
      } else {
        data[i].assign(size_of(i), 0);
        reqs.push_back(c.irecv(buf(data[i]), peer, 3));
      }
    }
    for (auto& r : reqs) r.wait();
    if (c.rank() == 1) {
      for (int i = 0; i < kMsgs; ++i) check_filled(data[i], static_cast<std::uint64_t>(i), size_of(i));
    }
  });
}

// Any-source receives report the real sender; each sender is seen exactly once.
TEST(P2P, AnySourceReportsSender) {
  run_ranks(4, [](Communicator& c) {
    if (c.rank() == 0) {
      std::vector<std::vector<unsigned char>> in(3, std::vector<unsigned char>(64));
      std::vector<Request> reqs;
      for (auto& v : in) reqs.push_back(c.irecv(buf(v), kAnySource, 5));
      std::set<int> seen;
      for (std::size_t i = 0; i < reqs.size(); ++i) {
        reqs[i].wait();
        const int src = reqs[i].source();
        CX_CHECK(src >= 1 && src <= 3);
        CX_CHECK(seen.insert(src).second);
        check_filled(in[i], static_cast<std::uint64_t>(src), 64);
      }
    } else {
      auto out = filled(static_cast<std::uint64_t>(c.rank()), 64);
      c.send({buf(out)}, 0, 5);
    }
  });
}

// A list of buffers is one operation, in separate parts (default) and packed (COMMUX_COALESCE).
class MultiBuffer : public ::testing::TestWithParam<Packing> {};

TEST_P(MultiBuffer, ListIsOneOperation) {
  RunOptions o;
  o.comm.packing = GetParam();
  run_ranks(2, [](Communicator& c) {
    const std::vector<std::size_t> sizes = {10, 0, 70000, 3};
    std::vector<std::vector<unsigned char>> v(sizes.size());
    std::vector<Buffer> bufs;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      v[i] = c.rank() == 0 ? filled(i, sizes[i]) : std::vector<unsigned char>(sizes[i]);
      bufs.push_back(buf(v[i]));
    }
    const std::size_t total = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
    if (c.rank() == 0) {
      c.send(bufs, 1, 11);
      c.send(bufs, 1, 12);
    } else {
      Request r = c.recv(bufs, 0, 11);
      CX_CHECK_EQ(r.bytes(), total);
      for (std::size_t i = 0; i < sizes.size(); ++i) check_filled(v[i], i, sizes[i]);
      for (auto& x : v) std::fill(x.begin(), x.end(), 0);
      Request any = c.recv(bufs, kAnySource, 12);
      CX_CHECK_EQ(any.source(), 0);
      CX_CHECK_EQ(any.bytes(), total);
      for (std::size_t i = 0; i < sizes.size(); ++i) check_filled(v[i], i, sizes[i]);
    }
  }, o);
}

INSTANTIATE_TEST_SUITE_P(Packings, MultiBuffer, ::testing::Values(Packing::kParts, Packing::kIov));

// A rank that packs multi-buffer messages while its peer does not gets a clear error, not garbage.
TEST(P2P, PackingMismatchIsReported) {
  RunOptions o;
  o.comm_for_rank = [](int rank) {
    Options x = default_test_options();
    x.packing = rank == 0 ? Packing::kIov : Packing::kParts;
    return x;
  };
  run_ranks(2, [](Communicator& c) {
    std::vector<unsigned char> a(16, 1), b(16, 2);
    std::vector<Buffer> bufs = {buf(a), buf(b)};
    if (c.rank() == 0) {
      c.send(bufs, 1, 4);
    } else {
      const std::string msg = expect_error(Errc::kWireMismatch, [&] { c.recv(bufs, 0, 4); });
      CX_CHECK_HAS(msg, "COMMUX_COALESCE");
      CX_CHECK_HAS(msg, "peer 0");
    }
  }, o);
}

// Several threads per rank post and wait at once.
TEST(P2P, ManyThreadsPostAndWait) {
  run_ranks(2, [](Communicator& c) {
    const int peer = 1 - c.rank();
    const int kThreads = 4, kMsgs = 100;
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        try {
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
        } catch (const std::exception& e) {
          std::fprintf(stderr, "thread %d: %s\n", t, e.what());
          failures.fetch_add(1);
        }
      });
    }
    for (auto& th : threads) th.join();
    CX_CHECK_EQ(failures.load(), 0);
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
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.isend(buf(v), 2, 1); }), "isend: peer 2");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.isend(buf(v), kAnySource, 1); }), "isend");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.irecv(buf(v), -5, 1); }), "irecv: peer -5");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.isend(buf(v), 0, -1); }), "tag -1");
    CX_CHECK_HAS(expect_error(Errc::kInvalidArgument, [&] { c.irecv(buf(v), 0, std::int64_t{1} << 32); }),
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
