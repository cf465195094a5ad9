// The collectives' rank arithmetic (src/collectives/patterns.hpp), without a network: for world
// sizes 1..64 (and every root for the rooted ones), each algorithm's schedule -- written here
// step by step as the algorithm posts and waits -- is run by a simulator in which a send completes
// only once its receive is posted (rendezvous, the worst case). The check: every rank finishes
// (no deadlock), every send meets a receive posted by its peer in the same order (messages on one
// (sender, tag) match in posting order) about the same block, and nothing is left unmatched.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "patterns.hpp"

namespace pat = commux::coll::pattern;

namespace {

constexpr int kMaxWorld = 64;

struct Op {
  enum Kind { kSend, kRecv, kWait, kWaitAll } kind;
  int peer = -1;
  long label = 0;  // what the message carries (block index, round), compared on matching
  int ref = -1;    // kWait: the index of the op waited for
};

// One rank's program, built the way the algorithm posts and waits.
class Prog {
 public:
  int send(int peer, long label) { return push({Op::kSend, peer, label, -1}); }
  int recv(int peer, long label) { return push({Op::kRecv, peer, label, -1}); }
  void wait(int id) { push({Op::kWait, -1, 0, id}); }
  void wait_all() { push({Op::kWaitAll, -1, 0, -1}); }
  std::vector<Op> ops;

