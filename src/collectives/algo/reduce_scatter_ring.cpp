// Reduce-scatter, ring, with per-rank counts: at step s (0 .. n-2) rank r sends its partial of
// block r-s-1 to the right and receives the left's partial of block r-s-2, which it reduces with
// its own contribution (left's partial on the left) and sends on at step s+1; the last block it
// receives is its own, which lands in `out`. Each rank sends about (n-1)/n of the input. Blocks
// may differ in size and be empty (zero-byte messages). Three scratch buffers rotate so that the
// next receive is posted before the current block is reduced. `in` is only read. Any world size
// and counts: the selector's choice except for small totals on power-of-two world sizes.
#include <algorithm>
#include <string>
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const ReduceScatterArgs& a) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(a.t);
  const auto cnt = [&](int b) { return a.off[b + 1] - a.off[b]; };
  const std::size_t total = a.off[n];
  const std::size_t mine_bytes = cnt(r) * es;
  const char* inb = a.in;
  char* outb = a.out;
  const auto at = [&](int b) { return inb + a.off[b] * es; };
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
    return ex.recv_work(recv_into(s), cnt(b) * es, left);
  };
  std::size_t rid = post_recv(0);
  std::size_t prev_send = 0;
  bool have_prev_send = false;
  for (int s = 0; s < steps; ++s) {
    const int sb = pattern::reduce_scatter_send_block(r, n, s);
    const char* data = s == 0 ? at(sb) : recv_into(s - 1);
    const std::size_t sid = ex.send_work(data, cnt(sb) * es, right);
    ex.wait(rid);
    const int rb = pattern::reduce_scatter_recv_block(r, n, s);
    expect_bytes(ex, rid, left, cnt(rb) * es, ("for block " + std::to_string(rb)).c_str());
    // Slot (s+1) % 3 last held step s-2's block, sent at step s-1: wait for that send first.
    if (have_prev_send) ex.wait(prev_send);
    const std::size_t next = s + 1 < steps ? post_recv(s + 1) : 0;
    char* got = recv_into(s);
    if (s == steps - 1) {
      ex.reduce(outb, got, at(rb), cnt(rb), a.t, a.op);  // out may alias the input block
    } else {
      ex.reduce(got, got, at(rb), cnt(rb), a.t, a.op);
    }
    prev_send = sid;
    have_prev_send = true;
    rid = next;
  }
  ex.wait_all();
}

}  // namespace

const Algorithm<ReduceScatterArgs> reduce_scatter_ring = {"ring", nullptr, run};

}  // namespace commux::coll::detail::algo
