// Allgather, recursive doubling: log2(n) exchanges with partner r ^ 2^k, the exchanged groups
// doubling each step, straight in the output. Declines world sizes that are not powers of two and
// unequal or non-contiguous parts (allgatherv). The selector's choice for small totals on 2, 4,
// 8, .. ranks.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

bool accepts(int n, const AllgatherArgs& a) { return pattern::is_pow2(n) && a.uniform; }

void run(Exchange& ex, const AllgatherArgs& a) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t bytes = a.counts[0];
  ex.phase("local copy");
  ex.copy(a.out + static_cast<std::size_t>(r) * bytes, ex.mem(), a.in, ex.mem(), bytes);
  std::vector<std::size_t> boff(static_cast<std::size_t>(n) + 1);
  for (int b = 0; b <= n; ++b)
    boff[static_cast<std::size_t>(b)] = static_cast<std::size_t>(b) * bytes;
  doubling_allgather(ex, a.out, boff.data(), r, n, ex.mem());
}

}  // namespace

const Algorithm<AllgatherArgs> allgather_recursive_doubling = {"recursive_doubling", accepts, run};

}  // namespace commux::coll::detail::algo