 private:
  int push(Op o) {
    ops.push_back(o);
    return static_cast<int>(ops.size()) - 1;
  }
};

// Runs all programs; returns "" or what went wrong.
std::string simulate(const std::vector<Prog>& progs) {
  const int n = static_cast<int>(progs.size());
  // Per (sender, receiver): the labels sent and the labels the receiver expects, in posting order,
  // and the op index of each, to mark matches.
  struct Chan {
    std::vector<std::pair<long, int>> sends, recvs;  // (label, op index)
  };
  std::map<std::pair<int, int>, Chan> chans;
  std::vector<std::vector<bool>> posted(static_cast<std::size_t>(n)), matched(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    posted[static_cast<std::size_t>(r)].assign(progs[static_cast<std::size_t>(r)].ops.size(), false);
    matched[static_cast<std::size_t>(r)].assign(progs[static_cast<std::size_t>(r)].ops.size(), false);
  }
  std::vector<std::size_t> pc(static_cast<std::size_t>(n), 0);
  std::string error;
  auto try_match = [&](int from, int to) -> bool {
    Chan& c = chans[{from, to}];
    const std::size_t k = std::min(c.sends.size(), c.recvs.size());
    for (std::size_t i = 0; i < k; ++i) {
      if (c.sends[i].first != c.recvs[i].first) {
        error = "message " + std::to_string(i) + " from " + std::to_string(from) + " to " +
                std::to_string(to) + " carries " + std::to_string(c.sends[i].first) +
                " but the receive expects " + std::to_string(c.recvs[i].first);
        return false;
      }
      matched[static_cast<std::size_t>(from)][static_cast<std::size_t>(c.sends[i].second)] = true;
      matched[static_cast<std::size_t>(to)][static_cast<std::size_t>(c.recvs[i].second)] = true;
    }
    return true;
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < n; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      const auto& ops = progs[ru].ops;
      while (pc[ru] < ops.size()) {
        const Op& o = ops[pc[ru]];
        const int idx = static_cast<int>(pc[ru]);
        if (o.kind == Op::kSend || o.kind == Op::kRecv) {
          if (o.peer < 0 || o.peer >= n) return "rank " + std::to_string(r) + " talks to " + std::to_string(o.peer);
          const int from = o.kind == Op::kSend ? r : o.peer;
          const int to = o.kind == Op::kSend ? o.peer : r;
          auto& list = o.kind == Op::kSend ? chans[{from, to}].sends : chans[{from, to}].recvs;
          list.emplace_back(o.label, idx);
          posted[ru][pc[ru]] = true;
          if (!try_match(from, to)) return error;
        } else if (o.kind == Op::kWait) {
          if (!posted[ru][static_cast<std::size_t>(o.ref)]) return "rank " + std::to_string(r) + " waits for an unposted op";
          if (!matched[ru][static_cast<std::size_t>(o.ref)]) break;
        } else {
          bool all = true;
          for (std::size_t i = 0; i < pc[ru]; ++i) {
            if ((ops[i].kind == Op::kSend || ops[i].kind == Op::kRecv) && !matched[ru][i]) all = false;
          }
          if (!all) break;
        }
        ++pc[ru];
        progress = true;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    if (pc[ru] < progs[ru].ops.size()) {
      const Op& o = progs[ru].ops[pc[ru]];
      const int ref = o.kind == Op::kWait ? o.ref : -1;
      return "deadlock: rank " + std::to_string(r) + " of " + std::to_string(n) +
             " blocks at op " + std::to_string(pc[ru]) +
             (ref >= 0 ? " waiting for a message with peer " +
                             std::to_string(progs[ru].ops[static_cast<std::size_t>(ref)].peer)
                       : std::string(" (wait all)"));
    }
  }
  for (const auto& [key, c] : chans) {
    if (c.sends.size() != c.recvs.size()) {
      return std::to_string(c.sends.size()) + " sends from " + std::to_string(key.first) + " to " +
             std::to_string(key.second) + " but " + std::to_string(c.recvs.size()) + " receives";
    }
  }
  for (int r = 0; r < n; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    for (std::size_t i = 0; i < progs[ru].ops.size(); ++i) {
      const auto k = progs[ru].ops[i].kind;
      if ((k == Op::kSend || k == Op::kRecv) && !matched[ru][i]) return "an op was never matched";
    }
  }
  return "";
}

// ---- schedules, step by step as src/collectives/*.cpp post and wait ----------------------------

Prog barrier(int r, int n) {
  Prog p;
  if (n == 1) return p;
  const auto rounds = pat::dissemination(r, n);
  std::vector<int> recvs;
  for (std::size_t k = 0; k < rounds.size(); ++k) recvs.push_back(p.recv(rounds[k].recv_from, static_cast<long>(k)));
  for (std::size_t k = 0; k < rounds.size(); ++k) {
    if (k > 0) p.wait(recvs[k - 1]);
    p.send(rounds[k].send_to, static_cast<long>(k));
  }
  p.wait_all();
  return p;
}

Prog bcast_binomial(int r, int n, int root) {
  Prog p;
  const pat::Tree t = pat::binomial_tree(r, n, root);
  if (t.parent >= 0) p.wait(p.recv(t.parent, 0));
  for (int c : t.children) p.send(c, 0);
  p.wait_all();
  return p;
}

void ring_allgather(Prog& p, int r, int n, int first_wait = -1, int skip_recv_rank = -1,
                    int skip_send_to = -1) {
  const int left = pat::ring_left(r, n), right = pat::ring_right(r, n);
  std::vector<int> recvs;
  if (r != skip_recv_rank) {
    for (int s = 0; s < n - 1; ++s) recvs.push_back(p.recv(left, pat::allgather_recv_block(r, n, s)));
  }
  for (int s = 0; s < n - 1; ++s) {
    if (r != skip_recv_rank) {
      if (s == 0 && first_wait >= 0) p.wait(first_wait);
      if (s > 0) p.wait(recvs[static_cast<std::size_t>(s - 1)]);
    }
    if (right != skip_send_to) p.send(right, pat::allgather_send_block(r, n, s));
  }
  p.wait_all();
}

Prog bcast_scatter_allgather(int r, int n, int root) {
  Prog p;
  int mine = -1;
  if (r == root) {
    for (int i = 1; i < n; ++i) p.send(pat::mod(root + i, n), 1000 + pat::mod(root + i, n));
  } else {
    mine = p.recv(root, 1000 + r);
  }
  ring_allgather(p, r, n, mine, root, root);
  return p;
}

Prog allreduce_rd(int r, int n) {
  Prog p;
  if (n == 1) return p;
  using Role = pat::RecursiveDoubling::Role;
  const auto rd = pat::recursive_doubling(r, n);
  if (rd.role == Role::kFoldOut) {
    p.wait(p.send(rd.fold_peer, -1));
    p.wait(p.recv(rd.fold_peer, -2));
    return p;
  }
  if (rd.role == Role::kFoldIn) p.wait(p.recv(rd.fold_peer, -1));
  for (std::size_t k = 0; k < rd.partners.size(); ++k) {
    const int id = p.recv(rd.partners[k], static_cast<long>(k));
    const int s = p.send(rd.partners[k], static_cast<long>(k));
    p.wait(id);
    p.wait(s);
  }
  if (rd.role == Role::kFoldIn) {
    p.send(rd.fold_peer, -2);
    p.wait_all();
  }
  return p;
}

// Labels: chunk j of the half rank q reduces is 100 * q + j before reduction, 1000 + that after.
Prog allreduce_halves(int r, int k) {
  Prog p;
  const int peer = 1 - r;
  std::vector<int> recv_own(static_cast<std::size_t>(k)), send_oth(static_cast<std::size_t>(k));
  auto post_pair = [&](int j) {
    recv_own[static_cast<std::size_t>(j)] = p.recv(peer, 100 * r + j);
    send_oth[static_cast<std::size_t>(j)] = p.send(peer, 100 * peer + j);
  };
  for (int j = 0; j < std::min(2, k); ++j) post_pair(j);
  for (int j = 0; j < k; ++j) {
    p.wait(recv_own[static_cast<std::size_t>(j)]);
    p.send(peer, 1000 + 100 * r + j);
    p.wait(send_oth[static_cast<std::size_t>(j)]);
    p.recv(peer, 1000 + 100 * peer + j);
    if (j + 2 < k) post_pair(j + 2);
  }
  p.wait_all();
  return p;
}

Prog allreduce_ring(int r, int n) {
  Prog p;
  if (n == 1) return p;
  const int left = pat::ring_left(r, n), right = pat::ring_right(r, n);
  int rid = p.recv(left, pat::reduce_scatter_recv_block(r, n, 0));
  for (int s = 0; s < n - 1; ++s) {
    const int sid = p.send(right, pat::reduce_scatter_send_block(r, n, s));
    p.wait(rid);
    const int next = s + 1 < n - 1 ? p.recv(left, pat::reduce_scatter_recv_block(r, n, s + 1)) : -1;
    p.wait(sid);
    rid = next;
  }
  ring_allgather(p, r, n);
  return p;
}

Prog reduce_binomial(int r, int n, int root, int k) {
  Prog p;
  if (n == 1) return p;
  const pat::Tree t = pat::binomial_tree(r, n, root);
  const std::vector<int> kids(t.children.rbegin(), t.children.rend());
  const std::size_t nk = kids.size();
  std::vector<int> rid(2 * nk);
  auto post = [&](int c, std::size_t i) { rid[static_cast<std::size_t>(c % 2) * nk + i] = p.recv(kids[i], c); };
  for (int c = 0; c < std::min(2, k); ++c) {
    for (std::size_t i = 0; i < nk; ++i) post(c, i);
  }
  for (int c = 0; c < k; ++c) {
    for (std::size_t i = 0; i < nk; ++i) {
      p.wait(rid[static_cast<std::size_t>(c % 2) * nk + i]);
      if (c + 2 < k) post(c + 2, i);
    }
    if (t.parent >= 0) p.send(t.parent, c);
  }
  p.wait_all();
  return p;
}

Prog allgather(int r, int n) {
  Prog p;
  if (n > 1) ring_allgather(p, r, n);
  return p;
}

Prog reduce_scatter(int r, int n) {
  Prog p;
  if (n == 1) return p;
  const int left = pat::ring_left(r, n), right = pat::ring_right(r, n);
  const int steps = n - 1;
  int rid = p.recv(left, pat::reduce_scatter_recv_block(r, n, 0));
  int prev_send = -1;
  for (int s = 0; s < steps; ++s) {
    const int sid = p.send(right, pat::reduce_scatter_send_block(r, n, s));
    p.wait(rid);
    if (prev_send >= 0) p.wait(prev_send);
    const int next = s + 1 < steps ? p.recv(left, pat::reduce_scatter_recv_block(r, n, s + 1)) : -1;
    prev_send = sid;
    rid = next;
  }
  p.wait_all();
  return p;
}

Prog gather(int r, int n, int root) {
  Prog p;
  if (r != root) {
    p.send(root, r);
    p.wait_all();
    return p;
  }
  std::vector<int> ids(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) {
    const int q = pat::mod(root + i, n);
    ids[static_cast<std::size_t>(q)] = p.recv(q, q);
  }
  for (int i = 1; i < n; ++i) p.wait(ids[static_cast<std::size_t>(pat::mod(root + i, n))]);
  return p;
}

Prog scatter(int r, int n, int root) {
  Prog p;
  if (r != root) {
    p.wait(p.recv(root, r));
    return p;
  }
  for (int i = 1; i < n; ++i) p.send(pat::mod(root + i, n), pat::mod(root + i, n));
  p.wait_all();
  return p;
}

Prog alltoallv(int r, int n) {
  Prog p;
  std::vector<int> ids(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) {
    const int q = pat::mod(r - i, n);
    ids[static_cast<std::size_t>(q)] = p.recv(q, q * 1000 + r);
  }
  for (int i = 1; i < n; ++i) {
    const int q = pat::mod(r + i, n);
    p.send(q, r * 1000 + q);
  }
  for (int i = 1; i < n; ++i) p.wait(ids[static_cast<std::size_t>(pat::mod(r - i, n))]);
  p.wait_all();
  return p;
}

// ---- the algorithms added with the selector (algo/*.cpp) ----------------------------------------

// Labels that carry the step and the block range (so also the size): step * 1e6 + lo * 1e3 + hi,
// plus a chunk index where the algorithm pipelines. Chunk counts are any function of the range
// both sides agree on; here one that varies.
long lab(long step, long lo, long hi, long chunk = 0) { return ((step * 1000 + lo) * 1000 + hi) * 16 + chunk; }
int chunks_of(int lo, int hi) { return 1 + (lo + 2 * hi) % 3; }

// allreduce ring with the chunk-pipelined reduce-scatter (algo/allreduce_ring.cpp).
Prog allreduce_ring_pipelined(int r, int n, int slots) {
  Prog p;
  if (n == 1) return p;
  const int left = pat::ring_left(r, n), right = pat::ring_right(r, n);
  std::vector<std::pair<int, int>> items;
  for (int s = 0; s < n - 1; ++s) {
    const int b = pat::reduce_scatter_recv_block(r, n, s);
    for (int j = 0; j < chunks_of(b, b + 1); ++j) items.emplace_back(s, j);
  }
  const std::size_t ns = std::min<std::size_t>(static_cast<std::size_t>(slots), items.size());
  std::vector<int> rid(items.size());
  auto post = [&](std::size_t i) {
    const auto [s, j] = items[i];
    const int b = pat::reduce_scatter_recv_block(r, n, s);
    rid[i] = p.recv(left, lab(s, b, b + 1, j));
  };
  for (std::size_t i = 0; i < ns; ++i) post(i);
  const int b0 = pat::reduce_scatter_send_block(r, n, 0);
  for (int j = 0; j < chunks_of(b0, b0 + 1); ++j) p.send(right, lab(0, b0, b0 + 1, j));
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto [s, j] = items[i];
    const int b = pat::reduce_scatter_recv_block(r, n, s);
    p.wait(rid[i]);
    if (s + 1 < n - 1) p.send(right, lab(s + 1, b, b + 1, j));
    if (i + ns < items.size()) post(i + ns);
  }
  p.wait_all();
  ring_allgather(p, r, n);
  return p;
}

// recursive halving among the fold's p ranks (algo/halving.cpp), newrank q.
void halving(Prog& p, int q, int n) {
  const int pp = pat::pow2_floor(n);
  const auto steps = pat::recursive_halving(q, pp);
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const auto& st = steps[k];
    const int peer = pat::fold_real(st.partner, n);
    std::vector<int> rids;
    for (int j = 0; j < chunks_of(st.keep_lo, st.keep_hi); ++j) {
      rids.push_back(p.recv(peer, lab(static_cast<long>(k), st.keep_lo, st.keep_hi, j)));
    }
    for (int j = 0; j < chunks_of(st.send_lo, st.send_hi); ++j) {
      p.send(peer, lab(static_cast<long>(k), st.send_lo, st.send_hi, j));
    }
    for (int id : rids) p.wait(id);
  }
  p.wait_all();
}

