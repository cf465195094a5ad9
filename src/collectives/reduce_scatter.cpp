// Reduce-scatter with per-rank counts: ring. At step s (0 .. n-2) rank r sends its partial of
// block r-s-1 to the right and receives the left's partial of block r-s-2, which it reduces with
// its own contribution (left's partial on the left) and sends on at step s+1; the last block it
// receives is its own, which lands in `out`. Each rank sends about (n-1)/n of the input. Blocks
// may differ in size and be empty (zero-byte messages). Three scratch buffers rotate so that the
// next receive is posted before the current block is reduced. `in` is only read. Device buffers
// are staged through host memory.
#include <algorithm>
#include <vector>

#include "internal.hpp"
#include "patterns.hpp"

namespace commux::coll {

void reduce_scatter(const Context& ctx, const void* in, void* out, const std::size_t* counts,
                    DataType t, ReduceOp op) {
  detail::Exchange ex(ctx);
  check_reduction(ex.op(), t, op);
  if (counts == nullptr) detail::Exchange::invalid(ctx, "counts is null");
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(t);
  std::vector<std::size_t> off(static_cast<std::size_t>(n) + 1, 0);
  for (int p = 0; p < n; ++p) off[static_cast<std::size_t>(p) + 1] = off[static_cast<std::size_t>(p)] + counts[p];
  const std::size_t total = off.back();
  const auto cnt = [&](int b) { return counts[b]; };
  const std::size_t mine_bytes = cnt(r) * es;
  detail::check_ptr(ctx, in, total * es, "in");
  detail::check_ptr(ctx, out, mine_bytes, "out");
  if (n == 1) {
    ex.copy(out, ex.mem(), in, ex.mem(), mine_bytes);
    return;
  }
  detail::HostStage src(ex, const_cast<void*>(in), total * es, true);
  detail::HostStage dst(ex, out, mine_bytes, false);
  const char* inb = src.data();
  char* outb = dst.data();
  const auto at = [&](int b) { return inb + off[static_cast<std::size_t>(b)] * es; };
  // The last receive goes straight to `out` unless `out` overlaps `in` (it would overwrite the
  // input block it is reduced with).
  const bool overlap = outb < inb + total * es && inb < outb + mine_bytes;
  std::size_t maxc = 0;
  for (int p = 0; p < n; ++p) maxc = std::max(maxc, cnt(p));
  const int steps = n - 1;
  const int nbuf = std::min(3, steps);
  std::vector<char*> tmp(static_cast<std::size_t>(nbuf));
  for (auto& p : tmp) p = ex.scratch(maxc * es);
  const int left = pattern::ring_left(r, n), right = pattern::ring_right(r, n);
  const auto slot = [&](int s) { return tmp[static_cast<std::size_t>(s % nbuf)]; };
  const auto recv_into = [&](int s) { return (s == steps - 1 && !overlap) ? outb : slot(s); };
  ex.phase("ring reduce-scatter");
  const auto post_recv = [&](int s) {
    const int b = pattern::reduce_scatter_recv_block(r, n, s);
    return ex.recv_host(recv_into(s), cnt(b) * es, left);
  };
  std::size_t rid = post_recv(0);
  std::size_t prev_send = 0;
  bool have_prev_send = false;
  for (int s = 0; s < steps; ++s) {
    const int sb = pattern::reduce_scatter_send_block(r, n, s);
    const char* data = s == 0 ? at(sb) : recv_into(s - 1);
    const std::size_t sid = ex.send_host(data, cnt(sb) * es, right);
    ex.wait(rid);
    const int rb = pattern::reduce_scatter_recv_block(r, n, s);
    if (ex.bytes(rid) != cnt(rb) * es) {
      ex.fail(Errc::kInvalidArgument,
              detail::size_mismatch(left, ex.bytes(rid), cnt(rb) * es,
                                    ("for block " + std::to_string(rb)).c_str()));
    }
    // Slot (s+1) % 3 last held step s-2's block, sent at step s-1: wait for that send first.
    if (have_prev_send) ex.wait(prev_send);
    const std::size_t next = s + 1 < steps ? post_recv(s + 1) : 0;
    char* got = recv_into(s);
    if (s == steps - 1) {
      reduce_into(outb, got, at(rb), cnt(rb), t, op);  // out may alias the input block
    } else {
      reduce_into(got, got, at(rb), cnt(rb), t, op);
    }
    prev_send = sid;
    have_prev_send = true;
    rid = next;
  }
  ex.wait_all();
  dst.store();
}

}  // namespace commux::coll
