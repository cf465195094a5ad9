// Gather, binomial tree: relative rank v = (r - root) mod n collects the parts of its subtree,
// relative ranks [v, v + subtree_size(v)), in relative order in host scratch (children's ranges
// are contiguous there), and sends the whole range to its parent; leaves send their part as it is.
// ceil(log2 n) rounds instead of n - 1 messages into the root. With root 0 the root receives
// straight into `out`, else it rotates its scratch into rank order at the end. The selector's
// choice for small parts on 3+ ranks.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const RootedArgs& a) {
  const int n = ex.size(), r = ex.rank(), root = a.root;
  const std::size_t bytes = a.bytes;
  const pattern::Tree t = pattern::binomial_tree(r, n, root);
  const int v = pattern::relative_rank(r, n, root);
  ex.phase("binomial tree");
  if (t.children.empty()) {
    ex.send_user(a.in, bytes, t.parent);
    ex.wait_all();
    return;
  }
  const auto size = static_cast<std::size_t>(pattern::subtree_size(v, n));
  const bool direct = r == root && root == 0;  // relative order is rank order
  char* buf = direct ? a.out : ex.scratch(size * bytes);
  const MemoryType mem = direct ? ex.mem() : ex.work_mem();
  ex.copy(buf, mem, a.in, ex.mem(), bytes);
  std::vector<std::size_t> ids, lens;
  for (int c : t.children) {
    const int vc = pattern::relative_rank(c, n, root);
    lens.push_back(static_cast<std::size_t>(pattern::subtree_size(vc, n)) * bytes);
    ids.push_back(ex.recv(buf + static_cast<std::size_t>(vc - v) * bytes, lens.back(), c, mem));
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ex.wait(ids[i]);
    expect_bytes(ex, ids[i], t.children[i], lens[i], nullptr);
  }
  if (t.parent >= 0) {
    ex.wait(ex.send(buf, size * bytes, t.parent, mem));
    return;
  }
  if (!direct) {
    const auto nn = static_cast<std::size_t>(n), ro = static_cast<std::size_t>(root);
    ex.phase("rotation");
    ex.copy(a.out + ro * bytes, ex.mem(), buf, ex.work_mem(), (nn - ro) * bytes);
    ex.copy(a.out, ex.mem(), buf + (nn - ro) * bytes, ex.work_mem(), ro * bytes);
  }
}

}  // namespace

const Algorithm<RootedArgs> gather_binomial = {"binomial", nullptr, run};

}  // namespace commux::coll::detail::algo