void doubling_allgather(Prog& p, int q, int n) {
  const int pp = pat::pow2_floor(n);
  long k = 100;
  for (const auto& st : pat::recursive_doubling_allgather(q, pp)) {
    const int peer = pat::fold_real(st.partner, n);
    const int id = p.recv(peer, lab(k, st.recv_lo, st.recv_hi));
    const int s = p.send(peer, lab(k, st.send_lo, st.send_hi));
    p.wait(id);
    p.wait(s);
    ++k;
  }
}

Prog allreduce_rabenseifner(int r, int n) {
  Prog p;
  if (n == 1) return p;
  using Role = pat::RecursiveDoubling::Role;
  const auto rd = pat::recursive_doubling(r, n);
  if (rd.role == Role::kFoldOut) {
    p.wait(p.send(rd.fold_peer, -1));
    p.wait(p.recv(rd.fold_peer, -2));
    return p;
  }
  if (rd.role == Role::kFoldIn) p.wait(p.recv(rd.fold_peer, -1));
  const int q = pat::fold_newrank(r, n);
  halving(p, q, n);
  doubling_allgather(p, q, n);
  if (rd.role == Role::kFoldIn) p.send(rd.fold_peer, -2);
  p.wait_all();
  return p;
}

Prog reduce_scatter_halving(int r, int n) {
  Prog p;
  if (n > 1) halving(p, r, n);
  return p;
}

