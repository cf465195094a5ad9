// The collectives' rank arithmetic (src/collectives/patterns.hpp), without a network: the data
// each pattern moves reaches every rank it must (rings, blocks, trees, recursive doubling and
// halving, Bruck) for world sizes 1..64 and every root. Whether the algorithms built on these
// patterns post matching sends and receives without deadlock is checked by running the real
// algorithms over a rendezvous loopback world (tests/test_simulator.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "patterns.hpp"

namespace pat = commux::coll::pattern;

namespace {
constexpr int kMaxWorld = 64;
}  // namespace

// Data flow, not just matching: which contributions each rank holds after each algorithm.
TEST(Patterns, HalvingDoublingAndGatherCarryEveryContribution) {
  for (int p = 1; p <= kMaxWorld; p *= 2) {
    // has[q][b]: the newranks whose data rank q holds for block b (recursive halving).
    std::vector<std::vector<std::set<int>>> has(
        static_cast<std::size_t>(p), std::vector<std::set<int>>(static_cast<std::size_t>(p)));
    for (int q = 0; q < p; ++q) {
      for (int b = 0; b < p; ++b)
        has[static_cast<std::size_t>(q)][static_cast<std::size_t>(b)] = {q};
    }
    std::vector<std::vector<pat::HalvingStep>> steps;
    for (int q = 0; q < p; ++q) steps.push_back(pat::recursive_halving(q, p));
    for (std::size_t k = 0; k < steps[0].size(); ++k) {
      auto next = has;
      for (int q = 0; q < p; ++q) {
        const auto& st = steps[static_cast<std::size_t>(q)][k];
        const auto& ps = steps[static_cast<std::size_t>(st.partner)][k];
        EXPECT_EQ(ps.partner, q);
        EXPECT_EQ(ps.send_lo, st.keep_lo);  // the partner sends what this rank keeps
        EXPECT_EQ(ps.send_hi, st.keep_hi);
        for (int b = st.keep_lo; b < st.keep_hi; ++b) {
          const auto& theirs =
              has[static_cast<std::size_t>(st.partner)][static_cast<std::size_t>(b)];
          next[static_cast<std::size_t>(q)][static_cast<std::size_t>(b)].insert(theirs.begin(),
                                                                                theirs.end());
        }
      }
      has = next;
    }
    for (int q = 0; q < p; ++q) {
      const auto& last = steps[static_cast<std::size_t>(q)];
      if (!last.empty()) {
        EXPECT_EQ(last.back().keep_lo, q);
        EXPECT_EQ(last.back().keep_hi, q + 1);
      }
      EXPECT_EQ(has[static_cast<std::size_t>(q)][static_cast<std::size_t>(q)].size(),
                static_cast<std::size_t>(p));
    }
    // Recursive doubling allgather: every rank ends with every block.
    std::vector<std::set<int>> blocks(static_cast<std::size_t>(p));
    for (int q = 0; q < p; ++q) blocks[static_cast<std::size_t>(q)] = {q};
    for (int mask = 1, k = 0; mask < p; mask *= 2, ++k) {
      auto next = blocks;
      for (int q = 0; q < p; ++q) {
        const auto st = pat::recursive_doubling_allgather(q, p)[static_cast<std::size_t>(k)];
        for (int b = st.send_lo; b < st.send_hi; ++b)
          EXPECT_EQ(blocks[static_cast<std::size_t>(q)].count(b), 1u);
        for (int b = st.recv_lo; b < st.recv_hi; ++b) next[static_cast<std::size_t>(q)].insert(b);
        EXPECT_EQ(blocks[static_cast<std::size_t>(st.partner)].count(st.recv_lo), 1u);
      }
      blocks = next;
    }
    for (int q = 0; q < p; ++q)
      EXPECT_EQ(blocks[static_cast<std::size_t>(q)].size(), static_cast<std::size_t>(p));
    // Gather towards every root: the root ends with every block, each sent by a holder.
    for (int root = 0; root < p; ++root) {
      std::vector<std::set<int>> held(static_cast<std::size_t>(p));
      for (int q = 0; q < p; ++q) held[static_cast<std::size_t>(q)] = {q};
      for (int mask = 1, k = 0; mask < p; mask *= 2, ++k) {
        for (int q = 0; q < p; ++q) {
          const auto gs = pat::halving_gather(q, root, p);
          if (static_cast<std::size_t>(k) >= gs.size() || gs[static_cast<std::size_t>(k)].send)
            continue;
          const auto& st = gs[static_cast<std::size_t>(k)];
          for (int b = st.lo; b < st.hi; ++b) {
            EXPECT_EQ(held[static_cast<std::size_t>(st.partner)].count(b), 1u);
            held[static_cast<std::size_t>(q)].insert(b);
          }
        }
      }
      EXPECT_EQ(held[static_cast<std::size_t>(root)].size(), static_cast<std::size_t>(p));
    }
  }
}

