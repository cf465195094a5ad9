// Reduce-scatter, recursive halving: log2(n) steps; at step k the rank exchanges half of the range
// it still holds with partner r ^ (n / 2^(k+1)) and reduces the half it keeps (pattern::
// recursive_halving; blocks are the ranks' counts, which may differ). Declines world sizes that
// are not powers of two. `in` is only read: partial results go to a scratch accumulator of half
// the input, the last step straight to `out`. The selector's choice for small totals on 2, 4, 8,
// .. ranks (log2 n rounds instead of n - 1).
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

bool accepts(int n, const ReduceScatterArgs&) { return pattern::is_pow2(n); }

void run(Exchange& ex, const ReduceScatterArgs& a) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(a.t);
  const auto keep = halving_first_keep(a.off, r, n);
  char* acc = ex.scratch((keep.second - keep.first) * es);
  recursive_halving(ex, HalvingIo{a.in, acc, keep.first, a.out}, a.off, r, n, a.t, a.op);
}

}  // namespace

const Algorithm<ReduceScatterArgs> reduce_scatter_recursive_halving = {"recursive_halving", accepts,
                                                                       run};

}  // namespace commux::coll::detail::algo
