// src/c10d/work.hpp -- the c10d::Work types of the "ucx" backend (internal).
//
// Who owns what:
//   * P2PWork holds the commux::Request and the tensors it reads or writes. The backend's
//     FutureWatcher keeps every unfinished P2PWork until its request finishes, so dropping the
//     Python Work early never frees a buffer UCX is still using; a finished one is released at
//     once, so the tensors then live only as long as the user holds the Work.
//   * A P2PWork whose wait (or future) times out is cancelled, so that it cannot take a later
//     message meant for the next operation on its tag.
//   * A collective is a Task: the group's queue, then the thread that runs it (the group's
//     collective thread, or a waiter's: CollWork::wait runs a collective not yet started on the
//     waiting thread), owns it (tensors included) until it has run; the CollWork shares the Task to
//     wait on it and to hand out its future.
//   * CoalescedWork holds the Works issued inside one coalescing window.
//   * The FutureWatcher (watcher.hpp) that completes p2p futures is the backend's; a P2PWork only
//     holds a weak_ptr to it.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commux/collectives.hpp"
#include "commux/communicator.hpp"
#include "device.hpp"
#include "errors.hpp"

namespace commux::c10d_detail {

// A future being completed, which runs its callbacks on this thread (Task::settle,
// P2PWork::poll_future). The callbacks may be Python code, and a thread that is not Python's
// own (commux's pool and watcher threads) and takes the GIL while the interpreter finalizes is
// ended on the spot (pthread_exit), which in a callback's cleanup aborts the process. So the
// Python package's exit hook calls quiesce_callbacks(), which waits (boundedly, the GIL
// released) until no completion is under way, and refuses the ones that would start after on
// commux's threads (Python's own threads, which take no harm, still complete theirs).
class CallbackScope {
 public:
  CallbackScope() noexcept;
  ~CallbackScope();
  CallbackScope(const CallbackScope&) = delete;
  CallbackScope& operator=(const CallbackScope&) = delete;
  // False on a commux thread once quiesce_callbacks() ran: the completion must not run
  // callbacks.
  bool allowed() const noexcept { return allowed_; }
  // Marks the calling thread as one of commux's own (the pool's and the watcher's loops).
  static void on_commux_thread() noexcept;

 private:
  bool allowed_;
};
// Stops future completions from starting and waits up to `timeout` for those under way; true if
// none is left.
bool quiesce_callbacks(std::chrono::milliseconds timeout);

using Clock = std::chrono::steady_clock;

c10::intrusive_ptr<c10::ivalue::Future> make_tensor_list_future();

// Ctrl-C. A wait blocked in the backend (Work::wait of a collective, a barrier or a p2p operation)
// polls for an interrupt every kInterruptPoll on the thread where one can arrive; the check throws
// the exception the caller's binding re-raises (KeyboardInterrupt). The Python bindings install
// the hook (src/bindings, the only pybind11 user); without one, waits block as before.
//   here():  cheap, no lock: can the calling thread be interrupted (Python's main thread)?
//   check(): throws when an interrupt is pending (it may take the GIL)
struct InterruptHook {
  bool (*here)() = nullptr;
  void (*check)() = nullptr;
};
constexpr std::chrono::milliseconds kInterruptPoll{100};
void set_interrupt_hook(InterruptHook hook) noexcept;
bool interruptible() noexcept;
// Runs the hook's check; counts what it throws on this thread (interrupts_raised()), so that a
// Work waiting on several lets an interrupt through at once instead of collecting it as a failure.
void check_interrupt();
std::uint64_t interrupts_raised() noexcept;

// Context::poll for a collective run on an interruptible thread: check_interrupt() every
// kInterruptPoll (it throws the interrupt, which stops the collective).
void poll_interrupt();

struct Task;

// Lets a waiter run its collective on its own thread (CollWork::wait) instead of waiting for the
// group's collective thread to take it: the group implements it (process_group_ucx.cpp).
class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // Admits a waiter; false once the group is shutting down. Every admitted waiter calls leave();
  // the group is not destroyed before.
  virtual bool enter() = 0;
  virtual void leave() = 0;
  // Works for `t` on this thread until it is finished or `until` passes: starts the group's queued
  // collectives in order as they may start (a CPU collective as a schedule, the others run here
  // only when `may_block`: their run cannot stop at `until`), and resumes the group's schedules as
  // their requests complete. Returns early when it can do nothing for `t` (taken by a collective
  // thread, a device collective first, the group shutting down), leaving the rest to the
  // collective threads. An interrupt (Ctrl-C) stops a collective it ran here (not a schedule): its
  // Task fails as canceled, and the interrupt propagates; schedules go on without this thread.
  virtual void run_through(const std::shared_ptr<Task>& t, Clock::time_point until,
                           bool may_block) = 0;
};