TEST(Patterns, BruckAndBinomialSubtreesCoverEveryRank) {
  for (int n = 1; n <= kMaxWorld; ++n) {
    // slot[r][i]: the block in rank r's slot i (-1: empty).
    std::vector<std::vector<int>> slot(static_cast<std::size_t>(n),
                                       std::vector<int>(static_cast<std::size_t>(n), -1));
    for (int r = 0; r < n; ++r) slot[static_cast<std::size_t>(r)][0] = r;
    const std::size_t steps = pat::bruck(0, n).size();
    for (std::size_t k = 0; k < steps; ++k) {
      auto next = slot;
      for (int r = 0; r < n; ++r) {
        const auto st = pat::bruck(r, n)[k];
        EXPECT_EQ(pat::bruck(st.recv_from, n)[k].send_to, r);
        for (int i = 0; i < st.blocks; ++i) {
          const int b = slot[static_cast<std::size_t>(st.recv_from)][static_cast<std::size_t>(i)];
          EXPECT_GE(b, 0);
          next[static_cast<std::size_t>(r)][static_cast<std::size_t>(st.recv_at + i)] = b;
        }
      }
      slot = next;
    }
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < n; ++i)
        EXPECT_EQ(slot[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)], (r + i) % n);
    }
    for (int root = 0; root < n; ++root) {
      for (int r = 0; r < n; ++r) {
        const int v = pat::relative_rank(r, n, root);
        int covered = 1;
        const auto kids = pat::binomial_tree(r, n, root).children;  // largest subtree first
        for (auto it = kids.rbegin(); it != kids.rend(); ++it) {
          const int vc = pat::relative_rank(*it, n, root);
          EXPECT_EQ(vc, v + covered);  // the children's ranges follow the rank's own, in order
          covered += pat::subtree_size(vc, n);
        }
        EXPECT_EQ(covered, pat::subtree_size(v, n));
      }
    }
  }
}

TEST(Patterns, RingsAndBlocks) {
  for (int n = 1; n <= kMaxWorld; ++n) {
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(pat::ring_left(pat::ring_right(r, n), n), r);
      // Allgather: the blocks received are every block but one's own, each once.
      std::set<int> got;
      for (int s = 0; s < n - 1; ++s) got.insert(pat::allgather_recv_block(r, n, s));
      EXPECT_EQ(got.size(), static_cast<std::size_t>(n - 1));
      EXPECT_EQ(got.count(r), 0u);
      // Reduce-scatter: the last block received is one's own.
      if (n > 1) {
        EXPECT_EQ(pat::reduce_scatter_recv_block(r, n, n - 2), r);
      }
    }
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{63},
                              std::size_t{64}, std::size_t{1000003}}) {
      const pat::Blocks bl{count, n};
      std::size_t sum = 0;
      for (int b = 0; b < n; ++b) {
        EXPECT_EQ(bl.offset(b), sum);
        EXPECT_LE(bl.size(b), bl.max());
        EXPECT_GE(bl.size(b) + 1, bl.max());
        sum += bl.size(b);
      }
      EXPECT_EQ(sum, count);
    }
  }
}

