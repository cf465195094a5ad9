// Allreduce (in place).
//   * small (< kAllreduceSmallBytes, or fewer elements than ranks): recursive doubling,
//     log2(p) exchanges of the whole buffer among p = 2^floor(log2 n) ranks, with the standard
//     fold for the n - p extra ranks (even ranks below 2(n-p) hand their data to the odd rank
//     above them and get the result back at the end). Both partners of an exchange compute
//     (lower rank's data) OP (higher rank's data), so every rank ends with the same bits.
//   * large, 2 ranks: halves exchange. Rank 0 reduces the first half, rank 1 the second; each
//     sends the other its half, reduces, then they swap the reduced halves (each rank moves one
//     buffer's worth in total, and reduces half of it), pipelined in chunks of ~1 MiB.
//   * large, 3+ ranks: ring reduce-scatter then ring allgather over n nearly equal blocks (blocks
//     may be empty; each rank sends 2(n-1)/n of the buffer). Every block is reduced on one rank
//     only and then copied, so the result is bitwise identical everywhere.
// Device buffers (ctx.mem != kHost) are staged through host memory: the kernels run on the host.
#include <algorithm>
#include <vector>

#include "internal.hpp"
#include "patterns.hpp"

namespace commux::coll {

namespace {

using detail::Exchange;

void recursive_doubling(Exchange& ex, char* buf, std::size_t count, DataType t, ReduceOp op) {
  const int r = ex.rank();
  const std::size_t bytes = count * dtype_size(t);
  const pattern::RecursiveDoubling rd = pattern::recursive_doubling(r, ex.size());
  using Role = pattern::RecursiveDoubling::Role;
  char* tmp = ex.scratch(bytes);
  ex.phase("recursive doubling: fold");
  if (rd.role == Role::kFoldOut) {
    // Hand the data to the odd partner, get the result back.
    const std::size_t s = ex.send_host(buf, bytes, rd.fold_peer);
    ex.wait(s);
    ex.phase("recursive doubling: result from the fold partner");
    const std::size_t id = ex.recv_host(buf, bytes, rd.fold_peer);
    ex.wait(id);
    return;
  }
  if (rd.role == Role::kFoldIn) {
    const std::size_t id = ex.recv_host(tmp, bytes, rd.fold_peer);
    ex.wait(id);
    reduce_into(buf, tmp, buf, count, t, op);  // the partner (lower rank) on the left
  }
  ex.phase("recursive doubling");
  for (int partner : rd.partners) {
    const std::size_t id = ex.recv_host(tmp, bytes, partner);
    const std::size_t s = ex.send_host(buf, bytes, partner);
    ex.wait(id);
    ex.wait(s);
    if (partner < r) {
      reduce_into(buf, tmp, buf, count, t, op);
    } else {
      reduce_into(buf, buf, tmp, count, t, op);
    }
  }
  if (rd.role == Role::kFoldIn) {
    ex.phase("recursive doubling: result to the fold partner");
    ex.send_host(buf, bytes, rd.fold_peer);
    ex.wait_all();
  }
}

// The halves exchange, pipelined in K chunks per half (both ranks cut both halves the same way).
// Messages from each rank, in order: X0 X1 R0 X2 R1 X3 ... R(K-1), where Xj is chunk j of the
// half the peer reduces and Rj is chunk j of this rank's half, reduced; receives are posted in
// the same order. So chunk j+1 is on its way while chunk j is reduced, and reduced chunks go
// back at once.
void halves(Exchange& ex, char* buf, std::size_t count, DataType t, ReduceOp op) {
  const int r = ex.rank(), peer = 1 - r;
  const std::size_t es = dtype_size(t);
  const std::size_t h = count / 2;
  const std::size_t own_off = r == 0 ? 0 : h, own_n = r == 0 ? h : count - h;
  const std::size_t oth_off = r == 0 ? h : 0, oth_n = count - own_n;
  const int k = detail::pipeline_chunks(std::max(own_n, oth_n) * es);
  const pattern::Blocks oc{own_n, k}, xc{oth_n, k};
  auto own = [&](int j) { return buf + (own_off + oc.offset(j)) * es; };
  auto oth = [&](int j) { return buf + (oth_off + xc.offset(j)) * es; };
  char* tmp[2] = {ex.scratch(oc.max() * es), k > 1 ? ex.scratch(oc.max() * es) : nullptr};
  std::vector<std::size_t> recv_own(static_cast<std::size_t>(k)), send_oth(static_cast<std::size_t>(k));
  const auto ku = static_cast<std::size_t>(k);
  auto post_pair = [&](int j) {
    const auto ju = static_cast<std::size_t>(j);
    recv_own[ju] = ex.recv_host(tmp[j % 2], oc.size(j) * es, peer);
    send_oth[ju] = ex.send_host(oth(j), xc.size(j) * es, peer);
  };
  ex.phase("halves exchange");
  for (int j = 0; j < std::min(2, k); ++j) post_pair(j);
  for (int j = 0; j < k; ++j) {
    const auto ju = static_cast<std::size_t>(j);
    ex.wait(recv_own[ju]);
    if (r == 0) {
      reduce_into(own(j), own(j), tmp[j % 2], oc.size(j), t, op);
    } else {
      reduce_into(own(j), tmp[j % 2], own(j), oc.size(j), t, op);
    }
    ex.send_host(own(j), oc.size(j) * es, peer);
    ex.wait(send_oth[ju]);  // its memory now receives the peer's reduced chunk
    ex.recv_host(oth(j), xc.size(j) * es, peer);
    if (ju + 2 < ku) post_pair(j + 2);
  }
  ex.wait_all();
}

void ring(Exchange& ex, char* buf, std::size_t count, DataType t, ReduceOp op) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(t);
  const pattern::Blocks bl{count, n};
  const int left = pattern::ring_left(r, n), right = pattern::ring_right(r, n);
  char* tmp[2] = {ex.scratch(bl.max() * es), ex.scratch(bl.max() * es)};
  auto at = [&](int b) { return buf + bl.offset(b) * es; };
  ex.phase("ring reduce-scatter");
  auto post_recv = [&](int s) {
    const int b = pattern::reduce_scatter_recv_block(r, n, s);
    return ex.recv_host(tmp[s % 2], bl.size(b) * es, left);
  };
  std::size_t rid = post_recv(0);
  for (int s = 0; s < n - 1; ++s) {
    const int sb = pattern::reduce_scatter_send_block(r, n, s);
    const std::size_t sid = ex.send_host(at(sb), bl.size(sb) * es, right);
    ex.wait(rid);
    // The next receive goes to the other scratch buffer (its last contents are reduced already),
    // so the left neighbour's next block can arrive while this one is reduced.
    const std::size_t next = s + 1 < n - 1 ? post_recv(s + 1) : 0;
    const int rb = pattern::reduce_scatter_recv_block(r, n, s);
    reduce_into(at(rb), tmp[s % 2], at(rb), bl.size(rb), t, op);
    ex.wait(sid);
    rid = next;
  }
  ex.phase("ring allgather");
  std::vector<std::size_t> counts(static_cast<std::size_t>(n)), displs(static_cast<std::size_t>(n));
  for (int b = 0; b < n; ++b) {
    counts[static_cast<std::size_t>(b)] = bl.size(b) * es;
    displs[static_cast<std::size_t>(b)] = bl.offset(b) * es;
  }
  detail::ring_allgather(ex, buf, counts.data(), displs.data(), MemoryType::kHost);
}

}  // namespace

void allreduce(const Context& ctx, void* buf, std::size_t count, DataType t, ReduceOp op) {
  Exchange ex(ctx);
  check_reduction(ex.op(), t, op);
  const std::size_t bytes = count * dtype_size(t);
  detail::check_ptr(ctx, buf, bytes, "buf");
  const int n = ex.size();
  if (n == 1 || count == 0) return;
  detail::HostStage host(ex, buf, bytes, true);
  if (bytes < detail::kAllreduceSmallBytes || count < static_cast<std::size_t>(n)) {
    recursive_doubling(ex, host.data(), count, t, op);
  } else if (n == 2) {
    halves(ex, host.data(), count, t, op);
  } else {
    ring(ex, host.data(), count, t, op);
  }
  host.store();
}

}  // namespace commux::coll