// The group behind its Tasks, for as long as it is alive.
struct RunnerGate {
  std::mutex mu;
  TaskRunner* runner = nullptr;  // [mu] cleared by the group's shutdown
};

// The outputs of a blocking call that finished within its call, held weakly (Task::weak_outputs
// says why). release_weakly: moves `outputs` into `weak` when all are defined (an undefined tensor
// has no weak reference that could tell it from a freed one), and says whether it did.
// lock_outputs: the tensors again, or a ValueError naming `op_name` when one has been freed.
using WeakOutputs =
    c10::SmallVector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>, 1>;
bool release_weakly(std::vector<at::Tensor>& outputs, WeakOutputs& weak);
std::vector<at::Tensor> lock_outputs(const char* op_name, const WeakOutputs& weak);

struct Task {
  const char* op_name = "";
  c10d::OpType type = c10d::OpType::UNKNOWN;
  std::uint32_t tag = 0;
  std::uint32_t ntags = 1;  // the call uses tags tag .. tag + ntags - 1
  Clock::time_point deadline;
  std::vector<at::Tensor> keep_alive;  // inputs (and scratch) the body reads
  std::vector<at::Tensor> outputs;     // what result() and the future report (result_tensors())
  // A blocking call (asyncOp false) that finished on its caller's thread within the call holds
  // its outputs weakly from then on (release_outputs()): its Work is dropped by torch's Python
  // without the GIL, and since torch 2.13 the last C++ reference to a tensor that Python also
  // holds takes the GIL to let go of the tensor's Python object: about 0.1 us a call (420 more
  // instructions than the same release made by torch's binding, which holds the GIL).
  WeakOutputs weak_outputs;
  bool outputs_released = false;
  std::function<void(std::uint32_t, Clock::time_point)> body;
  // [mu] Made by the first get_future() (DDP's hooks ask at once; a blocking call's caller never
  // does, and making and completing one cost about a third of a microsecond per call).
  c10::intrusive_ptr<c10::ivalue::Future> future;
  // Device collectives: the tensors' device and the fence on the issuing stream (CPU: empty).
  c10::Device device{c10::kCPU};
  StreamFence fence;

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::atomic<bool> finished{false};  // = done, readable without the lock (waiters spin on it)
  std::chrono::microseconds spin{0};  // how long wait() polls `finished` before it sleeps
  std::exception_ptr error;
  // Its group, for a waiter that runs it (null: never run by a waiter); taken: a thread has
  // taken it from the group's queue to run it (guarded by the group's lock).
  std::shared_ptr<RunnerGate> gate;
  bool taken = false;
  // Run or started on the issuing thread within its issue (the flight recorder marked it running
  // then, so execute() does not again).
  bool started_at_issue = false;
  // What decides whether it may run beside the group's other running collectives
  // (COMMUX_INFLIGHT): the byte ranges [first, second) of its tensors, and whether it must run
  // alone (a barrier, a device or sparse collective, one without tensors).
  c10::SmallVector<std::pair<std::uintptr_t, std::uintptr_t>, 2> spans;  // (no allocation)
  bool alone = false;
  std::size_t bytes = 0;  // a schedule's: what it moves (outputs' or inputs' bytes, the larger)
  // A CPU collective that runs as a coll::Schedule once started (docs/torch-backend.md, "Where a
  // collective runs"); sched is set by the thread that starts it, under the group's lock, and
  // reset by the one that completes it. completing: that thread claimed the completion.
  bool schedulable = false;
  std::unique_ptr<coll::Schedule> sched;
  std::exception_ptr sched_error;  // what execute() returned inside the schedule
  std::atomic<bool> completing{false};
  std::atomic<bool> pool_runs{false};  // a pool thread runs it to its end (run_to_end)

  // Marks it done with `e` (nullptr: success) and wakes its waiters; then completes its future,
  // if one was asked for, running the future's callbacks on this thread. With `settle_here` false
  // the future is returned instead, for the caller to settle() on a thread that may run user code.
  c10::intrusive_ptr<c10::ivalue::Future> finish(std::exception_ptr e, bool settle_here = true);
  // The Work's future: completed (or failed) when the task finishes, or at once if it has.
  c10::intrusive_ptr<c10::ivalue::Future> get_future();
  void settle(c10::ivalue::Future& f);  // after `done`: the result, or the error
  // After a successful finish, before anyone else may see the Task (its Work not yet returned).
  void release_outputs();
  // The outputs; once released, those the caller still holds (a ValueError naming the call when
  // one has been freed: a blocking call's Work keeps no results of its own; settle() fails the
  // future with it).
  std::vector<at::Tensor> result_tensors() const;
};

