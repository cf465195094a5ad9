// An in-process world of n ranks over detail::Channel (src/core/channel.hpp), without UCX: the
// real collective code (and anything written against the public Communicator) runs on threads of
// one process, one thread per rank.
//
// Matching is UCX tag matching: a message matches the first receive its receiver posted (in
// posting order) whose (source or kAnySource, tag kind, tag) accept it; a receive posted later
// takes the earliest queued message that it accepts (messages of one (sender, receiver, kind,
// tag) therefore match in posting order). A message longer than its receive fails the receive
// with Errc::kTruncated naming peer, tag and both sizes; zero bytes are fine; several buffers are
// gathered on the send side and scattered on the receive side.
//
// Modes:
//   kEager       a send completes at once (its data is copied when posted);
//   kRendezvous  a send completes only when its receive is posted and the data copied (the worst
//                case for deadlock: nothing is buffered anywhere).
//
// Deadlock detection: when every live rank (a rank is live from the construction of the world
// until leave(rank)) is blocked in a wait and no wait can finish (matching is done when an
// operation is posted, so nothing further can change), every waiter's wait throws
// Error(kTimeout, "... deadlock: ...") naming, for each rank, what it waits for (peer, tag, bytes).
// Waits still respect their timeout. A waiter in await() (the collectives' waits, which probe for
// a different call between slices) is first woken, once per state of the world, to probe; a
// deadlock is declared only when every rank blocks again with nothing posted or finished since.
// probe() and discard() see the sends queued for a rank. cancel() finishes an unmatched operation
// with kCanceled.
//
// Every rank records a trace of what it posts and waits for (trace(rank)); unmatched() lists what
// is still posted, for the check that a collective left nothing behind.
//
// Thread-safety: one mutex for the whole world; every method may be called from any thread.
// Ownership: the world owns every operation's state; a posted operation keeps pointers to the
// caller's buffers until it finishes (the caller keeps them alive, as with UCX).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "channel.hpp"
#include "commux/communicator.hpp"

namespace commux::test {

enum class LoopMode { kEager, kRendezvous };

struct TraceEvent {
  enum class Kind { kPost, kWait } what;
  detail::Direction dir;
  int peer;  // as posted (kAnySource possible)
  TagKind kind;
  std::uint32_t tag;
  std::size_t bytes;  // posted size
};

class LoopbackWorld {
 public:
  LoopbackWorld(int n, LoopMode mode, Options options = default_options());
  ~LoopbackWorld();
  LoopbackWorld(const LoopbackWorld&) = delete;
  LoopbackWorld& operator=(const LoopbackWorld&) = delete;

  static Options default_options();  // a 30 s wait timeout

  int size() const noexcept { return n_; }
  LoopMode mode() const noexcept { return mode_; }
  // The channel of `rank`, and a public Communicator over it.
  std::shared_ptr<detail::Channel> channel(int rank);
  std::unique_ptr<Communicator> communicator(int rank);
  // `rank` no longer takes part (its thread is done): deadlock detection stops counting on it.
  void leave(int rank);

  // What is still posted and unfinished, one line per operation ("" when nothing is).
  std::string unmatched() const;
  std::vector<TraceEvent> trace(int rank) const;
  // How many deadlocks were reported so far.
  int deadlocks() const;

  // Runs body(comm) on one thread per rank, each with communicator(rank), and leave(rank) when it
  // is done; joins (bounded by `limit`) and returns each rank's failure message ("" if none).
  std::vector<std::string> run(const std::function<void(Communicator&)>& body,
                               std::chrono::seconds limit = std::chrono::seconds(120));

  struct Op;  // one posted operation (loopback_channel.cpp)

 private:
  class Chan;
  friend class Chan;
  struct OpState;
  friend struct OpState;
  void post_locked(const std::shared_ptr<Op>& op);
  void deliver_locked(Op& send, Op& recv);
  void finish_locked(Op& op, std::exception_ptr error);
  void wait(Op& op, std::chrono::milliseconds timeout);
  bool await(Op& op, std::chrono::milliseconds timeout);
  bool block(Op& op, std::chrono::milliseconds timeout, bool probing);
  void cancel(Op& op);
  void check_deadlock_locked();
  static std::string describe(const Op& op);

  const int n_;
  const LoopMode mode_;
  const Options options_;
  RuntimeInfo info_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Chan>> chans_;
  std::vector<bool> live_;
  std::vector<Op*> blocked_;  // per rank: the operation its thread waits for, or nullptr
  std::vector<std::vector<std::shared_ptr<Op>>> queued_;  // per receiver: unmatched sends
  std::vector<std::vector<std::shared_ptr<Op>>> posted_;  // per receiver: unmatched receives
  std::vector<std::vector<TraceEvent>> trace_;
  std::vector<std::string> left_at_shutdown_;  // operations shutdown() had to cancel
  int deadlocks_ = 0;
  std::uint64_t epoch_ = 0;        // bumped by every post and completion
  std::uint64_t probe_epoch_ = 0;  // the epoch at which probing waiters were last woken
};

}  // namespace commux::test
