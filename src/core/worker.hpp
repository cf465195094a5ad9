// Private to src/core: the UCX worker, the lock that serialises it, the in-flight list, the
// progress thread and how a caller waits. The threading contract is docs/progress.md.
//
// Locks: the worker mutex (mutex()) serialises every ucp_* call on the worker (it is created
// UCS_THREAD_MODE_SERIALIZED) and guards every field marked [mu] in src/core -- here, in op.hpp,
// peers.hpp and engine.hpp. UCX callbacks run inside ucp_worker_progress with it held.
// Ownership: the Worker owns the ucp_worker (from create() to destroy_locked()), its wake fd (to
// its destructor) and the progress thread. The in-flight list does not own its Ops: each Op owns
// itself while listed (Op::self). The Worker belongs to one Engine and calls back into it for one
// progress step and the same-host peer check (Engine::progress_locked, check_local_peers).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "commux/communicator.hpp"
#include "op.hpp"

namespace commux::detail {

class Engine;

class Worker {
 public:
  explicit Worker(Engine& engine) noexcept : engine_(engine) {}
  ~Worker();  // closes the wake fd; the progress thread must have been stopped
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Creates the worker on `context`, its event fd when `wakeup` (fills info.event_fd) and the
  // wake fd. Throws commux::Error on failure.
  void create(ucp_context_h context, bool wakeup, RuntimeInfo& info);
  void destroy_locked() noexcept;  // no-op when there is none [mu]
  std::mutex& mutex() noexcept { return mu_; }
  ucp_worker_h handle() const noexcept { return worker_; }  // nullptr before create, after destroy
  // Set by Engine::shutdown() once UCX is released: nothing is progressed or posted after. [mu]
  bool shut_down_locked() const noexcept { return shut_down_; }
  void mark_shut_down_locked() noexcept { shut_down_ = true; }

  // The in-flight list. [mu]
  void register_locked(const std::shared_ptr<Op>& op) {
    op->self = op;
    op->next = inflight_;
    if (inflight_ != nullptr) inflight_->prev = op.get();
    inflight_ = op.get();
    inflight_count_.fetch_add(1);
  }
  // Removes `op` and hands back its self-reference (nullptr when it was not listed).
  std::shared_ptr<Op> unregister_locked(Op& op) {
    if (!op.self) return nullptr;
    if (op.prev != nullptr) op.prev->next = op.next;
    if (op.next != nullptr) op.next->prev = op.prev;
    if (inflight_ == &op) inflight_ = op.next;
    op.prev = op.next = nullptr;
    inflight_count_.fetch_sub(1);
    return std::move(op.self);
  }
  Op* inflight_locked() const noexcept { return inflight_; }  // the first; follow Op::next
  std::vector<std::shared_ptr<Op>> inflight_snapshot_locked() const;
  bool any_inflight() const noexcept { return inflight_count_.load() > 0; }  // no lock needed

  // The progress thread (docs/progress.md): started once bootstrap is done, stopped (and joined)
  // first thing in shutdown.
  void start_progress_thread();
  void stop_progress_thread();

  // Waits until `op` is done (or abandoned, see Op) or `timeout` passes (true: done or
  // abandoned): progresses once, spins for at
  // least `spin` (longer for large messages), then sleeps on the done condition while the
  // progress thread progresses. Call without the lock.
  bool wait(Op& op, std::chrono::milliseconds timeout, std::chrono::microseconds spin);
  // After setting an Op's done flag: wakes the threads sleeping in wait(), if any.
  void notify_done() {
    if (sleepers_.load() > 0) {
      {
        std::lock_guard<std::mutex> g(done_mu_);
      }
      done_cv_.notify_all();
    }
  }
  // Wakes the progress thread (no lock needed).
  void kick() noexcept;

 private:
  void progress_thread_main();
  // Sleeps until kick() (true), `timeout`, or `other_fd` (if >= 0) becomes readable.
  bool wait_for_kick(std::chrono::microseconds timeout, int other_fd);

  Engine& engine_;
  std::mutex mu_;
  ucp_worker_h worker_ = nullptr;  // set in create(), nullptr after destroy_locked() [mu]
  bool shut_down_ = false;         // [mu] set once shutdown() released UCX
  int efd_ = -1;                   // worker event fd, -1 if none; set in create(), then read-only
  // eventfd that wakes the progress thread: set in create(), closed only in ~Worker. Waiting
  // threads kick() it without the lock, possibly during or after shutdown(); each of them holds
  // the Engine (and so this Worker) alive through its Op, so none can be using it once it is
  // closed. Closing it in shutdown() instead would race with those kicks.
  int wake_fd_ = -1;
  Op* inflight_ = nullptr;  // [mu] intrusive list of in-flight ops
  std::atomic<int> inflight_count_{0};
  std::atomic<int> spinners_{0};  // threads spinning in wait(): the progress thread stays off
  std::atomic<int> sleepers_{0};  // threads sleeping in wait(): completions notify done_cv_
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  std::thread progress_thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace commux::detail
