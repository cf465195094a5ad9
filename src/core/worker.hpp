// Private to src/core: the UCX worker, the lock that serialises it, the in-flight list, the
// progress thread and how a caller waits. The threading contract is docs/progress.md.
//
// Locks: the worker mutex (mutex()) serialises every ucp_* call on the worker (it is created
// UCS_THREAD_MODE_SERIALIZED) and guards every field marked [mu] in src/core -- here, in op.hpp,
// peers.hpp and engine.hpp. UCX callbacks run inside ucp_worker_progress with it held.
// Ownership: the Worker owns the ucp_worker (from create() to destroy_locked()), its wake fd (to
// its destructor) and the progress thread. The in-flight list does not own its Ops: each Op owns
// itself while listed (Op::self); it holds the Ops of every Engine on this worker. The Worker
// belongs to a Hub (hub.hpp), shared by the Engines of one process; it calls back into each
// attached Engine for its part of a progress step and its same-host peer check
// (Engine::step_locked, check_local_peers). engines_ is guarded by both engines_mu_ and mu_
// (attach and detach take engines_mu_ then mu_; either one is enough to read it).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "backoff.hpp"
#include "channel.hpp"
#include "commux/communicator.hpp"
#include "op.hpp"

namespace commux::detail {

class Engine;

class Worker {
 public:
  Worker() = default;
  ~Worker();  // closes the wake fd; the progress thread must have been stopped
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Creates the worker on `context`, its event fd when `wakeup` (fills info.event_fd) and the
  // wake fd. Throws commux::Error on failure.
  void create(ucp_context_h context, bool wakeup, RuntimeInfo& info);
  void destroy_locked() noexcept;  // no-op when there is none [mu]
  std::mutex& mutex() noexcept { return mu_; }
  ucp_worker_h handle() const noexcept { return worker_; }  // nullptr before create, after destroy
  // Set by Hub::shutdown() once UCX is released: nothing is progressed or posted after. [mu]
  bool shut_down_locked() const noexcept { return shut_down_; }
  void mark_shut_down_locked() noexcept { shut_down_ = true; }

  // The Engines on this worker. attach() before the Engine posts anything; detach() (idempotent)
  // once it posts nothing more: after it returns no progress step or peer check calls it again.
  void attach(Engine* engine);
  void detach(Engine* engine);  // drops its driver too
  // The driver the progress thread calls for `engine` (Channel::set_driver; nullptr: none).
  // Returns once no call of the old one runs, unless called from inside that call; false if a
  // driver was given for an Engine that is not attached (it is not called then).
  bool set_driver(Engine* engine, std::shared_ptr<Driver> driver);
  // One progress step: UCX's, then each Engine's own (deferred work, failing receives that wait
  // on gone peers). [mu]
  unsigned progress_locked();
  // progress_locked() for a user thread's spinning wait: counted, so that the progress thread
  // stays parked while user threads progress the worker back to back. (Not test(): a thread that
  // waits in slices polls with it between its sleeps on the progress thread's work.) [mu]
  unsigned user_progress_locked() {
    user_progress_.store(user_progress_.load(std::memory_order_relaxed) + 1,
                         std::memory_order_relaxed);
    return progress_locked();
  }
  // Receives and drops the messages waiting unmatched in the worker whose tag matches
  // (tag, mask): what was sent to a communicator that has shut down, so that it neither matches
  // a later communicator given the same group id nor stays in UCX's buffers. Waits for each at
  // most until `deadline` (a rendezvous from a peer that has stopped may never complete; its
  // scratch buffer is then left to UCX). Returns how many. [mu]
  std::size_t drop_unexpected_locked(std::uint64_t tag, std::uint64_t mask,
                                     std::chrono::steady_clock::time_point deadline);

