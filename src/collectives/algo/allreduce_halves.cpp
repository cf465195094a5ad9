// Allreduce, halves exchange (2 ranks only; declines other world sizes). Rank 0 reduces the first
// half, rank 1 the second; each sends the other its half, reduces, then they swap the reduced
// halves (each rank moves one buffer's worth in total and reduces half of it). Pipelined in K
// chunks per half (both ranks cut both halves the same way). Messages from each rank, in order:
// X0 X1 R0 X2 R1 X3 ... R(K-1), where Xj is chunk j of the half the peer reduces and Rj is chunk j
// of this rank's half, reduced; receives are posted in the same order. So chunk j+1 is on its way
// while chunk j is reduced, and reduced chunks go back at once. The selector's choice for 2 ranks
// from kAllreduceSmallBytes up.
#include <algorithm>
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

bool accepts(int n, const AllreduceArgs&) { return n == 2; }

void run(Exchange& ex, const AllreduceArgs& a) {
  char* buf = a.buf;
  const std::size_t count = a.count;
  const DataType t = a.t;
  const ReduceOp op = a.op;
  const int r = ex.rank(), peer = 1 - r;
  const std::size_t es = dtype_size(t);
  const std::size_t h = count / 2;
  const std::size_t own_off = r == 0 ? 0 : h, own_n = r == 0 ? h : count - h;
  const std::size_t oth_off = r == 0 ? h : 0, oth_n = count - own_n;
  const int k = pipeline_chunks(std::max(own_n, oth_n) * es, ex.work_mem());
  const pattern::Blocks oc{own_n, k}, xc{oth_n, k};
  auto own = [&](int j) { return buf + (own_off + oc.offset(j)) * es; };
  auto oth = [&](int j) { return buf + (oth_off + xc.offset(j)) * es; };
  char* tmp[2] = {ex.scratch(oc.max() * es), k > 1 ? ex.scratch(oc.max() * es) : nullptr};
  std::vector<std::size_t> recv_own(static_cast<std::size_t>(k)),
      send_oth(static_cast<std::size_t>(k));
  const auto ku = static_cast<std::size_t>(k);
  auto post_pair = [&](int j) {
    const auto ju = static_cast<std::size_t>(j);
    recv_own[ju] = ex.recv_work(tmp[j % 2], oc.size(j) * es, peer);
    send_oth[ju] = ex.send_work(oth(j), xc.size(j) * es, peer);
  };
  ex.phase("halves exchange");
  for (int j = 0; j < std::min(2, k); ++j) post_pair(j);
  for (int j = 0; j < k; ++j) {
    const auto ju = static_cast<std::size_t>(j);
    ex.wait(recv_own[ju]);
    expect_bytes(ex, recv_own[ju], peer, oc.size(j) * es, nullptr);
    if (r == 0) {
      ex.reduce(own(j), own(j), tmp[j % 2], oc.size(j), t, op);
    } else {
      ex.reduce(own(j), tmp[j % 2], own(j), oc.size(j), t, op);
    }
    ex.send_work(own(j), oc.size(j) * es, peer);
    ex.wait(send_oth[ju]);  // its memory now receives the peer's reduced chunk
    ex.recv_work(oth(j), xc.size(j) * es, peer);
    if (ju + 2 < ku) post_pair(j + 2);
  }
  ex.wait_all();
}

}  // namespace

const Algorithm<AllreduceArgs> allreduce_halves = {"halves", accepts, run};

}  // namespace commux::coll::detail::algo
