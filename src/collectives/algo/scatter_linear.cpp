// Scatter, linear: the root sends each rank its part directly, keeping at most kMaxInFlight sends
// posted (nearest ranks after it first) and posting the next as each completes; its own part is a
// local copy. The selector's choice for large parts and 2 ranks.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const RootedArgs& a) {
  const int n = ex.size(), r = ex.rank(), root = a.root;
  ex.phase("linear");
  if (r != root) {
    recv_exact(ex, a.out, a.bytes, root, ex.mem());
    return;
  }
  std::vector<std::size_t> ids(static_cast<std::size_t>(n));
  auto post = [&](int i) {
    const int p = pattern::mod(root + i, n);
    ids[static_cast<std::size_t>(i)] =
        ex.send_user(a.in + static_cast<std::size_t>(p) * a.bytes, a.bytes, p);
  };
  windowed_steps(
      n, post,
      [&] {
        ex.copy(a.out, ex.mem(), a.in + static_cast<std::size_t>(r) * a.bytes, ex.mem(), a.bytes);
      },
      [&](int i) { ex.wait(ids[static_cast<std::size_t>(i)]); });
}

}  // namespace

const Algorithm<RootedArgs> scatter_linear = {"linear", nullptr, run};

}  // namespace commux::coll::detail::algo
