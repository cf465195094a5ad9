// Barrier: one algorithm, dissemination (algo/barrier_dissemination.cpp).
#include "algo.hpp"

namespace commux::coll {

void barrier(const Context& ctx) {
  detail::Exchange ex(ctx);
  const detail::BarrierArgs a{};
  const auto& algo = detail::choose(ex, detail::barrier_table(), ex.size(), a, "dissemination");
  if (ex.size() == 1) return;
  algo.run(ex, a);
}

}  // namespace commux::coll
