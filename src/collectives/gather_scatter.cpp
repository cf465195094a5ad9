// Gather and scatter: validation and the selectors. Algorithms in algo/{gather,scatter}_*.cpp:
//   * binomial: 3+ ranks and parts below kGatherBinomialBytes;
//   * linear (at most kMaxInFlight messages in flight at the root): otherwise.
#include "algo.hpp"

namespace commux::coll {

namespace {

const char* select(int n, std::size_t bytes) {
  return n >= 3 && bytes < detail::kGatherBinomialBytes ? "binomial" : "linear";
}

}  // namespace

void gather(const Context& ctx, const void* in, std::size_t bytes, void* out, int root) {
  detail::Exchange ex(ctx);
  const int n = ex.size(), r = ex.rank();
  detail::check_root(ctx, root, n);
  detail::check_ptr(ctx, in, bytes, "in");
  const std::size_t all =
      detail::checked_mul(ctx, bytes, static_cast<std::size_t>(n), "bytes x ranks");
  if (r == root) detail::check_ptr(ctx, out, all, "out");
  const detail::RootedArgs a{static_cast<const char*>(in), static_cast<char*>(out), bytes, root};
  const auto& algo = detail::choose(ex, detail::gather_table(), n, a, select(n, bytes));
  if (n == 1) {
    ex.copy(out, ex.mem(), in, ex.mem(), bytes);
    return;
  }
  algo.run(ex, a);
}

void scatter(const Context& ctx, const void* in, void* out, std::size_t bytes, int root) {
  detail::Exchange ex(ctx);
  const int n = ex.size(), r = ex.rank();
  detail::check_root(ctx, root, n);
  detail::check_ptr(ctx, out, bytes, "out");
  const std::size_t all =
      detail::checked_mul(ctx, bytes, static_cast<std::size_t>(n), "bytes x ranks");
  if (r == root) detail::check_ptr(ctx, in, all, "in");
  const detail::RootedArgs a{static_cast<const char*>(in), static_cast<char*>(out), bytes, root};
  const auto& algo = detail::choose(ex, detail::scatter_table(), n, a, select(n, bytes));
  if (n == 1) {
    ex.copy(out, ex.mem(), in, ex.mem(), bytes);
    return;
  }
  algo.run(ex, a);
}

}  // namespace commux::coll
