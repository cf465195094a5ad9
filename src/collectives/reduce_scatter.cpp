// Reduce-scatter with per-rank counts: validation, staging and the selector. Algorithms in
// algo/reduce_scatter_*.cpp:
//   * recursive_halving: power-of-two world sizes, total below kReduceScatterSmallBytes;
//   * ring: everything else.
// `in` is not modified; device buffers are staged through host memory.
#include <vector>

#include "algo.hpp"
#include "patterns.hpp"

namespace commux::coll {

void reduce_scatter(const Context& ctx, const void* in, void* out, const std::size_t* counts,
                    DataType t, ReduceOp op) {
  detail::Exchange ex(ctx);
  check_reduction(ex.op(), t, op);
  if (counts == nullptr) detail::Exchange::invalid(ctx, "counts is null");
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(t);
  std::vector<std::size_t> off(static_cast<std::size_t>(n) + 1, 0);
  for (int p = 0; p < n; ++p) {
    off[static_cast<std::size_t>(p) + 1] =
        detail::checked_add(ctx, off[static_cast<std::size_t>(p)], counts[p], "the counts' sum");
  }
  const std::size_t total = off.back();
  const std::size_t total_bytes =
      detail::checked_mul(ctx, total, es, "the counts' sum x element size");
  const std::size_t mine_bytes = counts[r] * es;  // (at most total_bytes)
  detail::check_ptr(ctx, in, total_bytes, "in");
  detail::check_ptr(ctx, out, mine_bytes, "out");
  detail::ReduceScatterArgs a{static_cast<const char*>(in), static_cast<char*>(out), off.data(), t,
                              op};
  const char* pick = pattern::is_pow2(n) && total_bytes < detail::kReduceScatterSmallBytes
                         ? "recursive_halving"
                         : "ring";
  const auto& algo = detail::choose(ex, detail::reduce_scatter_table(), n, a, pick);
  if (n == 1) {
    ex.copy(out, ex.mem(), in, ex.mem(), mine_bytes);
    return;
  }
  detail::WorkStage src(ex, const_cast<void*>(in), total_bytes, true);
  detail::WorkStage dst(ex, out, mine_bytes, false);
  a.in = src.data();
  a.out = dst.data();
  algo.run(ex, a);
  dst.store();
}

}  // namespace commux::coll
