// Pieces shared by several collectives (internal to src/collectives).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>

#include "exchange.hpp"

namespace commux::coll::detail {

// Broadcast switches from the binomial tree to scatter + ring allgather at this size (and 3+ ranks).
inline constexpr std::size_t kBroadcastScatterBytes = std::size_t{512} << 10;
// Allreduce uses recursive doubling below this many bytes (or with fewer elements than ranks),
// the halves exchange (2 ranks) or ring reduce-scatter + allgather at and above it.
inline constexpr std::size_t kAllreduceSmallBytes = std::size_t{64} << 10;
// With 4, 8, .. ranks allreduce uses Rabenseifner below this many bytes, the ring at and above it.
inline constexpr std::size_t kAllreduceRabenseifnerBytes = std::size_t{1} << 20;
// Allgather of equal parts: recursive doubling (power-of-two ranks) or Bruck (others) below this
// many bytes in all (n * part), the ring at and above it.
inline constexpr std::size_t kAllgatherSmallBytes = std::size_t{64} << 10;
// Reduce-scatter: recursive halving below this many bytes in all (power-of-two ranks), else ring.
inline constexpr std::size_t kReduceScatterSmallBytes = std::size_t{64} << 10;
// Gather / scatter: binomial tree below this many bytes per rank (3+ ranks), else linear.
inline constexpr std::size_t kGatherBinomialBytes = std::size_t{16} << 10;
// Linear gather / scatter and pairwise alltoall keep at most this many peers' messages in flight.
inline constexpr int kMaxInFlight = 4;

// Steps 1 .. n-1 with at most kMaxInFlight of them posted ahead: post(i) for the first ones, then
// local() (the rank's own part, overlapping them), then finish(i) for each step in order, each
// followed by the post of the next step not yet posted.
template <class Post, class Local, class Finish>
void windowed_steps(int n, Post post, Local local, Finish finish) {
  int posted = 0;
  for (int i = 1; i < n && i <= kMaxInFlight; ++i) post(posted = i);
  local();
  for (int i = 1; i < n; ++i) {
    finish(i);
    if (posted + 1 < n) post(++posted);
  }
}

// Large messages are cut into chunks where an algorithm pipelines (the 2-rank halves exchange,
// ring, recursive halving, reduce): the next chunk travels while the previous one is reduced, and
// scratch memory stays small. In host memory about 1 MiB, so that a chunk stays in cache. In
// device memory (Exchange::work_mem() not kHost: the reductions run on the device) about 16 MiB:
// each device message (a UCX cuda_ipc rendezvous) and each device reduction (a kernel and a
// stream synchronization) has a cost of its own whatever its size, and with 1 MiB chunks a
// 64 MiB float32 all_reduce of 2 ranks on one H200 took 12.1 ms, against 1.6 ms with 16 MiB
// chunks in the same run (docs/gpu.md). Since the chunks of a range are its messages, ranks must
// cut alike: a reduction of more than kPipelineChunkBytes carries the memory class in its call
// fingerprint (CallId::device_pipeline), so ranks that differ fail loudly instead of
// mismatching their messages.
inline constexpr std::size_t kPipelineChunkBytes = std::size_t{1} << 20;
inline constexpr std::size_t kDevicePipelineChunkBytes = std::size_t{16} << 20;

// Number of pipeline chunks for `bytes` (at least 1) reduced in memory of type `work_mem`.
inline int pipeline_chunks(std::size_t bytes, MemoryType work_mem) {
  const std::size_t chunk =
      work_mem == MemoryType::kHost ? kPipelineChunkBytes : kDevicePipelineChunkBytes;
  return static_cast<int>(std::max<std::size_t>(1, (bytes + chunk - 1) / chunk));
}

// Ring allgather over one buffer: rank r already holds bytes [displs[r], displs[r] + counts[r])
// of `base` and ends with every rank's part (counts and displacements in bytes). Receives are
// checked against counts. `mem` is the memory type of `base`.
void ring_allgather(Exchange& ex, char* base, const std::size_t* counts, const std::size_t* displs,
                    MemoryType mem);

// "peer 3 sent 12 bytes but 16 were expected (counts disagree between ranks)"
std::string size_mismatch(int peer, std::size_t got, std::size_t expected, const char* what);

inline void check_root(const Context& ctx, int root, int size) {
  if (root < 0 || root >= size) {
    Exchange::invalid(ctx, "root " + std::to_string(root) + " is outside 0.." +
                               std::to_string(size - 1));
  }
}

inline void check_ptr(const Context& ctx, const void* p, std::size_t bytes, const char* name) {
  if (p == nullptr && bytes > 0) {
    Exchange::invalid(ctx, std::string(name) + " is null but " + std::to_string(bytes) +
                               " bytes were asked for");
  }
}

// a * b and a + b as sizes, or an invalid-argument error where the result does not fit a size_t:
// a count near SIZE_MAX / 4 of float32 once made a buffer of a few bytes, and the algorithms,
// which use the count, ran past it. `what` names the quantity ("count x element size").
inline std::size_t checked_mul(const Context& ctx, std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    Exchange::invalid(ctx, std::string(what) + " (" + std::to_string(a) + " x " +
                               std::to_string(b) + ") overflows a size_t");
  }
  return r;
}
inline std::size_t checked_add(const Context& ctx, std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) {
    Exchange::invalid(ctx, std::string(what) + " (" + std::to_string(a) + " + " +
                               std::to_string(b) + ") overflows a size_t");
  }
  return r;
}

}  // namespace commux::coll::detail
