// Allreduce, Rabenseifner: recursive-halving reduce-scatter then recursive-doubling allgather
// among p = 2^floor(log2 n) ranks (2 log2 p steps, each rank sends about 2(p-1)/p of the buffer).
// The n - p extra ranks fold in first as in recursive doubling (the even rank below 2(n-p) hands
// its whole buffer to the odd one above it, which reduces (lower rank on the left) and takes part)
// and get the result back at the end. Each block is reduced on one rank only and then copied, so
// the result is bitwise identical everywhere. The halving steps are chunk-pipelined
// (algo/halving.cpp).
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const AllreduceArgs& a) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(a.t), bytes = a.count * es;
  const pattern::RecursiveDoubling rd = pattern::recursive_doubling(r, n);
  using Role = pattern::RecursiveDoubling::Role;
  ex.phase("rabenseifner: fold");
  if (rd.role == Role::kFoldOut) {
    ex.wait(ex.send_work(a.buf, bytes, rd.fold_peer));
    ex.phase("rabenseifner: result from the fold partner");
    recv_exact(ex, a.buf, bytes, rd.fold_peer, ex.work_mem());
    return;
  }
  if (rd.role == Role::kFoldIn) fold_in(ex, a.buf, a.count, a.t, a.op, rd.fold_peer);
  const int p = pattern::pow2_floor(n), q = pattern::fold_newrank(r, n);
  const pattern::Blocks bl{a.count, p};
  std::vector<std::size_t> off(static_cast<std::size_t>(p) + 1),
      boff(static_cast<std::size_t>(p) + 1);
  for (int b = 0; b <= p; ++b) {
    off[static_cast<std::size_t>(b)] = b < p ? bl.offset(b) : a.count;
    boff[static_cast<std::size_t>(b)] = off[static_cast<std::size_t>(b)] * es;
  }
  recursive_halving(ex, HalvingIo{a.buf, a.buf, 0, nullptr}, off.data(), q, n, a.t, a.op);
  doubling_allgather(ex, a.buf, boff.data(), q, n, ex.work_mem());
  if (rd.role == Role::kFoldIn) {
    ex.phase("rabenseifner: result to the fold partner");
    ex.send_work(a.buf, bytes, rd.fold_peer);
  }
  ex.wait_all();
}

}  // namespace

const Algorithm<AllreduceArgs> allreduce_rabenseifner = {"rabenseifner", nullptr, run};

}  // namespace commux::coll::detail::algo
