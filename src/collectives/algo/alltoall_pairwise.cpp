// Alltoall(v), pairwise exchange: step i = 1 .. n-1 sends to r + i and receives from r - i, with at
// most kMaxInFlight steps outstanding (step i + kMaxInFlight is posted when step i's receive and
// send are complete), so a large world does not flood any rank with n - 1 messages at once.
// Every pair exchanges a message, zero bytes too, so ranks whose splits disagree fail instead of
// hanging: a longer message fails with kTruncated, a shorter one with kCallMismatch, both naming
// the peer and both sizes. The rank's own block is a local copy. The selector's choice.
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail {

void alltoall_check(Exchange& ex, std::size_t id, int p, std::size_t expected);

namespace algo {

namespace {

void run(Exchange& ex, const AlltoallArgs& a) {
  const int n = ex.size(), r = ex.rank();
  ex.phase("pairwise exchange");
  std::vector<std::size_t> rid(static_cast<std::size_t>(n)), sid(static_cast<std::size_t>(n));
  auto post = [&](int i) {
    const auto from = static_cast<std::size_t>(pattern::pairwise_recv_from(r, n, i));
    const auto to = static_cast<std::size_t>(pattern::pairwise_send_to(r, n, i));
    rid[static_cast<std::size_t>(i)] =
        ex.recv_user(a.out + a.recv_displs[from], a.recv_counts[from], static_cast<int>(from));
    sid[static_cast<std::size_t>(i)] =
        ex.send_user(a.in + a.send_displs[to], a.send_counts[to], static_cast<int>(to));
  };
  const auto me = static_cast<std::size_t>(r);
  windowed_steps(
      n, post,
      [&] {
        ex.copy(a.out + a.recv_displs[me], ex.mem(), a.in + a.send_displs[me], ex.mem(),
                a.send_counts[me]);
      },
      [&](int i) {
        const int from = pattern::pairwise_recv_from(r, n, i);
        ex.wait(rid[static_cast<std::size_t>(i)]);
        alltoall_check(ex, rid[static_cast<std::size_t>(i)], from,
                       a.recv_counts[static_cast<std::size_t>(from)]);
        ex.wait(sid[static_cast<std::size_t>(i)]);
      });
  ex.wait_all();
}

}  // namespace

const Algorithm<AlltoallArgs> alltoall_pairwise = {"pairwise", nullptr, run};

}  // namespace algo
}  // namespace commux::coll::detail
