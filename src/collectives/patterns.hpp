// Rank arithmetic of the collective algorithms, apart from any communication: who talks to whom,
// in which order, about which block. Pure functions of (rank, size[, root]), so that
// tests/test_patterns.cpp can check for every world size that each send has a matching receive,
// in the same order, and that the schedules cannot deadlock.
#pragma once

#include <algorithm>
#include <cstddef>
#include <iterator>
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
// At most 31 children (one per bit of an int rank), kept inline: small collectives build a tree
// per call and should not allocate for it.
class Children {
 public:
  static constexpr int kMax = 31;
  void push_back(int r) noexcept { v_[n_++] = r; }
  std::size_t size() const noexcept { return static_cast<std::size_t>(n_); }
  bool empty() const noexcept { return n_ == 0; }
  int operator[](std::size_t i) const noexcept { return v_[i]; }
  const int* begin() const noexcept { return v_; }
  const int* end() const noexcept { return v_ + n_; }
  std::reverse_iterator<const int*> rbegin() const noexcept {
    return std::reverse_iterator<const int*>(end());
  }
  std::reverse_iterator<const int*> rend() const noexcept {
    return std::reverse_iterator<const int*>(begin());
  }

 private:
  int v_[kMax];  // [0, n_) set; not zeroed (a tree is built per call)
  int n_ = 0;
};

struct Tree {
  int parent = -1;    // real rank, -1 at the root
  Children children;  // real ranks, largest subtree first
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

// ---- the power-of-two fold (Rabenseifner, recursive halving) ----------------------------------
// The same fold as recursive_doubling(): p = pow2_floor(n), rem = n - p; ranks below 2 * rem pair
// up (2i, 2i+1), the even one hands its data to the odd one and sits out. The p remaining ranks
// are numbered 0..p-1 ("newrank"): the odd rank 2i+1 is newrank i, a rank r >= 2 * rem is r - rem.
inline bool is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

// newrank of real rank r, or -1 for a rank that folds out.
inline int fold_newrank(int r, int n) {
  const int rem = n - pow2_floor(n);
  if (r < 2 * rem) return r % 2 == 1 ? r / 2 : -1;
  return r - rem;
}
// Real rank of newrank q.
inline int fold_real(int q, int n) {
  const int rem = n - pow2_floor(n);
  return q < rem ? 2 * q + 1 : q + rem;
}

// ---- recursive halving (reduce-scatter among p = 2^k ranks) -------------------------------------
// Blocks 0..p-1, newrank q. Step k (mask = p/2, p/4, .., 1): the rank holds the block range
// [lo, hi) (all blocks at first), exchanges with partner q ^ mask: it sends the half not containing
// block q and keeps (receives the partner's partial of, and reduces) the half containing q. After
// the last step it holds block q. Partners in newrank space.
struct HalvingStep {
  int partner;
  int send_lo, send_hi;  // blocks [send_lo, send_hi) go to the partner
  int keep_lo, keep_hi;  // blocks [keep_lo, keep_hi) come from the partner
};

inline std::vector<HalvingStep> recursive_halving(int q, int p) {
  std::vector<HalvingStep> steps;
  int lo = 0, hi = p;
  for (int mask = p / 2; mask >= 1; mask /= 2) {
    const int mid = lo + (hi - lo) / 2;
    HalvingStep st{q ^ mask, mid, hi, lo, mid};
    if ((q & mask) != 0) st = HalvingStep{q ^ mask, lo, mid, mid, hi};
    steps.push_back(st);
    lo = st.keep_lo;
    hi = st.keep_hi;
  }
  return steps;
}

// ---- recursive doubling allgather (p = 2^k ranks) ----------------------------------------------
// Newrank q starts with block q. Step k (mask = 1, 2, .., p/2): partner q ^ mask; the rank sends the
// aligned group of `mask` blocks containing q and receives the partner's group, so it then holds
// the aligned group of 2 * mask blocks.
struct DoublingStep {
  int partner;
  int send_lo, send_hi;
  int recv_lo, recv_hi;
};

inline std::vector<DoublingStep> recursive_doubling_allgather(int q, int p) {
  std::vector<DoublingStep> steps;
  for (int mask = 1; mask < p; mask *= 2) {
    const int mine = q & ~(mask - 1), theirs = (q ^ mask) & ~(mask - 1);
    steps.push_back(DoublingStep{q ^ mask, mine, mine + mask, theirs, theirs + mask});
  }
  return steps;
}

// ---- binomial gather towards a newrank root after recursive halving (Rabenseifner reduce) ------
// Newrank q holds block q. With v = q ^ qroot, step k (mask = 1, 2, .., p/2): a rank with v & mask
// sends the aligned group of `mask` blocks it holds to q ^ mask and is done; the others receive the
// partner's group and then hold the aligned group of 2 * mask blocks. qroot ends with all blocks.
struct GatherStep {
  int partner;
  bool send;  // send [lo, hi) (and stop), else receive [lo, hi)
  int lo, hi;
};

inline std::vector<GatherStep> halving_gather(int q, int qroot, int p) {
  std::vector<GatherStep> steps;
  const int v = q ^ qroot;
  for (int mask = 1; mask < p; mask *= 2) {
    if ((v & mask) != 0) {
      const int mine = q & ~(mask - 1);
      steps.push_back(GatherStep{q ^ mask, true, mine, mine + mask});
      break;
    }
    const int theirs = (q ^ mask) & ~(mask - 1);
    steps.push_back(GatherStep{q ^ mask, false, theirs, theirs + mask});
  }
  return steps;
}

// ---- Bruck allgather (any n) ------------------------------------------------------------------
// A temporary of n blocks in rotated order: slot i holds block (r + i) mod n, slot 0 is the rank's
// own. Step k (distance d = 2^k < n): send slots [0, m) to (r - d) mod n and receive m blocks into
// slots [d, d + m) from (r + d) mod n, with m = min(d, n - d). After ceil(log2 n) steps all n slots
// are filled.
struct BruckStep {
  int send_to;
  int recv_from;
  int blocks;   // m
  int recv_at;  // d
};

inline std::vector<BruckStep> bruck(int r, int n) {
  std::vector<BruckStep> steps;
  for (int d = 1; d < n; d *= 2)
    steps.push_back(BruckStep{mod(r - d, n), mod(r + d, n), std::min(d, n - d), d});
  return steps;
}

// ---- binomial gather / scatter ----------------------------------------------------------------
// Over binomial_tree(r, n, root): relative rank v = (r - root) mod n owns the relative ranks
// [v, v + subtree_size(v, n)): its own and its descendants'. Gather: each rank collects its
// children's ranges (in relative order, contiguous) and sends its whole range to its parent;
// scatter is the reverse.
inline int relative_rank(int r, int n, int root) { return mod(r - root, n); }

inline int subtree_size(int v, int n) {
  if (v == 0) return n;
  return std::min(v & -v, n - v);
}

// ---- pairwise exchange (alltoall) -------------------------------------------------------------
// Step i = 1 .. n-1: send to (r + i) mod n, receive from (r - i) mod n. At most `window` steps are
// in flight: step i + window is posted once step i's receive and send have completed.
inline int pairwise_send_to(int r, int n, int i) { return mod(r + i, n); }
inline int pairwise_recv_from(int r, int n, int i) { return mod(r - i, n); }

}  // namespace commux::coll::pattern