  // The in-flight list. [mu]
  void register_locked(const std::shared_ptr<Op>& op) {
    op->self = op;
    op->next = inflight_;
    if (inflight_ != nullptr) inflight_->prev = op.get();
    inflight_ = op.get();
    // (Written only under mu_: a plain store, no locked read-modify-write on every post.)
    inflight_count_.store(inflight_count_.load(std::memory_order_relaxed) + 1,
                          std::memory_order_relaxed);
    if (op->capacity > kBackgroundBytes) {
      inflight_large_.fetch_add(1);
      // Nobody spins: the caller may compute before it waits (an exchange posted, then computed
      // over), and only the progress thread moves the transfer meanwhile.
      if (spinners_.load(std::memory_order_relaxed) == 0) wake_for_background_locked();
    }
  }
  // Removes `op` and hands back its self-reference (nullptr when it was not listed).
  std::shared_ptr<Op> unregister_locked(Op& op) {
    if (!op.self) return nullptr;
    if (op.prev != nullptr) op.prev->next = op.next;
    if (op.next != nullptr) op.next->prev = op.prev;
    if (inflight_ == &op) inflight_ = op.next;
    op.prev = op.next = nullptr;
    inflight_count_.store(inflight_count_.load(std::memory_order_relaxed) - 1,
                          std::memory_order_relaxed);
    if (op.capacity > kBackgroundBytes) inflight_large_.fetch_sub(1);
    return std::move(op.self);
  }
  Op* inflight_locked() const noexcept { return inflight_; }  // the first; follow Op::next
  std::vector<std::shared_ptr<Op>> inflight_snapshot_locked() const;
  // How many times the progress thread has taken the worker to progress it (no lock needed).
  std::uint64_t progress_thread_passes() const noexcept {
    return thread_passes_.load(std::memory_order_relaxed);
  }
  // How much longer the progress thread's present sleep lasts (zero while it is awake:
  // wake_if_asleep and the tests), and how many threads sleep in wait() (the tests).
  std::chrono::microseconds progress_thread_nap_left() const noexcept {
    const std::int64_t until = asleep_until_.load();
    const std::int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    if (until == 0 || until <= now) return std::chrono::microseconds(0);
    return std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::duration(until - now));
  }
  int sleeping_waiters() const noexcept { return sleepers_.load(); }

  // The progress thread (docs/progress.md): started once bootstrap is done, stopped (and joined)
  // first thing in shutdown.
  void start_progress_thread();
  void stop_progress_thread();

  // Waits until `op` is done (or abandoned, see Op) or `timeout` passes (true: done or
  // abandoned): progresses once, spins for at least `spin` (longer for large messages; a negative
  // `spin`: not at all), then sleeps on the done condition while the progress thread progresses.
  // `hand_back` false: the caller progresses the worker again right after (a driver of
  // schedules), so the progress of other transfers in flight is not handed to the progress
  // thread when `op` finishes (worker.cpp). Call without the lock.
  bool wait(Op& op, std::chrono::milliseconds timeout, std::chrono::microseconds spin,
            bool hand_back = true);
  // After setting an Op's done flag: wakes the threads sleeping in wait(), if any.
  void notify_done() {
    if (sleepers_.load() > 0) {
      {
        std::lock_guard<std::mutex> g(done_mu_);
      }
      done_cv_.notify_all();
    }
  }
  // Posts held back behind a gate (Engine::post_after), over every Engine: while there are any,
  // the progress thread polls at least every kHeldPoll (kHeldPollLong once posts have been held
  // for over 16 ms), so a post whose gate opens goes out within that even when nobody waits on it.
  void held_changed(int delta) noexcept { held_.fetch_add(delta); }
  // Wakes the progress thread (no lock needed).
  void kick() noexcept;
  // Wakes the progress thread if a transfer above kBackgroundBytes is in flight and no caller
  // spins: the end of a wait without `hand_back` (wait()).
  void hand_back() noexcept {
    if (inflight_large_.load() > 0 && spinners_.load() == 0) kick();
  }
  // Wakes it only if it sleeps (or stays parked) for more than `late` from now: new work for a
  // thread that polls often anyway is not worth a wake-up (Channel::wake_driver).
  void wake_if_asleep(std::chrono::microseconds late) noexcept;
  // A transfer above kBackgroundBytes was posted and nobody spins: cuts the progress thread's
  // sleep short if it is a long one (over kBackgroundLate: parked for callers' earlier waits, or
  // backed off), once per sleep. The thread then progresses the worker unless the caller goes on
  // to progress it itself within kBackgroundGrace (wait_for_kick). [mu]
  void wake_for_background_locked() noexcept;
  // How a spinning waiter's poll that finds nothing to do treats the CPU (Options::yield):
  // kAfterSpin (the default) yields it once the wait has lasted a few microseconds, kAlways from
  // the first poll, kNever keeps it. One worker serves the process: the last set wins.
  enum class YieldMode : std::uint8_t { kAfterSpin, kAlways, kNever };
  void set_yield_mode(YieldMode m) noexcept { yield_.store(m, std::memory_order_relaxed); }
  YieldMode yield_mode() const noexcept { return yield_.load(std::memory_order_relaxed); }

