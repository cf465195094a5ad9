// src/c10d/process_group_ucx_internal.hpp -- the state behind commux::ProcessGroupUCX (internal:
// included by src/c10d only; the installed header shows a pointer to it).
//
// ProcessGroupUCX's c10d::Backend overrides forward to the Impl methods of the same name (one
// pointer indirection per call); the Impl does the work: validation (tensor_checks.hpp), posting
// point-to-point on the caller's thread, queueing collectives, which threads of the process's
// CollectivePool (pool.hpp) or a waiting caller start in issue order, up to COMMUX_INFLIGHT of
// them at once when their tensors do not overlap (can_start_locked).
//
// Who owns what: the Impl owns the Communicator, its queue of Tasks (and their tensors), the
// in-flight p2p Works (and their tensors) until their requests complete, the FutureWatcher
// (shared with the p2p Works through weak_ptrs), the collectives' device streams and the
// coalescing windows. It lives exactly as long as its ProcessGroupUCX; its shutdown waits until
// no pool thread runs its queue.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <algorithm>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "commux/collectives.hpp"
#include "commux/communicator.hpp"
#include "commux/process_group_ucx.hpp"
#include "device.hpp"
#include "flight_recorder.hpp"
#include "list_buffer.hpp"
#include "pool.hpp"
#include "watcher.hpp"
#include "work.hpp"

namespace commux {

struct ProcessGroupUCX::Impl final : c10d_detail::CollectivePool::Client, c10d_detail::TaskRunner {
  using Body = std::function<void(std::uint32_t tag, std::chrono::steady_clock::time_point)>;
  // Schedules in flight at once under COMMUX_INFLIGHT=auto; the most COMMUX_INFLIGHT allows; how
  // long a thread resuming schedules sleeps on one of them before it looks at all of them again.
  static constexpr int kScheduleLimit = 16;
  // Under COMMUX_INFLIGHT=auto, a schedule starts beside running ones only while their bytes and
  // its own (Task::bytes) come to at most this: bandwidth-bound collectives in flight at once only
  // take turns on the same copies and evict each other's data from the caches. Through the C++ API
  // on 2 ranks (bench/experiments/schedule_burst.cpp, 8 allreduces), 8 schedules in flight at once
  // against one at a time: 64 KiB 1.03x against 1.04-1.10x blocking's time, 128 KiB 1.26x against
  // 1.11x, 256 KiB 1.33x against 1.02x, 1 MiB 1.32x against 1.05x. Through torch the cost starts
  // lower: with a 512 KiB window, 8 async all_reduces of 64 KiB (all 8 in flight) took 1.17x and
  // their futures 1.77x blocking's time on 2 ranks, with this one (one at a time) 1.03x and 1.25x
  // (bench/experiments/schedule_ab.py; docs/torch-backend.md, "The window at 64 KiB").
  static constexpr std::size_t kScheduleBytes = std::size_t{64} << 10;
  static constexpr std::size_t kMaxInflight = 64;
  static constexpr std::chrono::microseconds kScheduleSlice{1000};
  // After this many slices in a row in which no schedule was ready, slices of kIdleSlice.
  static constexpr int kSlicesBeforeIdle = 25;
  static constexpr std::chrono::microseconds kIdleSlice{10000};
  // How long a pool thread serving a group leaves its schedules to the group's waiters after
  // the last one left, before it resumes them itself.
  static constexpr std::chrono::microseconds kServerGrace{200};
  // How long shutdown waits for every peer to say that it shut the group down too
  // (untold_notices; at most the communicator's shutdown timeout): once all have, every notice
  // they sent has arrived. A peer that shuts down later than this is not waited for.
  static constexpr std::chrono::milliseconds kShutdownPeerWait{1000};
  // How long shutdown() waits, beyond the communicator's shutdown timeout, for the group's threads
  // to leave it (a collective whose requests were cancelled, a future's callbacks).
  static constexpr std::chrono::seconds kDrainGrace{5};

  // (First: it goes last, freeing the process's kept list staging if this was the last group.)
  c10d_detail::KeptStagingUser staging_user_;

  Impl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
       std::chrono::milliseconds timeout, std::string name, std::string group_name);
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  int getRank() const { return rank_; }
  int getSize() const { return size_; }