Prog reduce_rabenseifner(int r, int n, int root) {
  Prog p;
  if (n == 1) return p;
  using Role = pat::RecursiveDoubling::Role;
  const auto rd = pat::recursive_doubling(r, n);
  const bool root_out = pat::fold_newrank(root, n) < 0;
  const int qroot = root_out ? pat::fold_newrank(root + 1, n) : pat::fold_newrank(root, n);
  if (rd.role == Role::kFoldOut) {
    p.wait(p.send(rd.fold_peer, -1));
    if (r == root) p.wait(p.recv(rd.fold_peer, -2));
    return p;
  }
  if (rd.role == Role::kFoldIn) p.wait(p.recv(rd.fold_peer, -1));
  const int q = pat::fold_newrank(r, n);
  halving(p, q, n);
  long k = 200;
  for (const auto& st : pat::halving_gather(q, qroot, pat::pow2_floor(n))) {
    const int peer = pat::fold_real(st.partner, n);
    p.wait(st.send ? p.send(peer, lab(k, st.lo, st.hi)) : p.recv(peer, lab(k, st.lo, st.hi)));
    ++k;
  }
  if (root_out && q == qroot) p.wait(p.send(root, -2));
  p.wait_all();
  return p;
}

Prog allgather_doubling(int r, int n) {
  Prog p;
  doubling_allgather(p, r, n);
  return p;
}

