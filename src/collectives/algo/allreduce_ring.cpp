// Allreduce, ring: ring reduce-scatter then ring allgather over n nearly equal blocks (blocks may
// be empty; each rank sends 2(n-1)/n of the buffer). Every block is reduced on one rank only and
// then copied, so the result is bitwise identical everywhere.
//
// The reduce-scatter is chunk-pipelined: each block is cut into chunks of ~kPipelineChunkBytes
// (by its own size, so sender and receiver agree), and a chunk is forwarded to the right as soon
// as it is reduced, while the next chunks are still arriving from the left into a few rotating
// scratch slots. So the reduction of chunk j overlaps the transfer of chunk j+1 instead of each
// step being "transfer a block, then reduce it". The selector's choice for large messages on 3+
// ranks.
#include <algorithm>
#include <utility>
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

// Receive slots in flight at once.
constexpr int kSlots = 3;

void run(Exchange& ex, const AllreduceArgs& a) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(a.t);
  const pattern::Blocks bl{a.count, n};
  const int left = pattern::ring_left(r, n), right = pattern::ring_right(r, n);
  auto at = [&](int b) { return a.buf + bl.offset(b) * es; };
  auto chunks = [&](int b) {
    return pattern::Blocks{bl.size(b), pipeline_chunks(bl.size(b) * es, ex.work_mem())};
  };
  std::size_t max_chunk = 0;
  for (int b = 0; b < n; ++b) max_chunk = std::max(max_chunk, chunks(b).max());
  // The receives, in order: (step, chunk).
  std::vector<std::pair<int, int>> items;
  for (int s = 0; s < n - 1; ++s) {
    const int k = chunks(pattern::reduce_scatter_recv_block(r, n, s)).n;
    for (int j = 0; j < k; ++j) items.emplace_back(s, j);
  }
  const int nslots = static_cast<int>(std::min<std::size_t>(kSlots, items.size()));
  std::vector<char*> slot(static_cast<std::size_t>(nslots));
  for (auto& p : slot) p = ex.scratch(max_chunk * es);
  std::vector<std::size_t> rid(items.size());
  auto post = [&](std::size_t i) {
    const auto [s, j] = items[i];
    const int b = pattern::reduce_scatter_recv_block(r, n, s);
    rid[i] = ex.recv_work(slot[i % static_cast<std::size_t>(nslots)], chunks(b).size(j) * es, left);
  };
  ex.phase("ring reduce-scatter");
  for (std::size_t i = 0; i < static_cast<std::size_t>(nslots); ++i) post(i);
  {
    const int b = pattern::reduce_scatter_send_block(r, n, 0);
    const pattern::Blocks c = chunks(b);
    for (int j = 0; j < c.n; ++j) ex.send_work(at(b) + c.offset(j) * es, c.size(j) * es, right);
  }
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto [s, j] = items[i];
    const int b = pattern::reduce_scatter_recv_block(r, n, s);
    const pattern::Blocks c = chunks(b);
    ex.wait(rid[i]);
    expect_bytes(ex, rid[i], left, c.size(j) * es, "(ring reduce-scatter)");
    char* dst = at(b) + c.offset(j) * es;
    ex.reduce(dst, slot[i % static_cast<std::size_t>(nslots)], dst, c.size(j), a.t, a.op);
    // Block b is what this rank sends at step s + 1: forward the chunk at once.
    if (s + 1 < n - 1) ex.send_work(dst, c.size(j) * es, right);
    if (i + static_cast<std::size_t>(nslots) < items.size())
      post(i + static_cast<std::size_t>(nslots));
  }
  // The allgather receives into blocks that were sent above: those sends must be complete.
  ex.wait_all();
  ex.phase("ring allgather");
  std::vector<std::size_t> counts(static_cast<std::size_t>(n)), displs(static_cast<std::size_t>(n));
  for (int b = 0; b < n; ++b) {
    counts[static_cast<std::size_t>(b)] = bl.size(b) * es;
    displs[static_cast<std::size_t>(b)] = bl.offset(b) * es;
  }
  ring_allgather(ex, a.buf, counts.data(), displs.data(), ex.work_mem());
}

}  // namespace

const Algorithm<AllreduceArgs> allreduce_ring = {"ring", nullptr, run};

}  // namespace commux::coll::detail::algo
