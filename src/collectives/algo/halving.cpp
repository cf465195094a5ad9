// Pieces shared by the Rabenseifner-style algorithms (allreduce, reduce, reduce_scatter):
// recursive halving reduce-scatter and recursive doubling allgather among the power-of-two ranks
// left after the fold (patterns.hpp), and the size check of a receive.
#include <algorithm>
#include <string>
#include <vector>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail {

void fold_in(Exchange& ex, char* buf, std::size_t count, DataType t, ReduceOp op, int partner) {
  const std::size_t bytes = count * dtype_size(t);
  char* tmp = ex.scratch(bytes);
  recv_exact(ex, tmp, bytes, partner, ex.work_mem());
  ex.reduce(buf, tmp, buf, count, t, op);
}

void expect_bytes(Exchange& ex, std::size_t id, int peer, std::size_t expected, const char* what) {
  if (ex.bytes(id) != expected) {
    ex.fail(Errc::kCallMismatch, size_mismatch(peer, ex.bytes(id), expected, what));
  }
}

void recv_exact(Exchange& ex, void* buf, std::size_t bytes, int peer, MemoryType mem) {
  const std::size_t id = ex.recv(buf, bytes, peer, mem);
  ex.wait(id);
  expect_bytes(ex, id, peer, bytes, nullptr);
}

std::pair<std::size_t, std::size_t> halving_first_keep(const std::size_t* off, int q, int n) {
  const int p = pattern::pow2_floor(n);
  const auto steps = pattern::recursive_halving(q, p);
  if (steps.empty()) return {off[0], off[p]};
  return {off[steps[0].keep_lo], off[steps[0].keep_hi]};
}

void recursive_halving(Exchange& ex, const HalvingIo& io, const std::size_t* off, int q, int n,
                       DataType t, ReduceOp op) {
  const int p = pattern::pow2_floor(n);
  const int me = pattern::fold_real(q, n);
  const std::size_t es = dtype_size(t);
  const auto steps = pattern::recursive_halving(q, p);
  // Receives go to a few rotating chunk-sized slots, posted as the previous ones are reduced.
  std::size_t max_chunk = 0;
  for (const auto& st : steps) {
    const std::size_t kn = off[st.keep_hi] - off[st.keep_lo];
    max_chunk =
        std::max(max_chunk, pattern::Blocks{kn, pipeline_chunks(kn * es, ex.work_mem())}.max());
  }
  constexpr std::size_t kSlots = 3;
  char* slot[kSlots] = {ex.scratch(max_chunk * es), ex.scratch(max_chunk * es),
                        ex.scratch(max_chunk * es)};
  auto acc = [&](std::size_t e) { return io.acc + (e - io.acc_first) * es; };
  ex.phase("recursive halving");
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const auto& st = steps[k];
    const int peer = pattern::fold_real(st.partner, n);
    const bool last = k + 1 == steps.size();
    // Both sides cut a range into chunks the same way: by the range's own size.
    const std::size_t klo = off[st.keep_lo], kn = off[st.keep_hi] - klo;
    const std::size_t slo = off[st.send_lo], sn = off[st.send_hi] - slo;
    const pattern::Blocks kc{kn, pipeline_chunks(kn * es, ex.work_mem())},
        sc{sn, pipeline_chunks(sn * es, ex.work_mem())};
    const auto nk = static_cast<std::size_t>(kc.n);
    std::vector<std::size_t> rids(nk);
    auto post = [&](std::size_t j) {
      rids[j] = ex.recv_work(slot[j % kSlots], kc.size(static_cast<int>(j)) * es, peer);
    };
    for (std::size_t j = 0; j < std::min(kSlots, nk); ++j) post(j);
    const char* from = k == 0 ? io.src + slo * es : acc(slo);
    for (int j = 0; j < sc.n; ++j) ex.send_work(from + sc.offset(j) * es, sc.size(j) * es, peer);
    for (std::size_t j = 0; j < nk; ++j) {
      const int jj = static_cast<int>(j);
      ex.wait(rids[j]);
      expect_bytes(ex, rids[j], peer, kc.size(jj) * es, "(recursive halving)");
      const std::size_t e = klo + kc.offset(jj);
      const char* mine = k == 0 ? io.src + e * es : acc(e);
      char* dst = last && io.last != nullptr ? io.last + kc.offset(jj) * es : acc(e);
      const char* theirs = slot[j % kSlots];
      if (peer < me) {
        ex.reduce(dst, theirs, mine, kc.size(jj), t, op);
      } else {
        ex.reduce(dst, mine, theirs, kc.size(jj), t, op);
      }
      if (j + kSlots < nk) post(j + kSlots);
    }
    // Sends read ranges that are not written again during the halving; waited for below.
  }
  if (steps.empty() && io.last != nullptr) {
    ex.copy(io.last, ex.work_mem(), io.src + off[q] * es, ex.work_mem(),
            (off[q + 1] - off[q]) * es);
  }
  ex.wait_all();
}

void doubling_allgather(Exchange& ex, char* base, const std::size_t* boff, int q, int n,
                        MemoryType mem) {
  const int p = pattern::pow2_floor(n);
  ex.phase("recursive doubling allgather");
  for (const auto& st : pattern::recursive_doubling_allgather(q, p)) {
    const int peer = pattern::fold_real(st.partner, n);
    const std::size_t rbytes = boff[st.recv_hi] - boff[st.recv_lo];
    const std::size_t id = ex.recv(base + boff[st.recv_lo], rbytes, peer, mem);
    const std::size_t s =
        ex.send(base + boff[st.send_lo], boff[st.send_hi] - boff[st.send_lo], peer, mem);
    ex.wait(id);
    expect_bytes(ex, id, peer, rbytes, "(recursive doubling allgather)");
    ex.wait(s);
  }
}

}  // namespace commux::coll::detail
