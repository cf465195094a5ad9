// The requests and scratch memory of one collective call.
//
// Every send and receive a collective posts goes through an Exchange, which
//   * posts it as internal traffic with the collective's tag (post errors are rewrapped),
//   * waits for it with the time left until the collective's deadline,
//   * rewraps any commux::Error as "commux <op_name>: ..." with the same code,
//   * on any failure (and in its destructor) cancels every request still outstanding and waits
//     for them with a short bound, so nothing writes into the caller's buffers or the scratch
//     after the collective returns or throws. A request that does not finish even then is parked,
//     with the scratch memory, in a process-wide list that is emptied once they complete.
//
// No UCX here: only the internal channel (src/core/channel.hpp) and Request.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <memory_resource>
#include <string>
#include <vector>

#include "commux/collectives.hpp"

namespace commux::detail {
class Channel;
}  // namespace commux::detail

namespace commux::coll::detail {

using Clock = std::chrono::steady_clock;

// What identifies a collective call across ranks (everything here must be equal on every rank):
// its fingerprint goes into every message's tag, and errors describe the call from it.
struct CallId {
  int coll = 0;             // detail::Coll
  int algo_index = 0;       // in the collective's table
  const char* algo = "";    // the algorithm's name
  std::size_t count = 0;    // elements (reductions)
  int dtype = -1;           // DataType, or -1
  int op = -1;              // ReduceOp, or -1
  int root = -1;            // the root, or -1
  std::size_t bytes = 0;    // bytes (broadcast; gather/scatter per rank; equal allgather parts)
  std::uint64_t extra = 0;  // a hash of per-rank counts or offsets
  bool uneven = false;      // allgatherv parts of different sizes
  bool device_pipeline = false;  // a reduction of > 1 MiB in device memory (internal.hpp)
};

class Exchange {
 public:
  // Validates ctx (a communicator is required) and resolves the deadline: a deadline of
  // time_point::max() means the communicator's default timeout from now.
  explicit Exchange(const Context& ctx);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  MemoryType mem() const { return ctx_.mem; }
  // Where the collective works: scratch and staged user data live in this memory, and reductions
  // run there. The user's memory when Context::device is set, else host memory.
  MemoryType work_mem() const { return ctx_.device != nullptr ? ctx_.mem : MemoryType::kHost; }
  const char* op() const { return ctx_.op_name; }

  const Context& context() const { return ctx_; }

  // Names the algorithm step in error messages ("ring reduce-scatter"), until the next call.
  void phase(const char* what) { phase_ = what; }

  // Identifies the call (detail::choose does, once the algorithm is known, before anything is
  // posted): its messages then carry the call's fingerprint, and waits look for messages and
  // notices of a different call.
  void identify(const CallId& id);
  // "allreduce #7 (1000 float32 SUM, ring)"
  std::string describe_call() const;

  // Posts a message; returns an id for wait()/bytes(). `mem` is the memory type of `data`.
  std::size_t send(const void* data, std::size_t bytes, int peer, MemoryType mem);
  std::size_t recv(void* data, std::size_t bytes, int peer, MemoryType mem);
  // Convenience: user memory (ctx.mem) and host scratch.
  std::size_t send_user(const void* d, std::size_t b, int peer) {
    return send(d, b, peer, ctx_.mem);
  }
  std::size_t recv_user(void* d, std::size_t b, int peer) { return recv(d, b, peer, ctx_.mem); }
  std::size_t send_host(const void* d, std::size_t b, int peer) {
    return send(d, b, peer, MemoryType::kHost);
  }
  std::size_t recv_host(void* d, std::size_t b, int peer) {
    return recv(d, b, peer, MemoryType::kHost);
  }
  // Work memory: scratch() and staged buffers (WorkStage).
  std::size_t send_work(const void* d, std::size_t b, int peer) {
    return send(d, b, peer, work_mem());
  }
  std::size_t recv_work(void* d, std::size_t b, int peer) { return recv(d, b, peer, work_mem()); }

  void wait(std::size_t id);
  void wait_all();  // every request posted so far
  // Bytes a completed receive got (call after wait(id)).
  std::size_t bytes(std::size_t id) const;

  // Scratch in work memory that lives as long as this Exchange (or longer if a request is
  // parked). Host buffers come from a small process-wide cache, so that repeated large collectives do
  // not pay page faults on fresh memory every time; they go back to it when the Exchange ends
  // cleanly. Device buffers come from Context::device.
  char* scratch(std::size_t bytes);

  // out[i] = a[i] OP b[i] in work memory: the host kernels, or Context::device's.
  void reduce(void* out, const void* a, const void* b, std::size_t count, DataType t, ReduceOp op);

  // Copies `bytes` between two buffers of possibly different memory types: memcpy/memmove for
  // host memory, Context::device's copy where it is set, else a message to this rank itself (UCX
  // moves device memory).
  void copy(void* dst, MemoryType dst_mem, const void* src, MemoryType src_mem, std::size_t bytes);

