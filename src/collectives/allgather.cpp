// Allgather / allgatherv: validation and the selector. Algorithms in algo/allgather_*.cpp:
//   * recursive_doubling: equal parts, power-of-two world size, total below kAllgatherSmallBytes;
//   * bruck: equal parts, other world sizes, total below kAllgatherSmallBytes;
//   * ring: everything else (and every allgatherv with unequal or scattered parts).
#include <vector>

#include "algo.hpp"
#include "patterns.hpp"

namespace commux::coll {

void allgatherv(const Context& ctx, const void* in, void* out, const std::size_t* counts,
                const std::size_t* displs) {
  detail::Exchange ex(ctx);
  const int n = ex.size(), r = ex.rank();
  if (counts == nullptr || displs == nullptr)
    detail::Exchange::invalid(ctx, "counts/displs are null");
  const auto me = static_cast<std::size_t>(r);
  std::size_t total = 0;
  bool uniform = true;
  for (int p = 0; p < n; ++p) {
    total = detail::checked_add(ctx, total, counts[p], "the counts' sum");
    uniform =
        uniform && counts[p] == counts[0] && displs[p] == static_cast<std::size_t>(p) * counts[0];
  }
  detail::check_ptr(ctx, in, counts[me], "in");
  detail::check_ptr(ctx, out, total, "out");
  const detail::AllgatherArgs a{static_cast<const char*>(in), static_cast<char*>(out), counts,
                                displs, uniform};
  const char* pick = "ring";
  if (uniform && total < detail::kAllgatherSmallBytes) {
    pick = pattern::is_pow2(n) ? "recursive_doubling" : "bruck";
  }
  const auto& algo = detail::choose(ex, detail::allgather_table(), n, a, pick);
  algo.run(ex, a);
}

void allgather(const Context& ctx, const void* in, std::size_t bytes, void* out) {
  if (ctx.comm == nullptr) detail::Exchange::invalid(ctx, "Context::comm is null");
  const auto n = static_cast<std::size_t>(ctx.comm->size());
  detail::checked_mul(ctx, bytes, n, "bytes x ranks");  // (so no displacement below wraps)
  std::vector<std::size_t> counts(n, bytes), displs(n);
  for (std::size_t p = 0; p < n; ++p) displs[p] = p * bytes;
  allgatherv(ctx, in, out, counts.data(), displs.data());
}

}  // namespace commux::coll
