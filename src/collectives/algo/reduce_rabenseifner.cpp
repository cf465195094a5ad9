// Reduce to a root, Rabenseifner: the extra ranks fold in (as in allreduce), recursive halving
// leaves newrank q with block q of p reduced, and a binomial gather in newrank space
// (pattern::halving_gather) collects the blocks on the root's newrank. A root that folded out gets
// the result from its fold partner. Each rank sends about (p-1)/p of the buffer twice instead of
// the whole buffer once per tree level. It writes every rank's buffer: the entry point (reduce.cpp)
// hands non-roots a scratch copy.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const ReduceArgs& a) {
  const int n = ex.size(), r = ex.rank(), root = a.root;
  const std::size_t es = dtype_size(a.t), bytes = a.count * es;
  const pattern::RecursiveDoubling rd = pattern::recursive_doubling(r, n);
  using Role = pattern::RecursiveDoubling::Role;
  // The newrank that collects the result: the root's, or its fold partner's.
  const int qroot = pattern::fold_newrank(root, n) >= 0 ? pattern::fold_newrank(root, n)
                                                        : pattern::fold_newrank(root + 1, n);
  const bool root_out = pattern::fold_newrank(root, n) < 0;
  ex.phase("rabenseifner reduce: fold");
  if (rd.role == Role::kFoldOut) {
    ex.wait(ex.send_work(a.buf, bytes, rd.fold_peer));
    if (r == root) {
      ex.phase("rabenseifner reduce: result from the fold partner");
      recv_exact(ex, a.buf, bytes, rd.fold_peer, ex.work_mem());
    }
    return;
  }
  if (rd.role == Role::kFoldIn) fold_in(ex, a.buf, a.count, a.t, a.op, rd.fold_peer);
  const int p = pattern::pow2_floor(n), q = pattern::fold_newrank(r, n);
  const pattern::Blocks bl{a.count, p};
  std::vector<std::size_t> off(static_cast<std::size_t>(p) + 1);
  for (int b = 0; b <= p; ++b) off[static_cast<std::size_t>(b)] = b < p ? bl.offset(b) : a.count;
  recursive_halving(ex, HalvingIo{a.buf, a.buf, 0, nullptr}, off.data(), q, n, a.t, a.op);
  ex.phase("rabenseifner reduce: gather");
  for (const auto& st : pattern::halving_gather(q, qroot, p)) {
    const int peer = pattern::fold_real(st.partner, n);
    char* at = a.buf + off[static_cast<std::size_t>(st.lo)] * es;
    const std::size_t len =
        (off[static_cast<std::size_t>(st.hi)] - off[static_cast<std::size_t>(st.lo)]) * es;
    if (st.send) {
      ex.wait(ex.send_work(at, len, peer));
    } else {
      recv_exact(ex, at, len, peer, ex.work_mem());
    }
  }
  if (root_out && q == qroot) {
    ex.phase("rabenseifner reduce: result to the root");
    ex.wait(ex.send_work(a.buf, bytes, root));
  }
  ex.wait_all();
}

}  // namespace

const Algorithm<ReduceArgs> reduce_rabenseifner = {"rabenseifner", nullptr, run};

}  // namespace commux::coll::detail::algo
