// Broadcast: validation and the selector. Algorithms in algo/broadcast_*.cpp:
//   * binomial: below kBroadcastScatterBytes, or with 2 ranks;
//   * scatter_allgather: from kBroadcastScatterBytes up with 3+ ranks.
#include "algo.hpp"

namespace commux::coll {

void broadcast(const Context& ctx, void* buf, std::size_t bytes, int root) {
  detail::Exchange ex(ctx);
  detail::check_root(ctx, root, ex.size());
  detail::check_ptr(ctx, buf, bytes, "buf");
  const int n = ex.size();
  const detail::BroadcastArgs a{static_cast<char*>(buf), bytes, root};
  const char* pick =
      n >= 3 && bytes >= detail::kBroadcastScatterBytes ? "scatter_allgather" : "binomial";
  const auto& algo = detail::choose(ex, detail::broadcast_table(), n, a, pick);
  if (n == 1) return;
  algo.run(ex, a);
}

}  // namespace commux::coll
