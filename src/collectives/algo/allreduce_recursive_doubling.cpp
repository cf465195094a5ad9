// Allreduce, recursive doubling: log2(p) exchanges of the whole buffer among p = 2^floor(log2 n)
// ranks, with the standard fold for the n - p extra ranks (even ranks below 2(n-p) hand their
// data to the odd rank above them and get the result back at the end). Both partners of an
// exchange compute (lower rank's data) OP (higher rank's data), so every rank ends with the same
// bits. The selector's choice for small messages (latency: log2 n rounds).
#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const AllreduceArgs& a) {
  const int r = ex.rank();
  char* buf = a.buf;
  const std::size_t count = a.count;
  const std::size_t bytes = count * dtype_size(a.t);
  const pattern::RecursiveDoubling rd = pattern::recursive_doubling(r, ex.size());
  using Role = pattern::RecursiveDoubling::Role;
  char* tmp = ex.scratch(bytes);
  ex.phase("recursive doubling: fold");
  if (rd.role == Role::kFoldOut) {
    const std::size_t s = ex.send_work(buf, bytes, rd.fold_peer);
    ex.wait(s);
    ex.phase("recursive doubling: result from the fold partner");
    recv_exact(ex, buf, bytes, rd.fold_peer, ex.work_mem());
    return;
  }
  if (rd.role == Role::kFoldIn) {
    recv_exact(ex, tmp, bytes, rd.fold_peer, ex.work_mem());
    ex.reduce(buf, tmp, buf, count, a.t, a.op);  // the partner (lower rank) on the left
  }
  ex.phase("recursive doubling");
  for (int partner : rd.partners) {
    const std::size_t id = ex.recv_work(tmp, bytes, partner);
    const std::size_t s = ex.send_work(buf, bytes, partner);
    ex.wait(id);
    expect_bytes(ex, id, partner, bytes, nullptr);
    ex.wait(s);
    if (partner < r) {
      ex.reduce(buf, tmp, buf, count, a.t, a.op);
    } else {
      ex.reduce(buf, buf, tmp, count, a.t, a.op);
    }
  }
  if (rd.role == Role::kFoldIn) {
    ex.phase("recursive doubling: result to the fold partner");
    ex.send_work(buf, bytes, rd.fold_peer);
    ex.wait_all();
  }
}

}  // namespace

const Algorithm<AllreduceArgs> allreduce_recursive_doubling = {"recursive_doubling", nullptr, run};

}  // namespace commux::coll::detail::algo