TEST(Patterns, ReduceRingCoversEveryContribution) {
  // Follow each block through the ring reduce-scatter: it must collect every rank's data once.
  for (int n = 2; n <= kMaxWorld; ++n) {
    for (int b = 0; b < n; ++b) {
      // Block b starts at the rank that sends it at step 0.
      int holder = -1;
      for (int r = 0; r < n; ++r) {
        if (pat::reduce_scatter_send_block(r, n, 0) == b) holder = r;
      }
      ASSERT_GE(holder, 0);
      std::set<int> contributed = {holder};
      for (int s = 0; s < n - 1; ++s) {
        const int next = pat::ring_right(holder, n);
        ASSERT_EQ(pat::reduce_scatter_recv_block(next, n, s), b);
        contributed.insert(next);
        holder = next;
      }
      EXPECT_EQ(holder, b);
      EXPECT_EQ(contributed.size(), static_cast<std::size_t>(n));
    }
  }
}

TEST(Patterns, TreesSpanEveryRankOnce) {
  for (int n = 1; n <= kMaxWorld; ++n) {
    for (int root = 0; root < n; ++root) {
      int parents = 0;
      std::vector<int> child_of(static_cast<std::size_t>(n), -1);
      for (int r = 0; r < n; ++r) {
        const pat::Tree t = pat::binomial_tree(r, n, root);
        if (r == root) {
          EXPECT_EQ(t.parent, -1);
        } else {
          ++parents;
          const pat::Tree pt = pat::binomial_tree(t.parent, n, root);
          EXPECT_EQ(std::count(pt.children.begin(), pt.children.end(), r), 1);
        }
        for (int c : t.children) {
          EXPECT_EQ(child_of[static_cast<std::size_t>(c)], -1);
          child_of[static_cast<std::size_t>(c)] = r;
        }
      }
      EXPECT_EQ(parents, n - 1);
      // Depth is at most ceil(log2 n).
      int depth = 0;
      while ((1 << depth) < n) ++depth;
      for (int r = 0; r < n; ++r) {
        int d = 0;
        for (int x = r; x != root; x = pat::binomial_tree(x, n, root).parent) ++d;
        EXPECT_LE(d, depth);
      }
    }
  }
}

TEST(Patterns, RecursiveDoublingReachesEveryRank) {
  using Role = pat::RecursiveDoubling::Role;
  for (int n = 1; n <= kMaxWorld; ++n) {
    // Track which ranks' data each rank holds after each step.
    std::vector<std::set<int>> has(static_cast<std::size_t>(n));
    std::vector<pat::RecursiveDoubling> rd;
    for (int r = 0; r < n; ++r) {
      has[static_cast<std::size_t>(r)] = {r};
      rd.push_back(pat::recursive_doubling(r, n));
    }
    for (int r = 0; r < n; ++r) {
      if (rd[static_cast<std::size_t>(r)].role == Role::kFoldIn) {
        has[static_cast<std::size_t>(r)].insert(rd[static_cast<std::size_t>(r)].fold_peer);
        EXPECT_EQ(rd[static_cast<std::size_t>(rd[static_cast<std::size_t>(r)].fold_peer)].role,
                  Role::kFoldOut);
      }
    }
    const std::size_t steps = rd[static_cast<std::size_t>(n - 1)].partners.size();
    for (std::size_t k = 0; k < steps; ++k) {
      auto next = has;
      for (int r = 0; r < n; ++r) {
        const auto& me = rd[static_cast<std::size_t>(r)];
        if (me.role == Role::kFoldOut) continue;
        ASSERT_EQ(me.partners.size(), steps);
        const int q = me.partners[k];
        EXPECT_EQ(rd[static_cast<std::size_t>(q)].partners[k], r);  // symmetric
        next[static_cast<std::size_t>(r)].insert(has[static_cast<std::size_t>(q)].begin(),
                                                 has[static_cast<std::size_t>(q)].end());
      }
      has = next;
    }
    for (int r = 0; r < n; ++r) {
      if (rd[static_cast<std::size_t>(r)].role == Role::kFoldOut) continue;
      EXPECT_EQ(has[static_cast<std::size_t>(r)].size(), static_cast<std::size_t>(n))
          << "n=" << n << " r=" << r;
    }
  }
}
