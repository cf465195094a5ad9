// The algorithms of every collective, each in its own translation unit under algo/, and the
// pieces that choose between them (select.cpp). Internal to src/collectives.
//
// An algorithm has a name, may decline a call it cannot handle (accepts() returns false: e.g.
// recursive doubling allgather on a world size that is not a power of two) and runs on an
// Exchange with the call's arguments, already validated by the collective's entry point (which
// also stages device buffers through host memory where the algorithm reduces). accepts() may only
// look at what is equal on every rank (world size, counts, root), so every rank picks the same.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../core/log.hpp"
#include "internal.hpp"

namespace commux::coll::detail {

// ---- the collectives and their arguments -------------------------------------------------------

enum class Coll : int {
  kAllreduce,
  kBroadcast,
  kReduce,
  kAllgather,
  kReduceScatter,
  kAlltoall,
  kBarrier,
  kGather,
  kScatter,
  kCount
};
const char* coll_name(Coll c);  // "allreduce", "reduce_scatter", ...

// In place on host memory (staged by the entry point).
struct AllreduceArgs {
  char* buf;
  std::size_t count;  // > 0
  DataType t;
  ReduceOp op;
};

// User memory (ctx.mem).
struct BroadcastArgs {
  char* buf;
  std::size_t bytes;
  int root;
};

// Host memory; the root's buf ends as the reduction, other ranks' are scratch.
struct ReduceArgs {
  char* buf;
  std::size_t count;  // > 0
  DataType t;
  ReduceOp op;
  int root;
};

// User memory. `in` may alias out + displs[rank]. uniform: every count equal to counts[0] and
// displs[p] == p * counts[0] (a plain allgather).
struct AllgatherArgs {
  const char* in;
  char* out;
  const std::size_t* counts;
  const std::size_t* displs;
  bool uniform;
};

// Host memory. Block p is elements [off[p], off[p + 1]) of `in` (n + 1 offsets); `out` (counts of
// the rank's block) may alias its own block of `in`. `in` is only read.
struct ReduceScatterArgs {
  const char* in;
  char* out;
  const std::size_t* off;
  DataType t;
  ReduceOp op;
};

// User memory, counts and displacements in bytes.
struct AlltoallArgs {
  const char* in;
  const std::size_t* send_counts;
  const std::size_t* send_displs;
  char* out;
  const std::size_t* recv_counts;
  const std::size_t* recv_displs;
};

struct BarrierArgs {};

// Gather (in: bytes on every rank, out: n * bytes on the root) and scatter (in: n * bytes on the
// root, out: bytes on every rank); user memory.
struct RootedArgs {
  const char* in;
  char* out;
  std::size_t bytes;
  int root;
};

template <class A>
struct Algorithm {
  const char* name;
  bool (*accepts)(int n, const A& a);  // nullptr: accepts everything
  void (*run)(Exchange& ex, const A& a);
  // Rooted reductions (ReduceArgs): true when run() only reads the buffer of a rank other than
  // the root. Otherwise the entry point hands such a rank a scratch copy, since the caller's
  // non-root buffer is input only (reduce.cpp).
  bool keeps_nonroot_buffer = false;
};

template <class A>
struct Table {
  Coll coll;
  const Algorithm<A>* const* list;
  std::size_t size;
};

const Table<AllreduceArgs>& allreduce_table();
const Table<BroadcastArgs>& broadcast_table();
const Table<ReduceArgs>& reduce_table();
const Table<AllgatherArgs>& allgather_table();
const Table<ReduceScatterArgs>& reduce_scatter_table();
const Table<AlltoallArgs>& alltoall_table();
const Table<BarrierArgs>& barrier_table();
const Table<RootedArgs>& gather_table();
const Table<RootedArgs>& scatter_table();

// ---- choosing --------------------------------------------------------------------------------

// The forced algorithm name for this call (ctx.algorithm, else the process-wide choice), or "".
// `source` says where it came from, for error messages.
std::string forced_name(const Context& ctx, Coll c, const char** source);
void set_last_algorithm(const char* name) noexcept;
// The debug log's INFO line for a choice, written the first time this process runs collective `c`
// on `n` ranks with a message of `bytes`' size class (powers of two) and that algorithm; `why`
// says who chose it ("the selector", "COMMUX_ALGO_ALLREDUCE", ...).
void log_choice(const Context& ctx, Coll c, int n, std::size_t bytes, const char* name,
                const std::string& why);

// The bytes a call moves, as the size class of log_choice sees it (per rank, the whole message).
inline std::size_t call_bytes(int, const AllreduceArgs& a) { return a.count * dtype_size(a.t); }
inline std::size_t call_bytes(int, const BroadcastArgs& a) { return a.bytes; }
inline std::size_t call_bytes(int, const ReduceArgs& a) { return a.count * dtype_size(a.t); }
inline std::size_t call_bytes(int n, const AllgatherArgs& a) {
  std::size_t b = 0;
  for (int p = 0; p < n; ++p) b += a.counts[p];
  return b;
}
inline std::size_t call_bytes(int n, const ReduceScatterArgs& a) {
  return a.off[n] * dtype_size(a.t);
}
inline std::size_t call_bytes(int n, const AlltoallArgs& a) {
  std::size_t b = 0;
  for (int p = 0; p < n; ++p) b += a.send_counts[p];
  return b;
}
inline std::size_t call_bytes(int, const BarrierArgs&) { return 0; }
inline std::size_t call_bytes(int, const RootedArgs& a) { return a.bytes; }
[[noreturn]] void unknown_algorithm(const Context& ctx, Coll c, const char* name,
                                    const char* source);

// The algorithm to run: the forced one if it exists and accepts the call, else the selector's
// choice `preferred` (which must accept), else the first that accepts. Unknown forced names throw
// before anything is posted. Records the choice for last_algorithm() and identifies the call to
// `ex` (Exchange::identify), so the algorithm is part of its fingerprint.
// What of a call must agree on every rank (algo_index and algo filled in by choose).
inline CallId call_id(const AllreduceArgs& a, int) {
  CallId c;
  c.count = a.count;
  c.dtype = static_cast<int>(a.t);
  c.op = static_cast<int>(a.op);
  return c;
}
inline CallId call_id(const BroadcastArgs& a, int) {
  CallId c;
  c.bytes = a.bytes;
  c.root = a.root;
  return c;
}
inline CallId call_id(const ReduceArgs& a, int) {
  CallId c;
  c.count = a.count;
  c.dtype = static_cast<int>(a.t);
  c.op = static_cast<int>(a.op);
  c.root = a.root;
  return c;
}
std::uint64_t hash_sizes(const std::size_t* v, std::size_t n) noexcept;  // (calls.cpp)
inline CallId call_id(const AllgatherArgs& a, int n) {
  CallId c;
  c.bytes = a.counts[0];
  if (!a.uniform) {
    c.uneven = true;
    c.extra = hash_sizes(a.counts, static_cast<std::size_t>(n));
  }
  return c;
}
inline CallId call_id(const ReduceScatterArgs& a, int n) {
  CallId c;
  c.count = a.off[n];
  c.dtype = static_cast<int>(a.t);
  c.op = static_cast<int>(a.op);
  c.extra = hash_sizes(a.off, static_cast<std::size_t>(n) + 1);
  return c;
}
inline CallId call_id(const AlltoallArgs&, int) { return CallId{}; }  // counts differ per rank
inline CallId call_id(const BarrierArgs&, int) { return CallId{}; }
inline CallId call_id(const RootedArgs& a, int) {
  CallId c;
  c.bytes = a.bytes;
  c.root = a.root;
  return c;
}

template <class A>
const Algorithm<A>& choose(Exchange& ex, const Table<A>& tab, int n, const A& a,
                           const char* preferred) {
  const Context& ctx = ex.context();
  auto find = [&](const char* name) -> const Algorithm<A>* {
    for (std::size_t i = 0; i < tab.size; ++i) {
      if (std::strcmp(tab.list[i]->name, name) == 0) return tab.list[i];
    }
    return nullptr;
  };
  auto ok = [&](const Algorithm<A>* al) {
    return al != nullptr && (al->accepts == nullptr || al->accepts(n, a));
  };
  const char* source = nullptr;
  const Algorithm<A>* chosen = nullptr;
  const std::string forced = forced_name(ctx, tab.coll, &source);
  if (!forced.empty()) {
    const Algorithm<A>* al = find(forced.c_str());
    if (al == nullptr) unknown_algorithm(ctx, tab.coll, forced.c_str(), source);
    if (ok(al)) chosen = al;
  }
  if (chosen == nullptr && preferred != nullptr) {
    const Algorithm<A>* al = find(preferred);
    if (ok(al)) chosen = al;
  }
  for (std::size_t i = 0; chosen == nullptr && i < tab.size; ++i) {
    if (ok(tab.list[i])) chosen = tab.list[i];
  }
  set_last_algorithm(chosen->name);
  CallId id = call_id(a, n);
  id.coll = static_cast<int>(tab.coll);
  for (std::size_t i = 0; i < tab.size; ++i) {
    if (tab.list[i] == chosen) id.algo_index = static_cast<int>(i);
  }
  id.algo = chosen->name;
  // Where the chunks of a large reduction differ by memory class, so does the call (internal.hpp).
  const bool reduces =
      tab.coll == Coll::kAllreduce || tab.coll == Coll::kReduce || tab.coll == Coll::kReduceScatter;
  id.device_pipeline =
      reduces && ex.work_mem() != MemoryType::kHost && call_bytes(n, a) > kPipelineChunkBytes;
  ex.identify(id);
  if (log::enabled(log::Level::kInfo)) {
    const bool was_forced = !forced.empty() && forced == chosen->name;
    log_choice(ctx, tab.coll, n, call_bytes(n, a), chosen->name,
               was_forced       ? std::string(source)
               : forced.empty() ? std::string("the selector")
                                : "the selector (the forced " + forced + " declined this call)");
  }
  return *chosen;
}

// ---- the algorithms (one translation unit each under algo/) -------------------------------------

namespace algo {
extern const Algorithm<AllreduceArgs> allreduce_recursive_doubling, allreduce_halves,
    allreduce_ring, allreduce_rabenseifner;
extern const Algorithm<BroadcastArgs> broadcast_binomial, broadcast_scatter_allgather;
extern const Algorithm<ReduceArgs> reduce_binomial, reduce_rabenseifner;
extern const Algorithm<AllgatherArgs> allgather_ring, allgather_recursive_doubling, allgather_bruck;
extern const Algorithm<ReduceScatterArgs> reduce_scatter_ring, reduce_scatter_recursive_halving;
extern const Algorithm<AlltoallArgs> alltoall_pairwise, alltoall_linear;
extern const Algorithm<BarrierArgs> barrier_dissemination;
extern const Algorithm<RootedArgs> gather_binomial, gather_linear, scatter_binomial, scatter_linear;
}  // namespace algo

// ---- pieces shared by several algorithms (algo/halving.cpp) -----------------------------------

// Recursive halving reduce-scatter among the p = pow2_floor(n) ranks left after the fold, this
// rank being newrank q (real ranks by pattern::fold_real). Block b is elements [off[b], off[b+1])
// (p + 1 offsets). `src` holds this rank's contribution to every block (element e at
// src + e * es). Partial results accumulate in `acc`, element e at acc + (e - acc_first) * es
// (acc == src, acc_first == 0 for in place; else scratch covering at least the half kept at the
// first step). The final block q goes to `last` if not null (it may alias src's block q), else
// stays in acc. Each step's exchange is cut into pipeline chunks, reduced as they arrive; the
// lower real rank's data is the left operand. All sends are complete on return.
struct HalvingIo {
  const char* src;
  char* acc;
  std::size_t acc_first;
  char* last;
};
void recursive_halving(Exchange& ex, const HalvingIo& io, const std::size_t* off, int q, int n,
                       DataType t, ReduceOp op);
// The elements the accumulator needs: the range kept at the first step (for acc_first).
std::pair<std::size_t, std::size_t> halving_first_keep(const std::size_t* off, int q, int n);

// Recursive doubling allgather among the p = pow2_floor(n) ranks left after the fold, newrank q:
// block b is bytes [boff[b], boff[b+1]) of base (p + 1 offsets, memory type mem); the rank holds
// block q and ends with all. Received sizes are checked.
void doubling_allgather(Exchange& ex, char* base, const std::size_t* boff, int q, int n,
                        MemoryType mem);

// The fold of the ranks beyond the largest power of two (rabenseifner allreduce and reduce): a
// kFoldIn rank receives its partner's whole buffer (checked) and reduces it into `buf`, the
// partner (the lower rank) on the left.
void fold_in(Exchange& ex, char* buf, std::size_t count, DataType t, ReduceOp op, int partner);

// "for block 3" size check of a completed receive.
void expect_bytes(Exchange& ex, std::size_t id, int peer, std::size_t expected, const char* what);

// Receives exactly `bytes` from `peer` into `buf` (memory `mem`) and waits for it: a message of
// another size fails the collective naming the peer and both sizes.
void recv_exact(Exchange& ex, void* buf, std::size_t bytes, int peer, MemoryType mem);

}  // namespace commux::coll::detail