  // The entry points of ProcessGroupUCX (see commux/process_group_ucx.hpp).
  // Waits for the group's threads to leave it, for at most the communicator's shutdown timeout
  // plus kDrainGrace. False when one still had not (it says so on stderr): the Impl must then
  // outlive them, and the backend's destructor leaves it in place. `wait_peers` false (abort()):
  // no wait for the peers' own shutdown (untold_notices).
  bool shutdown(bool wait_peers);
  uint64_t getSequenceNumberForGroup();
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag);
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag);
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag);
  void startCoalescing();
  c10::intrusive_ptr<c10d::Work> endCoalescing();
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts);
  void monitoredBarrier(const c10d::BarrierOptions& opts,
                        bool wait_all_ranks);  // monitored_barrier.cpp
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts);
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts);
  // allreduce of a sparse COO tensor (SUM), as Gloo does it (sparse_allreduce.cpp).
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts);
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts);
  std::vector<std::int64_t> exchange_lanes(
      const std::string& op, const std::vector<at::Tensor>& sends,
      const std::vector<std::vector<std::int64_t>>& send_bytes,
      const std::vector<at::Tensor>& recvs,
      const std::vector<std::vector<std::int64_t>>& recv_offsets,
      const std::vector<std::vector<std::int64_t>>& recv_capacity,
      std::chrono::milliseconds timeout);

  // Queues `body` for the group's collectives; the returned Work completes when it has run.
  // !async_op (torch's opts.asyncOp: the caller waits at once): a CPU collective runs here, on the
  // calling thread, when no earlier one of the group is queued or running (torch lets a backend
  // return a completed Work), else as with async_op.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* op_name,
                                         std::chrono::milliseconds op_timeout, bool async_op,
                                         std::vector<at::Tensor> keep_alive,
                                         std::vector<at::Tensor> outputs, Body body,
                                         std::uint32_t ntags = 1, int root = -1);
  // enqueue's fast path: a blocking CPU call, when nothing of the group is queued or running
  // (checked under the lock that takes its tags), runs here on a Task on this thread's stack, with
  // one lock round trip before and one after, and returns a DoneWork (a CollWork if it failed).
  // Otherwise returns null with the arguments untouched, for the queued path.
  c10::intrusive_ptr<c10d::Work> run_now(c10d::OpType type, const char* op_name,
                                         std::chrono::milliseconds op_timeout,
                                         std::vector<at::Tensor>& keep_alive,
                                         std::vector<at::Tensor>& outputs, Body& body,
                                         std::uint32_t ntags, int root);
  // [not mu_] run_now's task has run: unlisted, and the group looks at its queue (leave()).
  void ran_now(const c10d_detail::Task& t);
  // [mu_] A waiter admitted by enter() (or run_now) leaves: wakes the progress thread if it
  // resumes schedules, tells shutdown(); true when the group must then be submitted to the pool.
  bool leave_locked();
  c10::intrusive_ptr<c10d::Work> post_p2p(c10d::OpType type, const char* op_name,
                                          std::vector<at::Tensor>& tensors, int peer, int tag);
  // Posts a validated send or receive now.
  c10::intrusive_ptr<c10d_detail::P2PWork> post_now(c10d::OpType type,
                                                    const std::vector<at::Tensor>& tensors,
                                                    int peer, int tag);
  // Unfinished p2p Works (tensors included) stay with the watcher until their request finishes.
  void keep_until_done(const c10::intrusive_ptr<c10d_detail::P2PWork>& w);
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> work);
  // The collectives' context for tensors like `like` (its memory type; on a device, the backend's
  // DeviceOps for it). An undefined `like` means host memory.
  coll::Context context(const char* op_name, std::uint32_t tag,
                        std::chrono::steady_clock::time_point deadline, const at::Tensor& like);
  // Calls tag .. tag + ntags - 1 of this group, for what their buffers are held by on failure.
  c10d_detail::CallRef call(std::uint32_t tag, std::uint32_t ntags = 1) const {
    return c10d_detail::CallRef{comm_.get(), tag, ntags};
  }
  void run(c10d_detail::Task& task);

  // Cross-rank call checks (call_checks.cpp). A collective call that a rank rejects before
  // enqueueing it still takes its tags and tells the other ranks (coll::reject), so their call
  // fails at once naming this rank's reason instead of pairing with its next call.
  template <class F>
  auto checked(const char* op, std::size_t ntags, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const c10::Error& e) {
      reject_call(op, static_cast<std::uint32_t>(std::max<std::size_t>(1, ntags)),
                  e.what_without_backtrace());
      throw;
    }
  }
  void reject_call(const char* op, std::uint32_t ntags, const std::string& reason) noexcept;
  // A call that failed or was rejected here may still receive messages of its peers: they are
  // dropped before each later call (drain_dead), until its tags come round again.
  void note_dead(std::uint32_t tag, std::uint32_t ntags);
  void drain_dead(std::uint32_t current);
  // A call this rank finished without receiving anything: a broadcast or scatter it ran as the
  // root, or a reduce or gather it was not the root of (each sends). Only in these can the ranks
  // disagree on the root without anyone's wait noticing. Messages that arrive for such a call
  // afterwards show the other ranks were in another call: check_root_calls() looks for them
  // before the collectives after it run (`skip` of them first, then `looks`).
  void note_root_call(std::uint32_t tag, const char* op, int skip, int looks);
  // Throws (after telling the other ranks of call `current`) when a message of a noted root call
  // has arrived: that call's results are wrong on some rank, and nothing else would say so.
  void check_root_calls(std::uint32_t current, const char* current_op);
  // Fails call `current` on every rank, before it runs, for `reason` (an earlier call went wrong).
  [[noreturn]] void refuse_call(std::uint32_t current, const char* current_op,
                                const std::string& reason);
  // A rank that finds the ranks' calls disagreeing (sizes, say) or stops a call tells the other
  // ranks with a notice; one that had finished the call already gets it afterwards. Looks (one
  // progress call and probe) for a notice of a call that finished here, before call `current` runs;
  // finding one, fails call `current` on every rank naming the earlier call (its results may be
  // wrong on some rank, and nothing else would tell this one).
  void check_notices(std::uint32_t current, const char* current_op);
  // At shutdown, where no later collective will read them: the notices of calls that finished
  // here, and the messages of root calls that this rank never took (check_root_calls), taken and
  // described, one line per call; "" if none. `never_ran`: the calls shutdown took off the queue
  // (they fail saying so). It first tells the peers that this rank shut down (coll::say_shutdown);
  // with `wait_peers` (and a collective made), it then looks until every peer has said so too, or
  // kShutdownPeerWait has passed: a peer's notices arrive before its own shutdown's. A message
  // from a peer that shuts down later than that is not seen.
  std::string untold_notices(const std::deque<std::shared_ptr<c10d_detail::Task>>& never_ran,
                             bool wait_peers) noexcept;
  // What check_notices and untold_notices say of the notice (of kind `kind`, see
  // coll::take_notice) of call `call` from `sender`.
  static std::string notice_text(std::uint32_t call, int sender, char kind, const std::string& what,
                                 const std::string& found);
  // Whether check_notices runs before this call: at most once per tick of the coarse clock (1-4
  // ms). Its probe walks the transport's whole queue of unexpected messages, which a rank far
  // behind its peers (a broadcast receiver in a loop) holds hundreds of: every call made it 1.5x
  // slower there. A notice is then found within a few milliseconds of calls.
  bool notice_look_due() noexcept;
  // [mu_] Whether call `call` is one of a running task's tags.
  bool running_locked(std::uint32_t call) const;
  // Whether call `call` failed here (and said so): its leftovers are only dropped.
  bool failed_here(std::uint32_t call);
  std::chrono::milliseconds effective(std::chrono::milliseconds op_timeout) const;
  // CollectivePool::Client: runs the queue until it is empty (on a pool thread).
  void serve() override;
  // The core's progress thread (detail::Driver, while progress_resumes_): starts the queued CPU
  // collectives that may start, as schedules, and resumes the listed schedules that are ready.
  // Never runs user code: a future it would complete goes to settle_ for a pool thread.
  struct Driver;
  bool drive() noexcept;  // whether schedules are listed
  // On a pool thread: completes `t`'s future `f` (if any), running its callbacks, counted as a
  // running server meanwhile, so that what is left to do (a later collective a callback waits
  // for) gets another pool thread.
  void settle_covered(const std::shared_ptr<c10d_detail::Task>& t,
                      c10::intrusive_ptr<c10::ivalue::Future> f);
  // TaskRunner: a waiter runs queued collectives on its own thread (CollWork::wait).
  bool enter() override;
  void leave() override;
  void run_through(const std::shared_ptr<c10d_detail::Task>& t,
                   std::chrono::steady_clock::time_point until, bool may_block) override;
  // Runs a taken task that is not a schedule on this thread (a waiter's or the caller's); an
  // interrupt stops it on every rank (its Task fails as canceled) and propagates.
  void run_blocking(const std::shared_ptr<c10d_detail::Task>& t);
  // Schedules. start_schedule: runs a taken task as a coll::Schedule on this thread up to its
  // first wait, completes it if it finished there, else lists it in scheduled_.
  // resume_schedules: resumes each listed schedule that is ready, completing those that finish;
  // true if it ran a step of any. await_schedules: sleeps up to `max` on what the first listed schedule
  // waits for. complete_schedule: once per task, by whichever thread claims it.
  void start_schedule(const std::shared_ptr<c10d_detail::Task>& t);
  bool resume_schedules();
  static std::chrono::microseconds schedule_slice(int idle);  // after `idle` slices with none ready
  void await_schedules(std::chrono::microseconds max);
  void complete_schedule(const std::shared_ptr<c10d_detail::Task>& t);
  // Runs a task taken from the queue (the flight record, the dead calls' messages, the body);
  // what it threw, after the record. Does not finish the task.
  std::exception_ptr execute(c10d_detail::Task& t);
  // [mu_] The queue's first task can start now, or schedules are listed and no pool thread
  // serves the group, and no pool thread is free to take it: counts one more server; the caller
  // then submits the group to the pool (after unlocking).
  bool needs_server_locked();
  // [mu_] Whether `t` may start beside the running tasks (COMMUX_INFLIGHT): always when none
  // runs; else when fewer than inflight_ run (sched_limit_ for a schedule, within sched_bytes_),
  // neither it nor any of them runs alone and its tensors overlap none of theirs.
  bool can_start_locked(const c10d_detail::Task& t) const;
  // [mu_] Takes the queue's first task to run it on this thread (counts it running).
  std::shared_ptr<c10d_detail::Task> take_front_locked();
  // [mu_] A task taken by take_front_locked() has run.
  void ran_locked(const c10d_detail::Task& t);
  const std::string& where() const { return *where_; }

  int rank_;
  int size_;
  std::string name_;
  std::string group_name_;
  // "group 'G', rank R of N", built once: every Work's error messages share it.
  std::shared_ptr<const std::string> where_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Communicator> comm_;

  std::mutex mu_;
  std::condition_variable cv_;  // shutdown() waits on it for servers_ and waiters_in_ to clear
  std::deque<std::shared_ptr<c10d_detail::Task>> queue_;
  std::atomic<std::size_t> queued_{0};  // = queue_.size(), for the pool thread's lock-free polling
  std::atomic<std::uint64_t> arrivals_{0};  // collectives enqueued so far (the same polling)
  std::chrono::microseconds spin_{0};       // COMMUX_SPIN_US: hand-off polling before letting go
  int servers_ = 0;          // [mu_] pool threads submitted for the group, until serve() lets go
  int servers_running_ = 0;  // [mu_] those of them running a task now
  int settling_ = 0;         // [mu_] threads running a future's callbacks now (settle_covered)
  std::vector<const c10d_detail::Task*> running_;  // [mu_] taken, not yet run (pool or waiter)
  int inflight_ = 2;                               // COMMUX_INFLIGHT
  // Schedules: CPU collectives started as coll::Schedules (they hold no thread while they wait),
  // up to sched_limit_ at once; listed here from their first wait until completed, in start order.
  // drivers_: waiters in run_through, which resume them; a pool thread serving the group resumes
  // them while there are none, and sleeps on serve_cv_ (server_asleep_) while there are.
  std::vector<std::shared_ptr<c10d_detail::Task>> scheduled_;  // [mu_]
  int sched_limit_ = 16;
  std::size_t sched_bytes_ = kScheduleBytes;  // 0: no byte window (an explicit COMMUX_INFLIGHT)
  std::atomic<std::size_t> listed_{0};        // = scheduled_.size(), for drive()'s lock-free look
  // COMMUX_PROGRESS_RESUMES: the progress thread resumes the schedules nobody waits for (driver_
  // is registered with the communicator); cleared first thing in shutdown. [mu_]
  bool progress_resumes_ = false;
  std::shared_ptr<Driver> driver_;
  // Schedules the progress thread finished whose future was asked for: a pool thread completes
  // the future (its callbacks are user code). [mu_]
  std::vector<
      std::pair<std::shared_ptr<c10d_detail::Task>, c10::intrusive_ptr<c10::ivalue::Future>>>
      settle_;
  int drivers_ = 0;             // [mu_]
  bool server_asleep_ = false;  // [mu_]
  std::condition_variable serve_cv_;
  std::atomic<std::uint64_t> scheduled_calls_{0};  // collectives started as schedules
  std::atomic<std::uint64_t> concurrent_{0};       // tasks started beside another
  int waiters_in_ = 0;                        // [mu_] waiters admitted by enter(), not yet left
  bool caller_runs_ = true;                   // COMMUX_CALLER_RUNS
  bool schedules_ = true;                     // COMMUX_SCHEDULE (and COMMUX_CALLER_RUNS)
  std::atomic<std::uint64_t> caller_ran_{0};  // collectives run_through() ran
  std::shared_ptr<c10d_detail::RunnerGate> gate_;  // shared with the Tasks
  bool stopping_ = false;
  std::uint32_t next_tag_ = 0;
  std::mutex dead_mu_;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> dead_;  // [dead_mu_] (tag, ntags)
  std::atomic<bool> any_dead_{false};                          // = !dead_.empty()
  std::atomic<std::int64_t> notice_looked_ms_{0};              // notice_look_due()
  struct RootCall {
    std::uint32_t tag;
    const char* op;
    int skip;   // collectives to let start before looking
    int looks;  // collectives before which it is still looked for after that
  };
  // What check_root_calls and untold_notices say of a message from `sender` for root call `r`.
  static std::string root_call_text(const RootCall& r, int sender);
  std::vector<RootCall> root_calls_;         // [dead_mu_]
  std::atomic<bool> any_root_calls_{false};  // = !root_calls_.empty()
  std::uint64_t collectives_issued_ = 0;
  // The collectives' streams and DeviceOps per device (device tensors).
  std::unique_ptr<c10d_detail::DeviceStreams> streams_;
  bool aten_on_cpu_ = false;  // COMMUX_ATEN_REDUCE=1
  std::atomic<std::uint64_t> device_ops_calls_{0};
  // Keeps unfinished p2p Works alive and completes their futures (shared with the Works through
  // weak_ptrs).
  std::shared_ptr<c10d_detail::FutureWatcher> watcher_;
  // The collectives' recent history and the hang report (flight_recorder.hpp).
  std::unique_ptr<c10d_detail::FlightRecorder> recorder_;
  bool shut_down_ = false;
  // The first shutdown's untold_notices(), until shutdown() raises it or the destructor or
  // abort() prints it. [set by the first shutdown(), read by the thread that called it]
  std::string untold_;

  // Coalescing windows, per issuing thread; open_windows_ lets ops skip the lock when none is open
  // (a window is opened and used by one thread, so that thread sees its own increment).
  struct Deferred {
    c10d::OpType type;
    std::vector<at::Tensor> tensors;
    int peer;
    int tag;
    c10::intrusive_ptr<c10d_detail::DeferredWork> work;
  };
  struct Window {
    std::thread::id thread;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<Deferred> deferred;  // COMMUX_GROUP=1: p2p ops posted at endCoalescing
  };
  bool defer_in_window_ = false;
  std::atomic<int> open_windows_{0};
  std::mutex coalesce_mu_;
  std::vector<Window> windows_;
};

}  // namespace commux