  // Cancels what is outstanding and throws Error(code, "commux <op>: " + what).
  [[noreturn]] void fail(Errc code, const std::string& what);

  // Throws Error(kInvalidArgument, "commux <op>: " + what) before anything was posted.
  [[noreturn]] static void invalid(const Context& ctx, const std::string& what);

 private:
  // Cross-rank call checks while waiting for request `id` (calls.cpp): throws kCallMismatch on a
  // notice of this call from another rank, or on a message of a different call from the peer of
  // `id`.
  void check_calls(std::size_t id);
  [[noreturn]] void mismatch(int peer);
  // wait(id) inside Schedule `s`: suspends it until request `id` finishes or the deadline passes,
  // with the cross-rank checks and Context::poll as a blocking wait makes them.
  void suspend_for(Schedule::Impl* s, std::size_t id);
  // Context::poll; tells the other ranks if it throws (and rethrows).
  void poll_caller();
  [[noreturn]] void noticed(int peer, const std::string& notice);
  // Sends this rank's notice about the call (once) to every other rank.
  void notify(char kind, const std::string& reason);
  std::chrono::milliseconds remaining(Clock::time_point now = Clock::now());
  // The call's deadline: Context::deadline, or the communicator's timeout from the first call
  // of this with a `now` (the first wait that has to wait, or a check before it).
  Clock::time_point deadline(Clock::time_point now);
  // The first time a wait had to wait (the clock is read then anyway): "Timed out after N ms"
  // counts from there, where the core's wait would name only the length of its last slice.
  void began_waiting(Clock::time_point now) noexcept {
    if (waiting_since_ == Clock::time_point{}) waiting_since_ = now;
  }
  [[noreturn]] void rethrow(const Error& e);
  void abort() noexcept;
  std::string cleanup_note() const;
  void room_for_scratch();

  Context ctx_;
  std::string call_text_;  // ctx_.call_text points here
  ::commux::detail::Channel* chan_ = nullptr;
  CallId id_;
  std::uint32_t wire_ = 0;  // the user field of this call's tags
  bool notified_ = false;
  // A wait may have kept other transfers in flight to this thread: the call's end hands them
  // back (Channel::hand_back()).
  bool handed_ = false;
  // A host reduction this long hands the transfers in flight back first (reduce()).
  static constexpr std::size_t kLongReduceBytes = std::size_t{4} << 20;
  int rank_;
  int size_;
  Clock::time_point deadline_ = Clock::time_point::max();  // max: not yet set (deadline())
  Clock::time_point waiting_since_{};                      // began_waiting()
  const char* phase_ = nullptr;
  // Every request posted, and whether it was waited for successfully (its outcome has been seen).
  // (A message moved inside its call, Channel::send_now or recv_now, has no request: it is
  // waited for, and `moved` says its bytes.)
  struct Posted {
    Request req;
    bool waited = false;
    std::size_t moved = 0;
  };
  // Lists a message send() or recv() moved inside its call; returns its id.
  std::size_t done_inside_call(std::size_t bytes);
  struct Scratch {
    std::unique_ptr<char[]> data;  // host scratch (from the pool)
    std::size_t size = 0;
    void* device = nullptr;  // or device scratch (Context::device)
  };
  // Both lists live in room inside the Exchange: the first kInlineRequests requests and
  // kInlineScratch scratch entries need no allocation (a small collective's whole bookkeeping);
  // a call that needs more takes the rest from the heap. (Slack: the arena aligns each block.)
  static constexpr std::size_t kInlineRequests = 8;
  static constexpr std::size_t kInlineScratch = 4;  // room_for_scratch()'s first reservation
  alignas(std::max_align_t) unsigned char room_[kInlineRequests * sizeof(Posted) +
                                                kInlineScratch * sizeof(Scratch) +
                                                2 * alignof(std::max_align_t)];
  std::pmr::monotonic_buffer_resource arena_{room_, sizeof(room_)};
  std::pmr::vector<Posted> reqs_{&arena_};
  std::pmr::vector<Scratch> scratch_{&arena_};
  std::size_t first_open_ = 0;  // every request before this index has been waited for
  std::size_t stuck_ = 0;       // requests abort() had to park
};

// Keeps a request that may still be in flight, with the memory it uses, until it completes
// (checked whenever a collective starts): for sends nobody waits for, such as notices.
void park(Request request, std::unique_ptr<char[]> data);

// Work-memory view of a user buffer for the reductions: the buffer itself when it already is in
// work memory (host buffers; device buffers with Context::device), else a host copy (staged in at
// construction when `load`, written back by store()).
class WorkStage {
 public:
  WorkStage(Exchange& ex, void* user, std::size_t bytes, bool load);
  char* data() const { return host_; }
  void store();  // copies the host view back to the user buffer (no-op for host memory)

 private:
  Exchange& ex_;
  void* user_;
  std::size_t bytes_;
  char* host_;
};

}  // namespace commux::coll::detail