 private:
  void progress_thread_main();
  bool drive();  // calls each driver once (the progress thread, without mu_); any work listed
  // wait() on the progress thread (a driver's): progresses itself until done or `deadline`,
  // since nobody else would progress what it sleeps on.
  bool wait_on_progress_thread(Op& op, std::chrono::steady_clock::time_point deadline);
  // Sleeps until kick() (true), `timeout`, or `other_fd` (if >= 0) becomes readable; a
  // background wake-up (wake_for_background_locked) counts as a kick once kBackgroundGrace has
  // shown that nobody progresses the worker. `posts`: long_sleep_.posts() as of the look that
  // decided to sleep (a post since then cuts a long sleep short too).
  bool wait_for_kick(std::chrono::microseconds timeout, int other_fd, std::uint64_t posts);
  enum class Woke : std::uint8_t { kTimeout, kKick, kBackground, kFd };
  // One sleep of the progress thread, until `end` at the latest: what ended it.
  Woke sleep_until(std::chrono::steady_clock::time_point end, int other_fd);
  void signal(std::uint64_t count) noexcept;  // adds `count` to the eventfd

  std::mutex engines_mu_;         // taken before mu_ (see above)
  std::vector<Engine*> engines_;  // [engines_mu_ and mu_ to write; either to read]
  // The Engines' drivers (Channel::set_driver), and how many. The progress thread holds
  // drive_mu_ while it calls them, so set_driver() can wait for a call of the old one to end.
  std::vector<std::pair<Engine*, std::shared_ptr<Driver>>> drivers_;  // [engines_mu_]
  std::atomic<int> driver_count_{0};
  std::mutex drive_mu_;
  std::vector<std::shared_ptr<Driver>> driving_;  // [drive_mu_] this round's
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
  // [mu] written, read without it by the progress thread (how long it may sleep: a hint).
  std::atomic<int> inflight_count_{0};
  // Operations above kBackgroundBytes: a transfer in several fragments or a rendezvous, which
  // moves only while someone progresses. A waiter that stops spinning hands progress back to the
  // progress thread at once only while one is in flight (wait()), and the progress thread does
  // not stay parked for callers' waits back to back meanwhile (progress_thread_main).
  static constexpr std::size_t kBackgroundBytes = 4096;
  std::atomic<int> inflight_large_{0};
  static constexpr std::chrono::microseconds kBackgroundLate{1000};
  static constexpr std::chrono::microseconds kBackgroundGrace{50};
  // Raised while the progress thread sleeps longer than kBackgroundLate and no post has cut this
  // sleep short (wake_for_background_locked); it also counts those posts, so that one landing
  // between the thread's look and its sleep is not missed (backoff.hpp).
  LongSleepFlag long_sleep_;
  std::atomic<int> held_{0};
  static constexpr std::chrono::microseconds kHeldPoll = kEventPollCap;
  static constexpr std::chrono::microseconds kHeldPollLong = kEventPollLongCap;
  std::atomic<int> spinners_{0};  // threads spinning in wait(): the progress thread stays off
  // User threads' progress calls (user_progress_locked), written under mu_ and read without it
  // by the progress thread: while the count moves between two of its looks, callers progress
  // the worker themselves (docs/progress.md).
  std::atomic<std::uint64_t> user_progress_{0};
  std::atomic<std::uint64_t> thread_passes_{0};  // progress_thread_passes()
  std::atomic<int> sleepers_{0};     // threads sleeping in wait(): completions notify done_cv_
  std::atomic<bool> parked_{false};  // the progress thread is staying off for user threads
  // When the progress thread's current sleep ends (steady_clock ticks; 0: it is not asleep).
  std::atomic<std::int64_t> asleep_until_{0};
  std::atomic<YieldMode> yield_{YieldMode::kAfterSpin};
  // Whether an idle poll at `now` should yield: never in kNever, always in kAlways (the ranks
  // outnumber the CPUs: the yields go to them), in kAfterSpin while yield_gate_ is open.
  bool yield_pays(std::chrono::steady_clock::time_point now) const noexcept {
    const YieldMode m = yield_mode();
    return m == YieldMode::kAlways || (m == YieldMode::kAfterSpin && yield_gate_.open(now));
  }
  // sched_yield(); in kAfterSpin timed, and false (stop yielding) when it was slow (YieldGate).
  bool yield_cpu() noexcept;
  YieldGate yield_gate_;
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  std::thread progress_thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace commux::detail
