// Reduce to a root, binomial tree pipelined in chunks of ~kPipelineChunkBytes. Each rank receives
// its children's partial results, smallest subtree first (it is ready first), reduces them into its
// buffer (its own data on the left) and sends the result to its parent chunk by chunk, while the
// children's next chunk arrives in the other half of the scratch. A non-root's buffer is only read:
// an inner node accumulates its subtree's chunks in scratch (two chunk buffers, so one is sent
// while the next is reduced), a leaf sends its buffer as it is.
#include <algorithm>

#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

void run(Exchange& ex, const ReduceArgs& a) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t es = dtype_size(a.t), count = a.count;
  char* mine = a.buf;
  const pattern::Tree tree = pattern::binomial_tree(r, n, a.root);
  ex.phase("binomial tree");
  const int k = pipeline_chunks(count * es, ex.work_mem());
  const pattern::Blocks ch{count, k};
  const auto at = [&](int c) { return mine + ch.offset(c) * es; };
  // (Arrays on the stack: a small reduce should not allocate for its bookkeeping.)
  constexpr int kMaxKids = pattern::Children::kMax;
  int kids[kMaxKids];
  const std::size_t nk = tree.children.size();
  std::copy(tree.children.rbegin(), tree.children.rend(), kids);
  // (Not zeroed: clearing 62 entries per call showed in an 8-byte reduce's profile.)
  char* slot[2 * kMaxKids];  // slot[(c % 2) * nk + i]: chunk c of kid i
  for (std::size_t i = 0; i < 2 * nk; ++i) {
    slot[i] = i < nk || k > 1 ? ex.scratch(ch.max() * es) : nullptr;
  }
  std::size_t rid[2 * kMaxKids];  // written by post() before any read
  const auto post = [&](int c, std::size_t i) {
    const std::size_t s = static_cast<std::size_t>(c % 2) * nk + i;
    rid[s] = ex.recv_work(slot[s], ch.size(c) * es, kids[i]);
  };
  // Where chunk c's partial result goes: the root's own buffer (its output), else scratch.
  const bool inner = tree.parent >= 0 && nk > 0;
  char* acc[2] = {inner ? ex.scratch(ch.max() * es) : nullptr,
                  inner && k > 1 ? ex.scratch(ch.max() * es) : nullptr};
  std::size_t acc_send[2] = {0, 0};
  bool acc_busy[2] = {false, false};
  for (int c = 0; c < std::min(2, k); ++c) {
    for (std::size_t i = 0; i < nk; ++i) post(c, i);
  }
  for (int c = 0; c < k; ++c) {
    char* out = at(c);
    if (inner) {
      if (acc_busy[c % 2]) ex.wait(acc_send[c % 2]);  // chunk c-2 has left this buffer
      out = acc[c % 2];
    }
    for (std::size_t i = 0; i < nk; ++i) {
      const std::size_t s = static_cast<std::size_t>(c % 2) * nk + i;
      ex.wait(rid[s]);
      expect_bytes(ex, rid[s], kids[i], ch.size(c) * es, nullptr);
      // out = (what this rank has so far) OP (the kid's subtree): own data stays on the left.
      ex.reduce(out, i == 0 ? at(c) : out, slot[s], ch.size(c), a.t, a.op);
      if (c + 2 < k) post(c + 2, i);
    }
    if (tree.parent >= 0) {
      const std::size_t id = ex.send_work(out, ch.size(c) * es, tree.parent);
      if (inner) {
        acc_send[c % 2] = id;
        acc_busy[c % 2] = true;
      }
    }
  }
  ex.wait_all();
}

}  // namespace

// The tree only reads a non-root rank's buffer: it receives children's partials into scratch.
const Algorithm<ReduceArgs> reduce_binomial = {"binomial", nullptr, run,
                                               /*keeps_nonroot_buffer=*/true};

}  // namespace commux::coll::detail::algo
