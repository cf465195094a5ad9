// Allgather / allgatherv: ring. Every rank sends n - 1 blocks to its right-hand neighbour and
// receives n - 1 from its left, forwarding at step s the block it received at step s - 1; all
// receives are posted at the start (they land directly in the output).
#include <string>
#include <vector>

#include "internal.hpp"
#include "patterns.hpp"

namespace commux::coll {

namespace detail {

std::string size_mismatch(int peer, std::size_t got, std::size_t expected, const char* what) {
  return "peer " + std::to_string(peer) + " sent " + std::to_string(got) + " bytes but " +
         std::to_string(expected) + " were expected" + (what != nullptr ? std::string(" ") + what : "") +
         " (the ranks' sizes disagree)";
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
  for (int s = 0; s < n - 1; ++s) {
    if (s > 0) {
      const std::size_t id = recvs[static_cast<std::size_t>(s - 1)];
      ex.wait(id);
      const auto b = static_cast<std::size_t>(pattern::allgather_recv_block(r, n, s - 1));
      if (ex.bytes(id) != counts[b]) {
        ex.fail(Errc::kInvalidArgument,
                size_mismatch(left, ex.bytes(id), counts[b],
                              ("for block " + std::to_string(b)).c_str()));
      }
    }
    const auto b = static_cast<std::size_t>(pattern::allgather_send_block(r, n, s));
    ex.send(base + displs[b], counts[b], right, mem);
  }
  ex.wait_all();
  const std::size_t last = recvs.back();
  const auto b = static_cast<std::size_t>(pattern::allgather_recv_block(r, n, n - 2));
  if (ex.bytes(last) != counts[b]) {
    ex.fail(Errc::kInvalidArgument, size_mismatch(left, ex.bytes(last), counts[b],
                                                  ("for block " + std::to_string(b)).c_str()));
  }
}

}  // namespace detail

void allgatherv(const Context& ctx, const void* in, void* out, const std::size_t* counts,
                const std::size_t* displs) {
  detail::Exchange ex(ctx);
  const int n = ex.size(), r = ex.rank();
  if (counts == nullptr || displs == nullptr) detail::Exchange::invalid(ctx, "counts/displs are null");
  const auto me = static_cast<std::size_t>(r);
  std::size_t total = 0;
  for (int p = 0; p < n; ++p) total += counts[p];
  detail::check_ptr(ctx, in, counts[me], "in");
  detail::check_ptr(ctx, out, total, "out");
  char* base = static_cast<char*>(out);
  ex.phase("local copy");
  ex.copy(base + displs[me], ex.mem(), in, ex.mem(), counts[me]);
  ex.phase("ring allgather");
  detail::ring_allgather(ex, base, counts, displs, ex.mem());
}

void allgather(const Context& ctx, const void* in, std::size_t bytes, void* out) {
  if (ctx.comm == nullptr) detail::Exchange::invalid(ctx, "Context::comm is null");
  const auto n = static_cast<std::size_t>(ctx.comm->size());
  std::vector<std::size_t> counts(n, bytes), displs(n);
  for (std::size_t p = 0; p < n; ++p) displs[p] = p * bytes;
  allgatherv(ctx, in, out, counts.data(), displs.data());
}

}  // namespace commux::coll
