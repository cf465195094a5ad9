// Broadcast, binomial tree rooted at `root`: ceil(log2 n) rounds; each rank receives once from
// its parent and forwards the whole buffer to its children, largest subtree first. The selector's
// choice below kBroadcastScatterBytes and for 2 ranks.
#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const BroadcastArgs& a) {
  ex.phase("binomial tree");
  const pattern::Tree t = pattern::binomial_tree(ex.rank(), ex.size(), a.root);
  if (t.parent >= 0) {
    recv_exact(ex, a.buf, a.bytes, t.parent, ex.mem());
  }
  for (int c : t.children) ex.send_user(a.buf, a.bytes, c);
  ex.wait_all();
}

}  // namespace

const Algorithm<BroadcastArgs> broadcast_binomial = {"binomial", nullptr, run};

}  // namespace commux::coll::detail::algo