Prog allgather_bruck(int r, int n) {
  Prog p;
  long k = 0;
  for (const auto& st : pat::bruck(r, n)) {
    // The label: step and how many blocks (the size).
    const int id = p.recv(st.recv_from, lab(k, 0, st.blocks));
    const int s = p.send(st.send_to, lab(k, 0, st.blocks));
    p.wait(id);
    p.wait(s);
    ++k;
  }
  return p;
}

// Binomial gather (algo/gather_binomial.cpp): the label is the relative range sent.
Prog gather_binomial(int r, int n, int root) {
  Prog p;
  if (n == 1) return p;
  const pat::Tree t = pat::binomial_tree(r, n, root);
  const int v = pat::relative_rank(r, n, root);
  const int size = pat::subtree_size(v, n);
  if (t.children.empty()) {
    p.send(t.parent, lab(0, v, v + 1));
    p.wait_all();
    return p;
  }
  std::vector<int> ids;
  for (int c : t.children) {
    const int vc = pat::relative_rank(c, n, root);
    ids.push_back(p.recv(c, lab(0, vc, vc + pat::subtree_size(vc, n))));
  }
  for (int id : ids) p.wait(id);
  if (t.parent >= 0) p.wait(p.send(t.parent, lab(0, v, v + size)));
  return p;
}

