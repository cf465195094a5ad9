// Allreduce (in place): validation, staging and the selector. The algorithms are in
// algo/allreduce_*.cpp:
//   * recursive_doubling: below kAllreduceSmallBytes, or with fewer elements than ranks;
//   * halves: 2 ranks from kAllreduceSmallBytes up;
//   * rabenseifner: 3+ ranks, power-of-two world sizes, from kAllreduceSmallBytes up to
//     kAllreduceRabenseifnerBytes (fewer steps than the ring, the same volume);
//   * ring: 3+ ranks otherwise (chunk-pipelined reduce-scatter + allgather).
// Device buffers (ctx.mem != kHost) are reduced on the device with Context::device; without it
// they are staged through host memory and the host kernels reduce them.
#include "algo.hpp"
#include "patterns.hpp"

namespace commux::coll {

namespace {

const char* select(int n, const detail::AllreduceArgs& a) {
  const std::size_t bytes = a.count * dtype_size(a.t);
  if (bytes < detail::kAllreduceSmallBytes || a.count < static_cast<std::size_t>(n))
    return "recursive_doubling";
  if (n == 2) return "halves";
  if (pattern::is_pow2(n) && bytes < detail::kAllreduceRabenseifnerBytes) return "rabenseifner";
  return "ring";
}

}  // namespace

void allreduce(const Context& ctx, void* buf, std::size_t count, DataType t, ReduceOp op) {
  detail::Exchange ex(ctx);
  check_reduction(ex.op(), t, op);
  const std::size_t bytes = detail::checked_mul(ctx, count, dtype_size(t), "count x element size");
  detail::check_ptr(ctx, buf, bytes, "buf");
  const int n = ex.size();
  detail::AllreduceArgs a{static_cast<char*>(buf), count, t, op};
  const auto& algo = detail::choose(ex, detail::allreduce_table(), n, a, select(n, a));
  if (n == 1 || count == 0) return;
  detail::WorkStage host(ex, buf, bytes, true);
  a.buf = host.data();
  algo.run(ex, a);
  host.store();
}

}  // namespace commux::coll
