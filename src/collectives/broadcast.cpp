// Broadcast.
//   * below kBroadcastScatterBytes, or with 2 ranks: binomial tree rooted at `root`
//     (ceil(log2 n) rounds, each rank receives once from its parent and forwards the whole
//     buffer to its children, largest subtree first);
//   * at and above it with 3+ ranks: the root scatters n blocks (one direct send per rank), then
//     a ring allgather circulates them (van de Geijn). The root already holds everything: it
//     receives nothing in the ring, and its left-hand neighbour does not send to it. About 2x the
//     buffer crosses each link instead of log2(n)x.
#include <vector>

#include "internal.hpp"
#include "patterns.hpp"

namespace commux::coll {

namespace {

void binomial(detail::Exchange& ex, char* buf, std::size_t bytes, int root) {
  ex.phase("binomial tree");
  const pattern::Tree t = pattern::binomial_tree(ex.rank(), ex.size(), root);
  if (t.parent >= 0) {
    const std::size_t id = ex.recv_user(buf, bytes, t.parent);
    ex.wait(id);
    if (ex.bytes(id) != bytes) {
      ex.fail(Errc::kInvalidArgument, detail::size_mismatch(t.parent, ex.bytes(id), bytes, nullptr));
    }
  }
  for (int c : t.children) ex.send_user(buf, bytes, c);
  ex.wait_all();
}

void scatter_allgather(detail::Exchange& ex, char* buf, std::size_t bytes, int root) {
  const int n = ex.size(), r = ex.rank();
  const pattern::Blocks bl{bytes, n};
  const int left = pattern::ring_left(r, n), right = pattern::ring_right(r, n);
  auto at = [&](int b) { return buf + bl.offset(b); };
  auto expect = [&](std::size_t id, int from, int b) {
    if (ex.bytes(id) != bl.size(b)) {
      ex.fail(Errc::kInvalidArgument,
              detail::size_mismatch(from, ex.bytes(id), bl.size(b),
                                    ("for block " + std::to_string(b)).c_str()));
    }
  };
  ex.phase("scatter");
  std::size_t mine = 0;
  if (r == root) {
    for (int i = 1; i < n; ++i) {
      const int p = pattern::mod(root + i, n);
      ex.send_user(at(p), bl.size(p), p);
    }
  } else {
    mine = ex.recv_user(at(r), bl.size(r), root);
  }
  ex.phase("ring allgather");
  std::vector<std::size_t> recvs;
  if (r != root) {
    for (int s = 0; s < n - 1; ++s) {
      const int b = pattern::allgather_recv_block(r, n, s);
      recvs.push_back(ex.recv_user(at(b), bl.size(b), left));
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    if (r != root) {
      const std::size_t id = s == 0 ? mine : recvs[static_cast<std::size_t>(s - 1)];
      ex.wait(id);
      if (s == 0) {
        expect(id, root, r);
      } else {
        expect(id, left, pattern::allgather_recv_block(r, n, s - 1));
      }
    }
    if (right != root) {
      const int b = pattern::allgather_send_block(r, n, s);
      ex.send_user(at(b), bl.size(b), right);
    }
  }
  ex.wait_all();
  if (r != root) expect(recvs.back(), left, pattern::allgather_recv_block(r, n, n - 2));
}

}  // namespace

void broadcast(const Context& ctx, void* buf, std::size_t bytes, int root) {
  detail::Exchange ex(ctx);
  detail::check_root(ctx, root, ex.size());
  detail::check_ptr(ctx, buf, bytes, "buf");
  if (ex.size() == 1) return;
  char* b = static_cast<char*>(buf);
  if (ex.size() >= 3 && bytes >= detail::kBroadcastScatterBytes) {
    scatter_allgather(ex, b, bytes, root);
  } else {
    binomial(ex, b, bytes, root);
  }
}

}  // namespace commux::coll
