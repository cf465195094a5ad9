// Private to src/core: the UCX context, worker and progress thread that the communicators of one
// process share (docs/progress.md, "One worker per process"), and the group ids that keep their
// messages apart on it.
//
// A Hub is created by the first Engine that needs one and released with the last (each Engine
// holds a shared_ptr). Engines share a Hub only when it was created with the same wakeup mode
// (the context's features depend on it) and the Engine's group id is not in use on it already:
// every message carries the group id (commux/tag.hpp), and receives match it, so two live Engines
// with one id on one worker would take each other's messages. join() agrees on the id with the
// other members through the store: each publishes the ids in use in its process, and all take
// the first id at or after the requested one (Options::group) that none has in use, so the id is
// free on every member's worker. A process whose Hubs all have the id (several ranks of one
// group in one process, as the threads-as-ranks tests run them) gets another Hub.
//
// Ownership: a Hub owns its Context and Worker (destroyed in that reverse order: worker, then
// context) and keeps forever the Ops that were still inside UCX when their Engine shut down (see
// keep_forever_locked). The registry of Hubs holds weak_ptrs only.
// Locks: ids_ is guarded by the registry's mutex (hub.cpp); the rest by the worker mutex.
#pragma once

#include <bitset>
#include <cstddef>
#include <memory>
#include <vector>

#include "commux/communicator.hpp"
#include "commux/store.hpp"
#include "commux/tag.hpp"
#include "context.hpp"
#include "worker.hpp"

namespace commux::detail {

class Hub {
 public:
  using Ids = std::bitset<tag_layout::kMaxGroups>;

  struct Placement {
    std::shared_ptr<Hub> hub;
    int group = 0;  // the id agreed with the other members, free on hub
  };
  // Agrees on a group id with the other `size` - 1 members through `store` (waiting up to
  // options.timeout for each) and places the communicator on a Hub where that id is free,
  // creating one if needed. The id stays reserved until release(). Throws commux::Error naming
  // the ranks when no id is free on every member (256 live communicators).
  static Placement join(Store& store, int rank, int size, const Options& options, bool wakeup);
  // Frees the id that join() reserved on this Hub.
  void release(int group);
  // Stops the progress thread and releases UCX (the atexit handler, once every Engine is shut
  // down, and the destructor). Idempotent.
  void shutdown();
  // What every Hub still alive does at process exit (after the Engines were shut down).
  static void shutdown_all();

  Hub(bool wakeup, std::size_t estimated_eps);  // creates context and worker, starts progress
  ~Hub();
  Hub(const Hub&) = delete;
  Hub& operator=(const Hub&) = delete;

  Worker& worker() noexcept { return worker_; }
  const RuntimeInfo& info() const noexcept { return info_; }
  bool wakeup() const noexcept { return wakeup_; }
  // An Op that UCX may still complete although its Engine has shut down (a rendezvous that
  // neither finished nor could be cancelled within the shutdown timeout): its memory must stay
  // valid for UCX's callback, so it is kept to the end of the process. [mu]
  void keep_forever_locked(std::shared_ptr<Op> op) { forever_.push_back(std::move(op)); }

 private:
  const bool wakeup_;
  RuntimeInfo info_;  // filled in the constructor, then read-only
  Context context_;
  Worker worker_;
  Ids ids_;                                   // [registry mutex] group ids of the Engines on it
  std::vector<std::shared_ptr<Op>> forever_;  // [mu]
};

}  // namespace commux::detail
