// Barrier: recursive doubling on power-of-two world sizes (algo/barrier_recursive_doubling.cpp),
// dissemination otherwise (algo/barrier_dissemination.cpp).
#include "algo.hpp"
#include "patterns.hpp"

namespace commux::coll {

void barrier(const Context& ctx) {
  detail::Exchange ex(ctx);
  const detail::BarrierArgs a{};
  const char* pick = pattern::is_pow2(ex.size()) ? "recursive_doubling" : "dissemination";
  const auto& algo = detail::choose(ex, detail::barrier_table(), ex.size(), a, pick);
  if (ex.size() == 1) return;
  algo.run(ex, a);
}

}  // namespace commux::coll
