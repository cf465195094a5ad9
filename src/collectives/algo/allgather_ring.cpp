// Allgather(v), ring: every rank sends n - 1 blocks to its right-hand neighbour and receives n - 1
// from its left, forwarding at step s the block it received at step s - 1; all receives are posted
// at the start, straight into the output. Any counts (allgatherv) and world sizes; the selector's
// choice for large totals and for unequal parts.
#include <string>
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail {

std::string size_mismatch(int peer, std::size_t got, std::size_t expected, const char* what) {
  return "peer " + std::to_string(peer) + " sent " + std::to_string(got) + " bytes but " +
         std::to_string(expected) + " were expected" +
         (what != nullptr ? std::string(" ") + what : "") + " (the ranks' sizes disagree)";
}

void ring_allgather(Exchange& ex, char* base, const std::size_t* counts, const std::size_t* displs,
                    MemoryType mem) {
  const int n = ex.size(), r = ex.rank();
  if (n == 1) return;
  const int left = pattern::ring_left(r, n), right = pattern::ring_right(r, n);
  std::vector<std::size_t> recvs(static_cast<std::size_t>(n - 1));
  for (int s = 0; s < n - 1; ++s) {
    const auto b = static_cast<std::size_t>(pattern::allgather_recv_block(r, n, s));
    recvs[static_cast<std::size_t>(s)] = ex.recv(base + displs[b], counts[b], left, mem);
  }
  auto check = [&](int s) {
    const auto b = static_cast<std::size_t>(pattern::allgather_recv_block(r, n, s));
    expect_bytes(ex, recvs[static_cast<std::size_t>(s)], left, counts[b],
                 ("for block " + std::to_string(b)).c_str());
  };
  for (int s = 0; s < n - 1; ++s) {
    if (s > 0) {
      ex.wait(recvs[static_cast<std::size_t>(s - 1)]);
      check(s - 1);
    }
    const auto b = static_cast<std::size_t>(pattern::allgather_send_block(r, n, s));
    ex.send(base + displs[b], counts[b], right, mem);
  }
  ex.wait_all();
  check(n - 2);
}

namespace algo {

namespace {

void run(Exchange& ex, const AllgatherArgs& a) {
  const auto me = static_cast<std::size_t>(ex.rank());
  ex.phase("local copy");
  ex.copy(a.out + a.displs[me], ex.mem(), a.in, ex.mem(), a.counts[me]);
  ex.phase("ring allgather");
  ring_allgather(ex, a.out, a.counts, a.displs, ex.mem());
}

}  // namespace

const Algorithm<AllgatherArgs> allgather_ring = {"ring", nullptr, run};

}  // namespace algo
}  // namespace commux::coll::detail
