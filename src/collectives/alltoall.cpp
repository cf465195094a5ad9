// Alltoallv: direct personalized exchange. All n - 1 receives are posted first, then all sends,
// every pair exchanging a message even of zero bytes, so that ranks whose splits disagree fail
// instead of hanging: a message longer than the receive fails with kTruncated, a shorter one is
// reported as kInvalidArgument, both naming the peer and both sizes. The rank's own block is a
// local copy (a message to itself for device memory). Posting starts with the nearest ranks
// (r-1 / r+1, ...) so that not everyone sends to rank 0 first.
#include <algorithm>
#include <string>
#include <vector>

#include "internal.hpp"
#include "patterns.hpp"

namespace commux::coll {

void alltoallv(const Context& ctx, const void* in, const std::size_t* send_counts,
               const std::size_t* send_displs, void* out, const std::size_t* recv_counts,
               const std::size_t* recv_displs) {
  detail::Exchange ex(ctx);
  if (send_counts == nullptr || send_displs == nullptr || recv_counts == nullptr ||
      recv_displs == nullptr) {
    detail::Exchange::invalid(ctx, "a count or displacement array is null");
  }
  const int n = ex.size(), r = ex.rank();
  const auto me = static_cast<std::size_t>(r);
  std::size_t in_end = 0, out_end = 0;
  for (int p = 0; p < n; ++p) {
    in_end = std::max(in_end, send_displs[p] + send_counts[p]);
    out_end = std::max(out_end, recv_displs[p] + recv_counts[p]);
  }
  detail::check_ptr(ctx, in, in_end, "in");
  detail::check_ptr(ctx, out, out_end, "out");
  if (send_counts[me] != recv_counts[me]) {
    detail::Exchange::invalid(ctx, "rank " + std::to_string(r) + " sends " +
                                       std::to_string(send_counts[me]) +
                                       " bytes to itself but expects to receive " +
                                       std::to_string(recv_counts[me]));
  }
  const char* i0 = static_cast<const char*>(in);
  char* o0 = static_cast<char*>(out);
  ex.phase("direct exchange");
  std::vector<std::size_t> recvs(static_cast<std::size_t>(n));
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(pattern::mod(r - i, n));
    recvs[p] = ex.recv_user(o0 + recv_displs[p], recv_counts[p], static_cast<int>(p));
  }
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(pattern::mod(r + i, n));
    ex.send_user(i0 + send_displs[p], send_counts[p], static_cast<int>(p));
  }
  ex.copy(o0 + recv_displs[me], ex.mem(), i0 + send_displs[me], ex.mem(), send_counts[me]);
  for (int i = 1; i < n; ++i) {
    const auto p = static_cast<std::size_t>(pattern::mod(r - i, n));
    ex.wait(recvs[p]);
    const std::size_t got = ex.bytes(recvs[p]);
    if (got != recv_counts[p]) {
      ex.fail(Errc::kInvalidArgument,
              "peer " + std::to_string(p) + " sent " + std::to_string(got) +
                  " bytes but recv_counts[" + std::to_string(p) + "] on rank " + std::to_string(r) +
                  " is " + std::to_string(recv_counts[p]) +
                  " (the send and receive splits of the two ranks disagree)");
    }
  }
  ex.wait_all();
}

}  // namespace commux::coll
