// Barrier, recursive doubling: log2(n) rounds of zero-byte messages exchanged with partner
// r ^ 2^k; after round k every rank has (transitively) heard from its 2^(k+1)-rank block. Declines
// world sizes that are not powers of two. The selector's choice on 2, 4, 8, .. ranks: each round
// is a pairwise exchange, so when ranks outnumber cores a barrier needs the ranks scheduled about
// twice, where dissemination's chain of dependencies (r waits for r - 2^k, which waited for
// r - 2^k - 2^(k-1) ...) needs about log2(n) + 1 turns.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

bool accepts(int n, const BarrierArgs&) { return pattern::is_pow2(n); }

void run(Exchange& ex, const BarrierArgs&) {
  const int n = ex.size(), r = ex.rank();
  ex.phase("recursive doubling");
  std::vector<std::size_t> recvs;
  for (int d = 1; d < n; d <<= 1) recvs.push_back(ex.recv_host(nullptr, 0, r ^ d));
  std::size_t k = 0;
  for (int d = 1; d < n; d <<= 1, ++k) {
    ex.send_host(nullptr, 0, r ^ d);
    ex.wait(recvs[k]);
  }
  ex.wait_all();
}

}  // namespace

const Algorithm<BarrierArgs> barrier_recursive_doubling = {"recursive_doubling", accepts, run};

}  // namespace commux::coll::detail::algo