Prog scatter_binomial(int r, int n, int root) {
  Prog p;
  if (n == 1) return p;
  const pat::Tree t = pat::binomial_tree(r, n, root);
  const int v = pat::relative_rank(r, n, root);
  const int size = pat::subtree_size(v, n);
  if (t.children.empty()) {
    p.wait(p.recv(t.parent, lab(0, v, v + 1)));
    return p;
  }
  if (r != root) p.wait(p.recv(t.parent, lab(0, v, v + size)));
  for (int c : t.children) {
    const int vc = pat::relative_rank(c, n, root);
    p.send(c, lab(0, vc, vc + pat::subtree_size(vc, n)));
  }
  p.wait_all();
  return p;
}

// Linear gather / scatter with at most `window` messages in flight at the root.
Prog gather_linear(int r, int n, int root, int window) {
  Prog p;
  if (n == 1) return p;
  if (r != root) {
    p.send(root, r);
    p.wait_all();
    return p;
  }
  std::vector<int> ids(static_cast<std::size_t>(n), -1);
  int posted = 0;
  auto post = [&](int i) { ids[static_cast<std::size_t>(i)] = p.recv(pat::mod(root + i, n), pat::mod(root + i, n)); };
  for (int i = 1; i < n && i <= window; ++i) post(posted = i);
  for (int i = 1; i < n; ++i) {
    p.wait(ids[static_cast<std::size_t>(i)]);
    if (posted + 1 < n) post(++posted);
  }
  return p;
}

Prog scatter_linear(int r, int n, int root, int window) {
  Prog p;
  if (n == 1) return p;
  if (r != root) {
    p.wait(p.recv(root, r));
    return p;
  }
  std::vector<int> ids(static_cast<std::size_t>(n), -1);
  int posted = 0;
  auto post = [&](int i) { ids[static_cast<std::size_t>(i)] = p.send(pat::mod(root + i, n), pat::mod(root + i, n)); };
  for (int i = 1; i < n && i <= window; ++i) post(posted = i);
  for (int i = 1; i < n; ++i) {
    p.wait(ids[static_cast<std::size_t>(i)]);
    if (posted + 1 < n) post(++posted);
  }
  return p;
}

// Pairwise alltoall with at most `window` steps in flight (algo/alltoall_pairwise.cpp).
Prog alltoall_pairwise(int r, int n, int window) {
  Prog p;
  std::vector<int> rid(static_cast<std::size_t>(n)), sid(static_cast<std::size_t>(n));
  auto post = [&](int i) {
    const int from = pat::pairwise_recv_from(r, n, i), to = pat::pairwise_send_to(r, n, i);
    rid[static_cast<std::size_t>(i)] = p.recv(from, from * 1000 + r);
    sid[static_cast<std::size_t>(i)] = p.send(to, r * 1000 + to);
  };
  int posted = 0;
  for (int i = 1; i < n && i <= window; ++i) post(posted = i);
  for (int i = 1; i < n; ++i) {
    p.wait(rid[static_cast<std::size_t>(i)]);
    p.wait(sid[static_cast<std::size_t>(i)]);
    if (posted + 1 < n) post(++posted);
  }
  p.wait_all();
  return p;
}

template <class F>
std::vector<Prog> world(int n, F f) {
  std::vector<Prog> v;
  for (int r = 0; r < n; ++r) v.push_back(f(r));
  return v;
}

#define EXPECT_SCHEDULE(n, expr) EXPECT_EQ(simulate(world((n), [&](int r) { return (expr); })), "")

}  // namespace

