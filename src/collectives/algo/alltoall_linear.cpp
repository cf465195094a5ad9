// Alltoall(v), linear: all n - 1 receives are posted first, then all sends (nearest ranks first,
// so that not everyone sends to rank 0 first). Every pair exchanges a message, zero bytes too.
// Unbounded in flight: for small worlds; the selector uses pairwise.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail {

// The received size check shared by the alltoall algorithms.
void alltoall_check(Exchange& ex, std::size_t id, int p, std::size_t expected) {
  const std::size_t got = ex.bytes(id);
  if (got != expected) {
    ex.fail(Errc::kCallMismatch, "peer " + std::to_string(p) + " sent " + std::to_string(got) +
                                     " bytes but recv_counts[" + std::to_string(p) + "] on rank " +
                                     std::to_string(ex.rank()) + " is " + std::to_string(expected) +
                                     " (the send and receive splits of the two ranks disagree)");
  }
}

namespace algo {

namespace {

void run(Exchange& ex, const AlltoallArgs& a) {
  const int n = ex.size(), r = ex.rank();
  ex.phase("linear exchange");
  std::vector<std::size_t> recvs(static_cast<std::size_t>(n));
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(pattern::pairwise_recv_from(r, n, i));
    recvs[p] = ex.recv_user(a.out + a.recv_displs[p], a.recv_counts[p], static_cast<int>(p));
  }
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(pattern::pairwise_send_to(r, n, i));
    ex.send_user(a.in + a.send_displs[p], a.send_counts[p], static_cast<int>(p));
  }
  const auto me = static_cast<std::size_t>(r);
  ex.copy(a.out + a.recv_displs[me], ex.mem(), a.in + a.send_displs[me], ex.mem(),
          a.send_counts[me]);
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(pattern::pairwise_recv_from(r, n, i));
    ex.wait(recvs[p]);
    alltoall_check(ex, recvs[p], static_cast<int>(p), a.recv_counts[p]);
  }
  ex.wait_all();
}

}  // namespace

const Algorithm<AlltoallArgs> alltoall_linear = {"linear", nullptr, run};

}  // namespace algo
}  // namespace commux::coll::detail
