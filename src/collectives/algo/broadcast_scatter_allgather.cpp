// Broadcast, scatter + ring allgather (van de Geijn): the root sends block r of n nearly equal
// blocks to rank r (one direct send per rank), then a ring allgather circulates them. The root
// already holds everything: it receives nothing in the ring, and its left-hand neighbour does not
// send to it. About 2x the buffer crosses each link instead of log2(n)x. The selector's choice from
// kBroadcastScatterBytes up with 3+ ranks; declines a single rank.
#include <string>
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

bool accepts(int n, const BroadcastArgs&) { return n >= 2; }

void run(Exchange& ex, const BroadcastArgs& a) {
  const int n = ex.size(), r = ex.rank(), root = a.root;
  char* buf = a.buf;
  const pattern::Blocks bl{a.bytes, n};
  const int left = pattern::ring_left(r, n), right = pattern::ring_right(r, n);
  auto at = [&](int b) { return buf + bl.offset(b); };
  auto expect = [&](std::size_t id, int from, int b) {
    expect_bytes(ex, id, from, bl.size(b), ("for block " + std::to_string(b)).c_str());
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

const Algorithm<BroadcastArgs> broadcast_scatter_allgather = {"scatter_allgather", accepts, run};

}  // namespace commux::coll::detail::algo