TEST(Patterns, UnrootedSchedulesMatchForSizes1To64) {
  for (int n = 1; n <= kMaxWorld; ++n) {
    SCOPED_TRACE("world size " + std::to_string(n));
    EXPECT_SCHEDULE(n, barrier(r, n));
    EXPECT_SCHEDULE(n, allreduce_rd(r, n));
    EXPECT_SCHEDULE(n, allreduce_ring(r, n));
    EXPECT_SCHEDULE(n, allgather(r, n));
    EXPECT_SCHEDULE(n, reduce_scatter(r, n));
    EXPECT_SCHEDULE(n, alltoallv(r, n));
  }
  for (int k = 1; k <= 6; ++k) EXPECT_SCHEDULE(2, allreduce_halves(r, k));
}

TEST(Patterns, RootedSchedulesMatchForSizes1To64AndEveryRoot) {
  for (int n = 1; n <= kMaxWorld; ++n) {
    for (int root = 0; root < n; ++root) {
      SCOPED_TRACE("world size " + std::to_string(n) + ", root " + std::to_string(root));
      EXPECT_SCHEDULE(n, bcast_binomial(r, n, root));
      if (n >= 3) {
        EXPECT_SCHEDULE(n, bcast_scatter_allgather(r, n, root));
      }
      for (int k : {1, 2, 5}) EXPECT_SCHEDULE(n, reduce_binomial(r, n, root, k));
      EXPECT_SCHEDULE(n, gather(r, n, root));
      EXPECT_SCHEDULE(n, scatter(r, n, root));
    }
  }
}

TEST(Patterns, SelectorAlgorithmsMatchForSizes1To64) {
  for (int n = 1; n <= kMaxWorld; ++n) {
    SCOPED_TRACE("world size " + std::to_string(n));
    for (int slots : {1, 3}) EXPECT_SCHEDULE(n, allreduce_ring_pipelined(r, n, slots));
    EXPECT_SCHEDULE(n, allreduce_rabenseifner(r, n));
    EXPECT_SCHEDULE(n, allgather_bruck(r, n));
    if (pat::is_pow2(n)) {
      EXPECT_SCHEDULE(n, reduce_scatter_halving(r, n));
      EXPECT_SCHEDULE(n, allgather_doubling(r, n));
    }
    for (int window : {1, 2, 4, 64}) EXPECT_SCHEDULE(n, alltoall_pairwise(r, n, window));
  }
}

TEST(Patterns, RootedSelectorAlgorithmsMatchForSizes1To64AndEveryRoot) {
  for (int n = 1; n <= kMaxWorld; ++n) {
    for (int root = 0; root < n; ++root) {
      SCOPED_TRACE("world size " + std::to_string(n) + ", root " + std::to_string(root));
      EXPECT_SCHEDULE(n, reduce_rabenseifner(r, n, root));
      EXPECT_SCHEDULE(n, gather_binomial(r, n, root));
      EXPECT_SCHEDULE(n, scatter_binomial(r, n, root));
      for (int window : {1, 4}) {
        EXPECT_SCHEDULE(n, gather_linear(r, n, root, window));
        EXPECT_SCHEDULE(n, scatter_linear(r, n, root, window));
      }
      if (n == 2) {  // 3+ ranks: RootedSchedulesMatchForSizes1To64AndEveryRoot
        EXPECT_SCHEDULE(n, bcast_scatter_allgather(r, n, root));
      }
    }
  }
}

