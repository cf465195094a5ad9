// Reduce to a root: validation, staging and the selector. Algorithms in algo/reduce_*.cpp:
//   * binomial (pipelined tree): the selector's choice for every size;
//   * rabenseifner (recursive-halving reduce-scatter + gather): forced only (COMMUX_ALGO_REDUCE,
//     Context::algorithm). Measured on the 2-core VM with 3 and 4 ranks at 16 MiB it was no faster
//     than the pipelined tree, so the selector does not pick it.
// Device buffers are reduced on the device with Context::device, else staged through host memory.
#include "algo.hpp"

namespace commux::coll {

void reduce(const Context& ctx, void* buf, std::size_t count, DataType t, ReduceOp op, int root) {
  detail::Exchange ex(ctx);
  check_reduction(ex.op(), t, op);
  detail::check_root(ctx, root, ex.size());
  const std::size_t bytes = detail::checked_mul(ctx, count, dtype_size(t), "count x element size");
  detail::check_ptr(ctx, buf, bytes, "buf");
  const int n = ex.size();
  detail::ReduceArgs a{static_cast<char*>(buf), count, t, op, root};
  const auto& algo = detail::choose(ex, detail::reduce_table(), n, a, "binomial");
  if (n == 1 || count == 0) return;
  detail::WorkStage host(ex, buf, bytes, true);
  a.buf = host.data();
  // A non-root's buffer is only read: an algorithm that would write it gets a copy.
  if (ex.rank() != root && !algo.keeps_nonroot_buffer && a.buf == buf) {
    char* copy = ex.scratch(bytes);
    ex.copy(copy, ex.work_mem(), a.buf, ex.work_mem(), bytes);
    a.buf = copy;
  }
  algo.run(ex, a);
  if (ex.rank() == root) host.store();
}

}  // namespace commux::coll
