// Gather, linear: every rank sends its part straight to the root, which keeps at most
// kMaxInFlight receives posted (nearest ranks after it first) and posts the next as each completes.
// The root's own part is a local copy. The selector's choice for large parts and 2 ranks.
#include <algorithm>
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const RootedArgs& a) {
  const int n = ex.size(), r = ex.rank(), root = a.root;
  ex.phase("linear");
  if (r != root) {
    ex.send_user(a.in, a.bytes, root);
    ex.wait_all();
    return;
  }
  std::vector<std::size_t> ids(static_cast<std::size_t>(n));
  auto post = [&](int i) {
    const int p = pattern::mod(root + i, n);
    ids[static_cast<std::size_t>(i)] =
        ex.recv_user(a.out + static_cast<std::size_t>(p) * a.bytes, a.bytes, p);
  };
  windowed_steps(
      n, post,
      [&] {
        ex.copy(a.out + static_cast<std::size_t>(r) * a.bytes, ex.mem(), a.in, ex.mem(), a.bytes);
      },
      [&](int i) {
        ex.wait(ids[static_cast<std::size_t>(i)]);
        expect_bytes(ex, ids[static_cast<std::size_t>(i)], pattern::mod(root + i, n), a.bytes,
                     nullptr);
      });
}

}  // namespace

const Algorithm<RootedArgs> gather_linear = {"linear", nullptr, run};

}  // namespace commux::coll::detail::algo