// Data flow, not just matching: which contributions each rank holds after each algorithm.
TEST(Patterns, HalvingDoublingAndGatherCarryEveryContribution) {
  for (int p = 1; p <= kMaxWorld; p *= 2) {
    // has[q][b]: the newranks whose data rank q holds for block b (recursive halving).
    std::vector<std::vector<std::set<int>>> has(static_cast<std::size_t>(p), std::vector<std::set<int>>(static_cast<std::size_t>(p)));
    for (int q = 0; q < p; ++q) {
      for (int b = 0; b < p; ++b) has[static_cast<std::size_t>(q)][static_cast<std::size_t>(b)] = {q};
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
          const auto& theirs = has[static_cast<std::size_t>(st.partner)][static_cast<std::size_t>(b)];
          next[static_cast<std::size_t>(q)][static_cast<std::size_t>(b)].insert(theirs.begin(), theirs.end());
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
      EXPECT_EQ(has[static_cast<std::size_t>(q)][static_cast<std::size_t>(q)].size(), static_cast<std::size_t>(p));
    }
    // Recursive doubling allgather: every rank ends with every block.
    std::vector<std::set<int>> blocks(static_cast<std::size_t>(p));
    for (int q = 0; q < p; ++q) blocks[static_cast<std::size_t>(q)] = {q};
    for (int mask = 1, k = 0; mask < p; mask *= 2, ++k) {
      auto next = blocks;
      for (int q = 0; q < p; ++q) {
        const auto st = pat::recursive_doubling_allgather(q, p)[static_cast<std::size_t>(k)];
        for (int b = st.send_lo; b < st.send_hi; ++b) EXPECT_EQ(blocks[static_cast<std::size_t>(q)].count(b), 1u);
        for (int b = st.recv_lo; b < st.recv_hi; ++b) next[static_cast<std::size_t>(q)].insert(b);
        EXPECT_EQ(blocks[static_cast<std::size_t>(st.partner)].count(st.recv_lo), 1u);
      }
      blocks = next;
    }
    for (int q = 0; q < p; ++q) EXPECT_EQ(blocks[static_cast<std::size_t>(q)].size(), static_cast<std::size_t>(p));
    // Gather towards every root: the root ends with every block, each sent by a holder.
    for (int root = 0; root < p; ++root) {
      std::vector<std::set<int>> held(static_cast<std::size_t>(p));
      for (int q = 0; q < p; ++q) held[static_cast<std::size_t>(q)] = {q};
      for (int mask = 1, k = 0; mask < p; mask *= 2, ++k) {
        for (int q = 0; q < p; ++q) {
          const auto gs = pat::halving_gather(q, root, p);
          if (static_cast<std::size_t>(k) >= gs.size() || gs[static_cast<std::size_t>(k)].send) continue;
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
    std::vector<std::vector<int>> slot(static_cast<std::size_t>(n), std::vector<int>(static_cast<std::size_t>(n), -1));
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
      for (int i = 0; i < n; ++i) EXPECT_EQ(slot[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)], (r + i) % n);
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

// The simulator itself catches the mistakes it is there for.
TEST(Patterns, SimulatorDetectsMistakes) {
  // Both ranks receive first and wait: deadlock.
  std::vector<Prog> dead(2);
  for (int r = 0; r < 2; ++r) {
    dead[static_cast<std::size_t>(r)].wait(dead[static_cast<std::size_t>(r)].recv(1 - r, 0));
    dead[static_cast<std::size_t>(r)].send(1 - r, 0);
  }
  EXPECT_NE(simulate(dead).find("deadlock"), std::string::npos);
  // Two messages posted in the opposite order of the receives.
  std::vector<Prog> swapped(2);
  swapped[0].send(1, 1);
  swapped[0].send(1, 2);
  swapped[0].wait_all();
  swapped[1].recv(0, 2);
  swapped[1].recv(0, 1);
  swapped[1].wait_all();
  EXPECT_NE(simulate(swapped).find("carries"), std::string::npos);
  // A send nobody receives.
  std::vector<Prog> lost(2);
  lost[0].send(1, 0);
  EXPECT_NE(simulate(lost), "");
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
        EXPECT_EQ(rd[static_cast<std::size_t>(rd[static_cast<std::size_t>(r)].fold_peer)].role, Role::kFoldOut);
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
        next[static_cast<std::size_t>(r)].insert(has[static_cast<std::size_t>(q)].begin(), has[static_cast<std::size_t>(q)].end());
      }
      has = next;
    }
    for (int r = 0; r < n; ++r) {
      if (rd[static_cast<std::size_t>(r)].role == Role::kFoldOut) continue;
      EXPECT_EQ(has[static_cast<std::size_t>(r)].size(), static_cast<std::size_t>(n)) << "n=" << n << " r=" << r;
    }
  }
}