class CollWork final : public c10d::Work {
 public:
  // `where`: the group's "group 'G', rank R of N" for error messages (shared, built once).
  CollWork(int rank, std::shared_ptr<Task> task, std::chrono::milliseconds default_timeout,
           std::shared_ptr<const std::string> where);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override { return task_->result_tensors(); }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return task_->get_future(); }

 private:
  // Works for the task on this thread if the group lets it (TaskRunner::run_through).
  void run_here(Clock::time_point until, bool may_block);
  std::shared_ptr<Task> task_;
  std::chrono::milliseconds default_timeout_;
  std::shared_ptr<const std::string> where_;
};

// The Work of a blocking CPU collective that ran on its caller's thread within its call, with
// nothing queued or running beside it in the group, and succeeded (ProcessGroupUCX's fast path:
// no Task shared with a waiter, no queue). Its outputs are held as a released Task's are.
class DoneWork final : public c10d::Work {
 public:
  DoneWork(int rank, c10d::OpType type, const char* op_name, std::vector<at::Tensor> outputs);
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  std::exception_ptr exception() const override { return nullptr; }
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds /*timeout*/ = kNoTimeout) override { return true; }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  const char* op_name_;
  std::vector<at::Tensor> outputs_;  // until released (some undefined: kept)
  WeakOutputs weak_;
  bool released_ = false;
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made by the first getFuture()
};

class FutureWatcher;  // watcher.hpp

class P2PWork final : public c10d::Work {
 public:
  // `cancel_bound`: how long a timed-out wait waits for the cancellation to finish.
  // `exact_where` (a user's receive, posted with `tag`): the message must fill the tensors. torch
  // has no way to say how many bytes arrived, so a shorter message fails the Work (kCallMismatch,
  // naming the sender, the tag, both sizes and this group's "group 'G', rank R of N") instead of
  // leaving the rest of the tensors stale. Without it (the backend's own keep-alive Works) the
  // outcome is the request's.
  P2PWork(int rank, c10d::OpType type, Request request, std::vector<at::Tensor> tensors,
          std::chrono::milliseconds default_timeout,
          std::chrono::milliseconds cancel_bound = std::chrono::milliseconds(3000),
          std::shared_ptr<const std::string> exact_where = nullptr, int tag = 0);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return tensors_; }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  bool done() const noexcept { return request_.done(); }
  Request& request() { return request_; }
  // Settles the future (if one was handed out) with the result once the request is done. Once the
  // group timeout has passed since posting, the request is cancelled and the future fails with a
  // timeout (or, had it matched meanwhile, completes). True once the request has finished and the
  // future (if any) is settled: the backend may then let go of the Work.
  bool poll_future();
  // The backend's watcher, which completes a future asked for before the request is done.
  void set_watcher(std::weak_ptr<FutureWatcher> watcher) { watcher_ = std::move(watcher); }

 private:
  friend class FutureWatcher;
  // wait() timed out with `timeout`: cancel, wait up to cancel_bound_; returns when the request
  // matched after all, else throws the timeout saying whether it was cancelled.
  void cancel_after_timeout(const Error& timeout);
  // request_.wait(limit), polling for an interrupt where one can arrive; an interrupted operation
  // is cancelled (without waiting for the cancellation) before the interrupt propagates.
  void wait_request(std::chrono::milliseconds limit);
  void release();         // the request has finished: the backend drops its reference now
  Error timeout_error();  // the timeout that had the request cancelled
  // The finished request's failure, or that of a message shorter than an exact receive's tensors;
  // nullptr while unfinished or on success.
  std::exception_ptr outcome() const;
  Request request_;
  std::vector<at::Tensor> tensors_;
  std::shared_ptr<const std::string> exact_where_;  // set for an exact receive
  std::size_t exact_bytes_ = 0;                     // what its tensors hold
  int tag_ = 0;
  std::chrono::milliseconds default_timeout_;
  std::chrono::milliseconds cancel_bound_;
  Clock::time_point posted_;
  std::atomic<bool> cancel_asked_{false};  // a wait or the future timed out: cancel asked for
  std::atomic<bool> released_{false};      // finished and dropped by the watcher
  std::string timeout_reason_;             // of that timeout (guarded by future_mu_)
  std::mutex settle_mu_;                   // held while poll_future() settles
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::weak_ptr<FutureWatcher> watcher_;
};

// A send or receive issued inside a coalescing window with COMMUX_GROUP=1: nothing is posted until
// endCoalescing(), which binds the real Work (or the error the post raised). Waiting on it before
// then is refused: it would wait for something this thread has not posted yet.
class DeferredWork final : public c10d::Work {
 public:
  DeferredWork(int rank, c10d::OpType type, const char* op_name, std::vector<at::Tensor> tensors);
  void bind(c10::intrusive_ptr<c10d::Work> real);
  void fail(std::exception_ptr e);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return tensors_; }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  [[noreturn]] void not_posted(const char* what) const;
  const char* op_name_;
  std::vector<at::Tensor> tensors_;
  mutable std::mutex mu_;
  c10::intrusive_ptr<c10d::Work> real_;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // handed out before bind()
};

class CoalescedWork final : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace commux::c10d_detail
