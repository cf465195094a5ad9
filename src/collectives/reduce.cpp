// Reduce to a root: binomial tree, pipelined in chunks of ~1 MiB. Each rank receives its
// children's partial results, smallest subtree first (it is ready first), reduces them into its
// buffer (its own data on the left) and sends the result to its parent chunk by chunk. Non-root
// buffers are used as scratch. Device buffers are staged through host memory.
#include <algorithm>
#include <vector>

#include "internal.hpp"
#include "patterns.hpp"

namespace commux::coll {

void reduce(const Context& ctx, void* buf, std::size_t count, DataType t, ReduceOp op, int root) {
  detail::Exchange ex(ctx);
  check_reduction(ex.op(), t, op);
  detail::check_root(ctx, root, ex.size());
  const std::size_t es = dtype_size(t), bytes = count * es;
  detail::check_ptr(ctx, buf, bytes, "buf");
  const int n = ex.size(), r = ex.rank();
  if (n == 1 || count == 0) return;
  detail::HostStage host(ex, buf, bytes, true);
  char* mine = host.data();
  const pattern::Tree tree = pattern::binomial_tree(r, n, root);
  ex.phase("binomial tree");
  // Pipelined in K chunks: a rank forwards chunk c to its parent as soon as it has reduced its
  // children's chunk c, while their chunk c+1 arrives in the other half of the scratch.
  const int k = detail::pipeline_chunks(bytes);
  const pattern::Blocks ch{count, k};
  const auto at = [&](int c) { return mine + ch.offset(c) * es; };
  const std::vector<int> kids(tree.children.rbegin(), tree.children.rend());
  const std::size_t nk = kids.size();
  std::vector<char*> slot(2 * nk, nullptr);  // slot[(c % 2) * nk + i]: chunk c of kid i
  for (std::size_t i = 0; i < slot.size(); ++i) {
    if (i < nk || k > 1) slot[i] = ex.scratch(ch.max() * es);
  }
  std::vector<std::size_t> rid(2 * nk);
  const auto post = [&](int c, std::size_t i) {
    const std::size_t s = static_cast<std::size_t>(c % 2) * nk + i;
    rid[s] = ex.recv_host(slot[s], ch.size(c) * es, kids[i]);
  };
  for (int c = 0; c < std::min(2, k); ++c) {
    for (std::size_t i = 0; i < nk; ++i) post(c, i);
  }
  for (int c = 0; c < k; ++c) {
    for (std::size_t i = 0; i < nk; ++i) {
      const std::size_t s = static_cast<std::size_t>(c % 2) * nk + i;
      ex.wait(rid[s]);
      if (ex.bytes(rid[s]) != ch.size(c) * es) {
        ex.fail(Errc::kInvalidArgument,
                detail::size_mismatch(kids[i], ex.bytes(rid[s]), ch.size(c) * es, nullptr));
      }
      reduce_into(at(c), slot[s], ch.size(c), t, op);
      if (c + 2 < k) post(c + 2, i);
    }
    if (tree.parent >= 0) ex.send_host(at(c), ch.size(c) * es, tree.parent);
  }
  ex.wait_all();
  if (tree.parent < 0) host.store();
}

}  // namespace commux::coll
