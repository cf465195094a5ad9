// Randomized out-of-order stress: several ranks, thousands of messages, random sizes 0..1 MiB,
// random tags, some any-source. Every message must arrive exactly once with the right bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "harness.hpp"

using namespace commux;
using namespace commux::test;

namespace {

struct Msg {
  int id, src, dst;
  std::uint32_t tag;
  std::size_t size;
  bool any_source;
};

// The same plan on every rank (same seed).
std::vector<Msg> make_plan(int ranks, int count, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> rank_d(0, ranks - 1);
  std::uniform_int_distribution<std::uint32_t> tag_d(0, 11);
  std::uniform_real_distribution<double> logsize(0.0, std::log(double(1 << 20)));
  std::vector<Msg> plan;
  for (int i = 0; i < count; ++i) {
    Msg m;
    m.id = i;
    m.src = rank_d(rng);
    m.dst = rank_d(rng);
    m.any_source = rng() % 10 == 0;
    // Any-source messages get a tag of their own so exactly one message can match them.
    m.tag = m.any_source ? 1000000u + static_cast<std::uint32_t>(i) : tag_d(rng);
    const int r = static_cast<int>(rng() % 20);
    m.size = r == 0 ? 0 : static_cast<std::size_t>(std::exp(logsize(rng)));
    plan.push_back(m);
  }
  return plan;
}

// Shuffles the order of this rank's operations, but keeps operations on the same
// (src, dst, tag) in plan order on both sides (so the k-th receive posted for a (src, tag) is the
// k-th message sent on it, as MPI ordering promises).
std::vector<std::pair<bool, const Msg*>> local_order(const std::vector<Msg>& plan, int me,
                                                     unsigned seed) {
  std::vector<std::pair<bool, const Msg*>> ops;  // (is_send, msg)
  for (const Msg& m : plan) {
    if (m.src == me) ops.push_back({true, &m});
    if (m.dst == me) ops.push_back({false, &m});
  }
  std::vector<std::size_t> slots(ops.size());
  for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(ops.begin(), ops.end(), rng);
  std::map<std::tuple<bool, int, int, std::uint32_t>, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const Msg* m = ops[i].second;
    groups[{ops[i].first, m->src, m->dst, m->tag}].push_back(i);
  }
  for (auto& [key, positions] : groups) {
    std::vector<const Msg*> msgs;
    for (std::size_t p : positions) msgs.push_back(ops[p].second);
    std::sort(msgs.begin(), msgs.end(), [](const Msg* a, const Msg* b) { return a->id < b->id; });
    for (std::size_t k = 0; k < positions.size(); ++k) ops[positions[k]].second = msgs[k];
  }
  return ops;
}

void run_stress(Communicator& c, int count, unsigned seed) {
  const auto plan = make_plan(c.size(), count, seed);
  const auto ops = local_order(plan, c.rank(), seed * 31 + static_cast<unsigned>(c.rank()));
  std::vector<std::vector<unsigned char>> bufs(ops.size());
  std::vector<Request> reqs(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const Msg& m = *ops[i].second;
    bufs[i].resize(m.size);
    if (ops[i].first) {
      for (std::size_t j = 0; j < m.size; ++j)
        bufs[i][j] = pattern(static_cast<std::uint64_t>(m.id), j);
      reqs[i] = c.isend(Buffer{bufs[i].data(), m.size}, m.dst, m.tag);
    } else {
      reqs[i] = c.irecv(Buffer{bufs[i].data(), m.size}, m.any_source ? kAnySource : m.src, m.tag);
    }
  }
  std::size_t received = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    reqs[i].wait(std::chrono::seconds(60));
    if (ops[i].first) continue;
    const Msg& m = *ops[i].second;
    ++received;
    CX_CHECK_EQ(reqs[i].source(), m.src);
    CX_CHECK_EQ(reqs[i].bytes(), m.size);
    for (std::size_t j = 0; j < m.size; ++j) {
      if (bufs[i][j] != pattern(static_cast<std::uint64_t>(m.id), j)) {
        check_failed(__FILE__, __LINE__,
                     "message " + std::to_string(m.id) + " byte " + std::to_string(j) +
                         " is wrong");
      }
    }
  }
  std::size_t expected = 0;
  for (const Msg& m : plan) expected += m.dst == c.rank();
  CX_CHECK_EQ(received, expected);
}

}  // namespace

class Stress : public ::testing::TestWithParam<int> {};

TEST_P(Stress, RandomOutOfOrderTraffic) {
  const int ranks = GetParam();
  RunOptions o;
  o.timeout_s = 120;
  run_ranks(ranks, [](Communicator& c) { run_stress(c, 4000, 20261130u); }, o);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Stress, ::testing::Values(3, 4));
