// Allgather, Bruck: ceil(log2 n) steps for any world size. A host temporary holds the blocks in
// rotated order (slot i = block (r + i) mod n, the rank's own in slot 0); at distance d = 2^k the
// rank sends its first min(d, n - d) slots to r - d and receives as many into slot d from r + d
// (pattern::bruck). A final rotation copies the slots into the output. Declines unequal or
// non-contiguous parts (allgatherv). The selector's choice for small totals on world sizes that
// are not powers of two.
#include "../algo.hpp"
#include "../patterns.hpp"

namespace commux::coll::detail::algo {

namespace {

bool accepts(int, const AllgatherArgs& a) { return a.uniform; }

void run(Exchange& ex, const AllgatherArgs& a) {
  const int n = ex.size(), r = ex.rank();
  const std::size_t bytes = a.counts[0];
  const auto nn = static_cast<std::size_t>(n), ru = static_cast<std::size_t>(r);
  char* tmp = ex.scratch(nn * bytes);
  ex.phase("local copy");
  ex.copy(tmp, ex.work_mem(), a.in, ex.mem(), bytes);
  ex.phase("bruck");
  for (const auto& st : pattern::bruck(r, n)) {
    const std::size_t len = static_cast<std::size_t>(st.blocks) * bytes;
    const std::size_t id =
        ex.recv_work(tmp + static_cast<std::size_t>(st.recv_at) * bytes, len, st.recv_from);
    const std::size_t s = ex.send_work(tmp, len, st.send_to);
    ex.wait(id);
    expect_bytes(ex, id, st.recv_from, len, "(bruck)");
    ex.wait(s);
  }
  ex.phase("rotation");
  // Slot i holds block (r + i) mod n: slots [0, n - r) go to blocks [r, n), the rest to [0, r).
  ex.copy(a.out + ru * bytes, ex.mem(), tmp, ex.work_mem(), (nn - ru) * bytes);
  ex.copy(a.out, ex.mem(), tmp + (nn - ru) * bytes, ex.work_mem(), ru * bytes);
}

}  // namespace

const Algorithm<AllgatherArgs> allgather_bruck = {"bruck", accepts, run};

}  // namespace commux::coll::detail::algo
