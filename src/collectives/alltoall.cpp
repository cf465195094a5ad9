// Alltoallv: validation and the selector. Algorithms in algo/alltoall_*.cpp: pairwise (bounded
// in flight, the default) and linear (everything posted at once).
#include <algorithm>
#include <string>

#include "algo.hpp"

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
    in_end = std::max(in_end, detail::checked_add(ctx, send_displs[p], send_counts[p],
                                                  "a send displacement + count"));
    out_end = std::max(out_end, detail::checked_add(ctx, recv_displs[p], recv_counts[p],
                                                    "a receive displacement + count"));
  }
  detail::check_ptr(ctx, in, in_end, "in");
  detail::check_ptr(ctx, out, out_end, "out");
  if (send_counts[me] != recv_counts[me]) {
    detail::Exchange::invalid(
        ctx, "rank " + std::to_string(r) + " sends " + std::to_string(send_counts[me]) +
                 " bytes to itself but expects to receive " + std::to_string(recv_counts[me]));
  }
  const detail::AlltoallArgs a{static_cast<const char*>(in), send_counts, send_displs,
                               static_cast<char*>(out),      recv_counts, recv_displs};
  const auto& algo = detail::choose(ex, detail::alltoall_table(), n, a, "pairwise");
  algo.run(ex, a);
}

}  // namespace commux::coll
