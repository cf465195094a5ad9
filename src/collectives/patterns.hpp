// Rank arithmetic of the collective algorithms, apart from any communication: who talks to whom,
// in which order, about which block. Pure functions of (rank, size[, root]), so that
// tests/test_patterns.cpp can check for every world size that each send has a matching receive,
// in the same order, and that the schedules cannot deadlock.
#pragma once

#include <cstddef>
#include <vector>

namespace commux::coll::pattern {

inline int mod(int a, int n) { return ((a % n) + n) % n; }

// ---- ring ----------------------------------------------------------------------------------
inline int ring_right(int r, int n) { return mod(r + 1, n); }
inline int ring_left(int r, int n) { return mod(r - 1, n); }

// Ring allgather, rank r starting with block r: at step s (0 .. n-2) it sends block
// (r - s) mod n to the right and receives block (r - s - 1) mod n from the left, which it sends on
// at step s + 1.
inline int allgather_send_block(int r, int n, int s) { return mod(r - s, n); }
inline int allgather_recv_block(int r, int n, int s) { return mod(r - s - 1, n); }

// Ring reduce-scatter ending with block r fully reduced on rank r: at step s (0 .. n-2) rank r
// sends its partial of block (r - s - 1) mod n to the right and receives the left's partial of
// block (r - s - 2) mod n, which it reduces with its own contribution and sends on at step s + 1.
// The last receive (s = n - 2) is block r.
inline int reduce_scatter_send_block(int r, int n, int s) { return mod(r - s - 1, n); }
inline int reduce_scatter_recv_block(int r, int n, int s) { return mod(r - s - 2, n); }

// `count` elements split into n nearly equal blocks: the first count % n blocks hold one more.
struct Blocks {
  std::size_t count = 0;
  int n = 1;
  std::size_t size(int b) const {
    const auto nn = static_cast<std::size_t>(n);
    return count / nn + (static_cast<std::size_t>(b) < count % nn ? 1 : 0);
  }
  std::size_t offset(int b) const {
    const auto nn = static_cast<std::size_t>(n), bb = static_cast<std::size_t>(b);
    const std::size_t extra = count % nn;
    return bb * (count / nn) + (bb < extra ? bb : extra);
  }
  std::size_t max() const { return size(0); }
};

// ---- recursive doubling with the non-power-of-two fold ----------------------------------------
// p = largest power of two <= n, rem = n - p. Ranks below 2 * rem pair up (2i, 2i+1): the even
// one sends its data to the odd one and sits out (kFoldOut), the odd one reduces and takes part
// (kFoldIn). The p participants then exchange with partner (newrank ^ mask) for mask = 1, 2, .. p/2.
// At the end each kFoldIn rank sends the result to its kFoldOut partner.
struct RecursiveDoubling {
  enum class Role { kCore, kFoldIn, kFoldOut };
  Role role = Role::kCore;
  int fold_peer = -1;         // the partner of the fold (kFoldIn / kFoldOut), else -1
  std::vector<int> partners;  // real ranks, in step order (empty for kFoldOut)
};

inline int pow2_floor(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

inline RecursiveDoubling recursive_doubling(int r, int n) {
  RecursiveDoubling rd;
  const int p = pow2_floor(n);
  const int rem = n - p;
  int newrank;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      rd.role = RecursiveDoubling::Role::kFoldOut;
      rd.fold_peer = r + 1;
      return rd;
    }
    rd.role = RecursiveDoubling::Role::kFoldIn;
    rd.fold_peer = r - 1;
    newrank = r / 2;
  } else {
    newrank = r - rem;
  }
  for (int mask = 1; mask < p; mask <<= 1) {
    const int pn = newrank ^ mask;
    rd.partners.push_back(pn < rem ? pn * 2 + 1 : pn + rem);
  }
  return rd;
}

// ---- binomial tree --------------------------------------------------------------------------
// Relative rank vr = (r - root) mod n; the parent of vr != 0 is vr minus its lowest set bit, and
// the children of vr are vr + m for the powers of two m below vr's lowest set bit (below n for the
// root) with vr + m < n. `children` lists them largest subtree first: broadcast sends in this
// order, reduce receives in the reverse order (smallest subtree first, as it is ready first).
struct Tree {
  int parent = -1;  // real rank, -1 at the root
  std::vector<int> children;  // real ranks, largest subtree first
};

inline Tree binomial_tree(int r, int n, int root) {
  Tree t;
  const int vr = mod(r - root, n);
  int limit = 1;  // lowest set bit of vr, or the smallest power of two >= n for the root
  if (vr == 0) {
    while (limit < n) limit <<= 1;
  } else {
    limit = vr & -vr;
    t.parent = mod(vr - limit + root, n);
  }
  for (int m = limit >> 1; m >= 1; m >>= 1) {
    if (vr + m < n) t.children.push_back(mod(vr + m + root, n));
  }
  return t;
}

// ---- dissemination (barrier) ----------------------------------------------------------------
// Round k (distance d = 2^k < n): send to (r + d) mod n, receive from (r - d) mod n.
struct Round {
  int send_to;
  int recv_from;
};

inline std::vector<Round> dissemination(int r, int n) {
  std::vector<Round> rounds;
  for (int d = 1; d < n; d <<= 1) rounds.push_back(Round{mod(r + d, n), mod(r - d, n)});
  return rounds;
}

}  // namespace commux::coll::pattern
