// Barrier, dissemination: ceil(log2 n) rounds of zero-byte messages. In round k rank r tells
// r + 2^k it has arrived and waits for r - 2^k; after the last round every rank has (transitively)
// heard from every other. Any world size.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const BarrierArgs&) {
  const int n = ex.size(), r = ex.rank();
  ex.phase("dissemination");
  const std::vector<pattern::Round> rounds = pattern::dissemination(r, n);
  std::vector<std::size_t> recvs;
  recvs.reserve(rounds.size());
  for (const auto& rd : rounds) recvs.push_back(ex.recv_host(nullptr, 0, rd.recv_from));
  for (std::size_t k = 0; k < rounds.size(); ++k) {
    if (k > 0) ex.wait(recvs[k - 1]);
    ex.send_host(nullptr, 0, rounds[k].send_to);
  }
  ex.wait_all();
}

}  // namespace

const Algorithm<BarrierArgs> barrier_dissemination = {"dissemination", nullptr, run};

}  // namespace commux::coll::detail::algo
