// Scatter, binomial tree (the reverse of the binomial gather): relative rank v receives the parts
// of its whole subtree, relative ranks [v, v + subtree_size(v)), from its parent into host scratch,
// keeps its own and sends each child its child's range (largest subtree first); leaves receive
// their part straight into `out`. The root sends from `in` when root is 0, else from a rotated
// copy in relative order. The selector's choice for small parts on 3+ ranks.
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
  const auto size = static_cast<std::size_t>(pattern::subtree_size(v, n));
  ex.phase("binomial tree");
  if (t.children.empty()) {
    recv_exact(ex, a.out, bytes, t.parent, ex.mem());
    return;
  }
  const char* buf = nullptr;
  MemoryType mem = ex.work_mem();
  if (r == root && root == 0) {
    buf = a.in;
    mem = ex.mem();
  } else {
    char* tmp = ex.scratch(size * bytes);
    if (r == root) {
      const auto nn = static_cast<std::size_t>(n), ro = static_cast<std::size_t>(root);
      ex.copy(tmp, ex.work_mem(), a.in + ro * bytes, ex.mem(), (nn - ro) * bytes);
      ex.copy(tmp + (nn - ro) * bytes, ex.work_mem(), a.in, ex.mem(), ro * bytes);
    } else {
      recv_exact(ex, tmp, size * bytes, t.parent, ex.work_mem());
    }
    buf = tmp;
  }
  for (int c : t.children) {
    const int vc = pattern::relative_rank(c, n, root);
    const auto len = static_cast<std::size_t>(pattern::subtree_size(vc, n)) * bytes;
    ex.send(buf + static_cast<std::size_t>(vc - v) * bytes, len, c, mem);
  }
  ex.copy(a.out, ex.mem(), buf, mem, bytes);
  ex.wait_all();
}

}  // namespace

const Algorithm<RootedArgs> scatter_binomial = {"binomial", nullptr, run};

}  // namespace commux::coll::detail::algo
