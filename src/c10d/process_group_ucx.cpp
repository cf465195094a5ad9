// The torch adapter: ProcessGroupUCX (its Impl, process_group_ucx_internal.hpp) maps tensors and
// c10d::Work onto commux's point-to-point (src/core) and collectives (src/collectives), with the
// dtype / ReduceOp tables of types.hpp and the argument checks of tensor_checks.hpp. No UCX calls.
#include "commux/process_group_ucx.hpp"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <utility>

#include "commux/collectives.hpp"
#include "commux/error.hpp"
#include "commux/settings.hpp"
#include "../core/channel.hpp"
#include "../core/log.hpp"
#include "device.hpp"
#include "errors.hpp"
#include "list_buffer.hpp"
#include "process_group_ucx_internal.hpp"
#include "tensor_checks.hpp"
#include "torch_compat.hpp"
#include "types.hpp"
#include "watcher.hpp"
#include "work.hpp"

namespace commux {

using c10d_detail::check_blocks;
using c10d_detail::check_root;
using c10d_detail::Clock;
using c10d_detail::CoalescedWork;
using c10d_detail::CollWork;
using c10d_detail::DeferredWork;
using c10d_detail::invalid;
using c10d_detail::ListBuffer;
using c10d_detail::memory_type_of;
using c10d_detail::nbytes;
using c10d_detail::on_device;
using c10d_detail::P2PWork;
using c10d_detail::Reduction;
using c10d_detail::root_list;
using c10d_detail::single;
using c10d_detail::StreamFence;
using c10d_detail::Task;
using c10d_detail::to_dtype;
using c10d_detail::to_reduction;

namespace {
// Set while the core's progress thread resumes this process's schedules (Impl::drive): what
// finishes there leaves its future's callbacks (user code) to a pool thread.
thread_local bool t_driving = false;
// Set on a pool thread while it serves a group (Impl::serve).
thread_local bool t_serving = false;
}  // namespace

// The group's part of the progress thread's round (COMMUX_PROGRESS_RESUMES).
struct ProcessGroupUCX::Impl::Driver final : commux::detail::Driver {
  explicit Driver(Impl* group) : g(group) {}
  // `g` outlives every call: its shutdown unregisters this, which waits for a running call.
  bool drive() noexcept override { return g->drive(); }
  Impl* g;
};

namespace {

constexpr std::size_t kSpinWaitBytes = std::size_t{256} << 10;

// Where shutdown's findings (Impl::untold_) cannot be raised (the destructor, abort()): stderr,
// once.
void print_untold(std::string& untold) {
  if (untold.empty()) return;
  std::fprintf(stderr, "%s\n", untold.c_str());
  std::fflush(stderr);
  untold.clear();
}

// --- Store adapter: torch's (prefix-scoped) c10d::Store as a commux::Store --------------------

class C10dStore final : public Store {
 public:
  explicit C10dStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<std::uint8_t>& value) override {
    store_->set(key, value);
  }
  std::vector<std::uint8_t> get(const std::string& key,
                                std::chrono::milliseconds timeout) override {
    try {
      store_->wait({key}, timeout);
    } catch (const c10::DistNetworkError&) {
      // Not a timeout: the store's connection broke (its host, rank 0 as a rule, exited or
      // crashed). Said at once, instead of "did not appear within <the whole timeout>".
      throw Error(Errc::kPeerFailed,
                  "commux init: the store's connection broke while this rank waited for key '" +
                      key + "' (has the rank that hosts the store, usually rank 0, exited?): " +
                      c10d_detail::current_message());
    } catch (const std::exception&) {
      // The store's own message, without the C++ backtrace a c10::Error's what() carries.
      throw Error(Errc::kTimeout,
                  "commux init: key '" + key + "' did not appear in the store within " +
                      std::to_string(timeout.count()) +
                      " ms (has every rank called init_process_group / new_group?): " +
                      c10d_detail::current_message());
    }
    return store_->get(key);
  }
  bool check(const std::string& key) override { return store_->check({key}); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// PREMUL_SUM scaling; a device tensor is scaled on the current stream (the backend's, on the
// worker thread).
void apply_scale(at::Tensor& t, double f) {
  if (f == 1.0) return;
  if (on_device(t)) {
    t.mul_(f);
  } else {
    scale(t.data_ptr(), t.numel(), to_dtype("scale", t.scalar_type()), f);
  }
}

// AVG: the sum divided by the group size. On a device by a division (correctly rounded in the
// tensor's dtype, as torch's mean), on the host by the kernels' scale(1/size) in double.
void apply_average(at::Tensor& t, int size) {
  if (size == 1) return;
  if (on_device(t)) {
    t.div_(size);
  } else {
    scale(t.data_ptr(), t.numel(), to_dtype("scale", t.scalar_type()), 1.0 / size);
  }
}

int group_number(const std::string& name) {
  if (!name.empty() && std::all_of(name.begin(), name.end(), ::isdigit) && name.size() < 9) {
    return std::stoi(name) % 256;
  }
  return static_cast<int>(std::hash<std::string>{}(name) % 256);
}

}  // namespace

// --- construction / shutdown -------------------------------------------------------------------

ProcessGroupUCX::Impl::Impl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                            std::chrono::milliseconds timeout, std::string name,
                            std::string group_name)
    : rank_(rank),
      size_(size),
      name_(std::move(name)),
      group_name_(std::move(group_name)),
      where_(std::make_shared<const std::string>("group '" + group_name_ + "', rank " +
                                                 std::to_string(rank) + " of " +
                                                 std::to_string(size))),
      timeout_(timeout) {
  commux::Options o = commux::Options::from_env();
  o.timeout = timeout;
  o.group = group_number(group_name_);
  defer_in_window_ = o.defer_in_window;
  spin_ = o.spin;
  try {
    comm_ = std::make_unique<Communicator>(std::make_shared<C10dStore>(store), rank, size, o);
  } catch (...) {
    c10d_detail::throw_torch_error(std::current_exception());
  }
  // Device tensors are checked against what this UCX can carry before anything is posted.
  c10d_detail::set_ucx_runtime(comm_->runtime_info());
  streams_ = std::make_unique<c10d_detail::DeviceStreams>();
  // COMMUX_ATEN_REDUCE=1: CPU collectives also work through the ATen DeviceOps (scratch, local
  // copies and reductions by ATen's CPU kernels) -- the device path's code, checkable without a
  // GPU. Not a speed-up: 1.03-1.35x slower than commux's kernels here (bench/experiments/aten_reduce_ab.py).
  const auto settings = commux::Settings::from_environment();  // read as the group is created
  aten_on_cpu_ = settings.aten_reduce;
  caller_runs_ = settings.caller_runs;
  schedules_ = settings.schedule && caller_runs_;
  // COMMUX_INFLIGHT=auto: two at once (as Gloo's two threads per group) where the process has a
  // CPU to spare beyond the group's ranks on this host, else one at a time: a second running
  // collective would only add a thread that takes the CPU from a rank. With as many ranks as
  // CPUs (2 and 2), futures of 8 async all_reduces waited in turn (DDP's buckets) took
  // 1.19-1.36x blocking's time at 1 MiB with two at once, 1.01-1.18x one at a time, and the
  // other patterns of bench/experiments/schedule_ab.py were alike (docs/torch-backend.md).
  inflight_ = settings.inflight > 0 ? settings.inflight
                                    : (commux::detail::channel(*comm_).spare_cpus() ? 2 : 1);
  // Schedules hold no thread while they wait, so auto lets more of them run at once; an explicit
  // COMMUX_INFLIGHT bounds them too.
  sched_limit_ = settings.inflight > 0 ? settings.inflight : kScheduleLimit;
  sched_bytes_ = settings.inflight > 0 ? 0 : kScheduleBytes;
  gate_ = std::make_shared<c10d_detail::RunnerGate>();
  gate_->runner = this;
  if (schedules_ && settings.progress_resumes) {
    driver_ = std::make_shared<Driver>(this);
    progress_resumes_ = commux::detail::channel(*comm_).set_driver(driver_);
  }
  watcher_ = std::make_shared<c10d_detail::FutureWatcher>();
  recorder_ = std::make_unique<c10d_detail::FlightRecorder>(store, rank, size, group_name_);
  COMMUX_LOG(kInfo, rank, "torch backend '", name_, "': process group '", group_name_,
             "' is commux group ", comm_->options().group, ", rank ", rank, " of ", size);
}

ProcessGroupUCX::ProcessGroupUCX(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 std::chrono::milliseconds timeout, std::string name,
                                 std::string group_name)
    : c10d::Backend(rank, size),
      impl_(std::make_unique<Impl>(store, rank, size, timeout, std::move(name),
                                   std::move(group_name))) {}

ProcessGroupUCX::~ProcessGroupUCX() {
  // A thread still inside the group (a future callback that never returns) would use it after
  // free: leave the group's state in place instead (shutdown() said so on stderr).
  const bool drained = impl_->shutdown(true);
  print_untold(impl_->untold_);
  if (!drained) static_cast<void>(impl_.release());
}

const std::string ProcessGroupUCX::getBackendName() const { return impl_->name_; }
std::chrono::milliseconds ProcessGroupUCX::timeout() const { return impl_->timeout_; }
void ProcessGroupUCX::setTimeout(std::chrono::milliseconds timeout) { impl_->timeout_ = timeout; }
Communicator& ProcessGroupUCX::communicator() { return *impl_->comm_; }
std::uint64_t ProcessGroupUCX::device_ops_calls() const {
  return impl_->device_ops_calls_.load(std::memory_order_relaxed);
}

std::uint64_t ProcessGroupUCX::caller_ran_calls() const {
  return impl_->caller_ran_.load(std::memory_order_relaxed);
}

std::uint64_t ProcessGroupUCX::concurrent_calls() const {
  return impl_->concurrent_.load(std::memory_order_relaxed);
}

int ProcessGroupUCX::inflight() const { return impl_->inflight_; }

std::uint64_t ProcessGroupUCX::scheduled_calls() const {
  return impl_->scheduled_calls_.load(std::memory_order_relaxed);
}

bool ProcessGroupUCX::Impl::shutdown(bool wait_peers) {
  std::deque<std::shared_ptr<Task>> left;
  bool submit = false;
  // The progress thread stops resuming schedules (this returns once its call has ended); the
  // pool threads take them over below.
  if (driver_ != nullptr && comm_) commux::detail::channel(*comm_).set_driver(nullptr);
  {
    std::lock_guard<std::mutex> lk(mu_);
    progress_resumes_ = false;
    if (shut_down_) return servers_ == 0 && waiters_in_ == 0;
    shut_down_ = true;
    stopping_ = true;
    left.swap(queue_);
    queued_.store(0, std::memory_order_release);
    // Schedules in flight fail once the communicator has cancelled their requests: a pool thread
    // resumes them to their end (waiters are refused from now on).
    submit = needs_server_locked();
  }
  if (submit) c10d_detail::CollectivePool::instance().submit(this);
  // A disagreement another rank found in a call that returned here, which no later collective
  // on this group will now report (check_notices): its results are wrong on some rank.
  untold_ = untold_notices(left, wait_peers);
  // Closing the communicator cancels whatever is posted (bounded by the shutdown timeout), so a
  // collective a pool thread is running fails promptly instead of waiting for its deadline.
  if (comm_) comm_->shutdown();
  bool drained = true;
  {
    // Bounded: a future callback (user code) that never returns, or a shutdown called from one,
    // would otherwise hang it for good.
    const auto limit = (comm_ ? comm_->options().shutdown_timeout : std::chrono::milliseconds(0)) +
                       std::chrono::milliseconds(kDrainGrace);
    std::unique_lock<std::mutex> lk(mu_);
    drained = cv_.wait_for(lk, limit, [&] { return servers_ == 0 && waiters_in_ == 0; });
    if (!drained) {
      std::string what;
      for (const Task* r : running_) what += std::string(what.empty() ? "" : ", ") + r->op_name;
      std::fprintf(
          stderr,
          "commux shutdown: the process group (%s) still had %d collective thread(s) and %d "
          "waiting caller(s) inside it %lld ms after it was shut down (running: %s; running "
          "future callbacks: %d). Its state is left in place (not freed) so that they can "
          "finish safely; a future callback that never returns, or a shutdown called from "
          "one, does this.\n",
          where().c_str(), servers_, waiters_in_, static_cast<long long>(limit.count()),
          what.empty() ? "no collective" : what.c_str(), settling_);
      std::fflush(stderr);
    }
  }
  if (gate_) {
    std::lock_guard<std::mutex> lk(gate_->mu);
    gate_->runner = nullptr;  // enter() refuses from here on anyway (stopping_)
  }
  watcher_->stop();  // after comm_->shutdown(): every request has finished
  for (auto& t : left) {
    t->finish(std::make_exception_ptr(
        Error(Errc::kCanceled, std::string("commux ") + t->op_name + ": the process group (" +
                                   where() + ") was shut down before the operation ran")));
  }
  return drained;
}

uint64_t ProcessGroupUCX::Impl::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lk(mu_);
  return collectives_issued_;
}

// --- the collectives' thread (pool.hpp) --------------------------------------------------------

void ProcessGroupUCX::Impl::serve() {
  struct Serving {
    Serving() { t_serving = true; }
    ~Serving() { t_serving = false; }
  } serving;
  bool graced = true;   // waited kServerGrace for a waiter since the last one left (none yet)
  bool polled = false;  // polled spin_ for a next collective since it last had work
  int idle = 0;         // schedule slices in a row in which none was ready
  for (;;) {
    std::shared_ptr<Task> t;
    bool more = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (!settle_.empty()) {  // futures of schedules the progress thread finished, in order
        auto s = std::move(settle_.front());
        settle_.erase(settle_.begin());
        lk.unlock();
        settle_covered(s.first, std::move(s.second));
        continue;
      }
      // Whoever finishes a running task looks at the queue again (this loop, or a waiter's
      // leave()), so a first task that cannot start yet is not left behind.
      if (!queue_.empty() && !stopping_ && can_start_locked(*queue_.front())) {
        t = take_front_locked();
        if (!t->schedulable) ++servers_running_;
        more = needs_server_locked();  // the next one may run beside it (COMMUX_INFLIGHT)
      } else if (!scheduled_.empty() && !progress_resumes_) {
        // A waiter resumes the schedules: stay off the CPU while one does, and for a moment
        // after it leaves (a caller waiting for several Works in turn comes back at once).
        if (drivers_ > 0 || !graced) {
          graced = drivers_ == 0;
          // Slices (1 ms, then 10 ms) while a waiter drives, as a driver's own: one waiting
          // seconds for a late rank keeps this thread nearly asleep.
          idle = drivers_ > 0 ? idle + 1 : 0;
          server_asleep_ = true;
          serve_cv_.wait_for(lk, drivers_ > 0 ? schedule_slice(idle) : kServerGrace);
          server_asleep_ = false;
          continue;
        }
      } else if (!polled && spin_.count() > 0) {
        // Back-to-back collectives (a training step's buckets, a benchmark loop) arrive within
        // microseconds: poll for the next one briefly before letting the thread go.
        // (One the caller starts as a schedule is never queued: watch the arrivals too.)
        polled = true;
        const std::uint64_t seen = arrivals_.load(std::memory_order_acquire);
        lk.unlock();
        const auto until = Clock::now() + spin_;
        while (queued_.load(std::memory_order_acquire) == 0 &&
               arrivals_.load(std::memory_order_acquire) == seen && Clock::now() < until) {
          std::this_thread::yield();
        }
        continue;
      } else {
        --servers_;        // the next enqueue or finished task submits this group again
        cv_.notify_all();  // shutdown() may be waiting; nothing of *this is touched after
        return;
      }
    }
    polled = false;
    if (more) c10d_detail::CollectivePool::instance().submit(this);
    if (t == nullptr) {
      // Nobody waits: run the first listed schedule to its end here, in start order (every
      // rank's pool thread runs the same one, so the earliest unfinished always advances), as
      // a collective thread ran one before. Stepping all of them from this thread's sleeps
      // took 1.6x as long for 8 async 256 KiB all_reduces waited through their futures.
      std::shared_ptr<Task> first;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (progress_resumes_) continue;  // (it was taken for a start that another made)
        for (const auto& s : scheduled_) {
          if (!s->sched->done()) {
            first = s;
            break;
          }
        }
      }
      if (first == nullptr) continue;
      // (Only the thread that marks it runs it to its end: another pool thread of the group may
      // be running it so already.)
      bool marked = false;
      if (first->pool_runs.compare_exchange_strong(marked, true, std::memory_order_acq_rel)) {
        if (first->sched->run_to_end()) {
          complete_schedule(first);
          idle = 0;
          continue;
        }
        first->pool_runs.store(false, std::memory_order_release);  // a waiter runs a step of it
      }
      // Another thread runs the first one (a waiter's step, or another pool thread to its end,
      // which may wait there for a peer that waits for a later one of these): step the later
      // ones that are ready, as a waiter does, rather than spin until the first one ends. Two
      // pool threads of a group with 2 schedules in flight (COMMUX_INFLIGHT=2) and 8 futures
      // waited in turn deadlocked until the call's timeout without this: each rank's first
      // thread ran a different collective to its end, and the second only yielded.
      idle = resume_schedules() ? 0 : idle + 1;
      if (idle > 0) await_schedules(schedule_slice(idle));
      continue;
    }
    if (t->schedulable) {
      start_schedule(t);
      continue;
    }
    std::exception_ptr err = execute(*t);
    {
      std::lock_guard<std::mutex> lk(mu_);
      --servers_running_;
      ran_locked(*t);
    }
    // Outside the group's lock and no longer marked running: a future callback that issues and
    // waits for another collective of the group can run it, even one that overlaps this one.
    settle_covered(t, t->finish(err, /*settle_here=*/false));
  }
}

// --- schedules ----------------------------------------------------------------------------------

void ProcessGroupUCX::Impl::start_schedule(const std::shared_ptr<Task>& t) {
  scheduled_calls_.fetch_add(1, std::memory_order_relaxed);
  Task* const tp = t.get();
  std::unique_ptr<coll::Schedule> sched;
  try {
    sched = std::make_unique<coll::Schedule>([this, tp] { tp->sched_error = execute(*tp); });
  } catch (...) {  // no stack for it (nothing was posted): the Work fails saying so
    {
      std::lock_guard<std::mutex> lk(mu_);
      ran_locked(*t);
    }
    // (Its flight-recorder entry says so too, rather than "running" or "issued" for good.)
    t->finish(recorder_->finished(t->tag, std::current_exception()));
    return;
  }
  const bool done = sched->done();
  {
    std::lock_guard<std::mutex> lk(mu_);
    t->sched = std::move(sched);
    if (!done) {
      scheduled_.push_back(t);
      listed_.store(scheduled_.size(), std::memory_order_release);
    }
  }
  if (done) complete_schedule(t);
}

std::chrono::microseconds ProcessGroupUCX::Impl::schedule_slice(int idle) {
  // While nothing has been ready for a while (a late rank), wake up less often: each wake-up
  // costs CPU that the ranks being waited for may need.
  return idle < kSlicesBeforeIdle ? kScheduleSlice : kIdleSlice;
}

bool ProcessGroupUCX::Impl::resume_schedules() {
  std::shared_ptr<Task> ready[kMaxInflight];  // scheduled_ holds at most sched_limit_ <= 64
  std::size_t n = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& t : scheduled_) {
      if (n < kMaxInflight && t->sched->ready()) ready[n++] = t;
    }
  }
  bool any = false;
  for (std::size_t i = 0; i < n; ++i) {
    const bool finished = ready[i]->sched->test();
    // (Still ready and not finished: another thread is running a step of it.)
    any = any || finished || !ready[i]->sched->ready();
    if (finished) complete_schedule(ready[i]);
  }
  return any;
}

void ProcessGroupUCX::Impl::await_schedules(std::chrono::microseconds max) {
  std::shared_ptr<Task> first;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& t : scheduled_) {
      if (!t->sched->done() && !t->sched->ready()) {
        first = t;
        break;
      }
    }
  }
  if (first == nullptr) {
    std::this_thread::yield();  // each is ready or being resumed by another thread
    return;
  }
  first->sched->await(max);
}

void ProcessGroupUCX::Impl::complete_schedule(const std::shared_ptr<Task>& t) {
  if (t->completing.exchange(true, std::memory_order_acq_rel)) return;
  bool submit = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = std::find(scheduled_.begin(), scheduled_.end(), t);
    if (it != scheduled_.end()) scheduled_.erase(it);
    listed_.store(scheduled_.size(), std::memory_order_release);
    ran_locked(*t);
    submit = needs_server_locked();  // what waited for it may start now
    if (server_asleep_ && scheduled_.empty()) serve_cv_.notify_all();
    cv_.notify_all();
  }
  if (submit) c10d_detail::CollectivePool::instance().submit(this);
  if (t_serving) {
    settle_covered(t, t->finish(t->sched_error, /*settle_here=*/false));
    return;
  }
  if (!t_driving) {  // a waiter's thread
    t->finish(t->sched_error);
    return;
  }
  // On the progress thread: the waiters are woken here, the future's callbacks run on a pool
  // thread.
  auto f = t->finish(t->sched_error, /*settle_here=*/false);
  if (!f) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    settle_.emplace_back(t, std::move(f));
    submit = needs_server_locked();
  }
  if (submit) c10d_detail::CollectivePool::instance().submit(this);
}

void ProcessGroupUCX::Impl::settle_covered(const std::shared_ptr<Task>& t,
                                           c10::intrusive_ptr<c10::ivalue::Future> f) {
  if (!f) return;
  bool another = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++servers_running_;
    another = needs_server_locked();
  }
  if (another) c10d_detail::CollectivePool::instance().submit(this);
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++settling_;
  }
  t->settle(*f);
  std::lock_guard<std::mutex> lk(mu_);
  --settling_;
  --servers_running_;
}

// --- the progress thread resumes schedules (COMMUX_PROGRESS_RESUMES) ----------------------------

bool ProcessGroupUCX::Impl::drive() noexcept {
  if (listed_.load(std::memory_order_acquire) == 0 && queued_.load(std::memory_order_acquire) == 0)
    return false;
  t_driving = true;
  try {
    for (int round = 0; round < 4; ++round) {
      // Start the queued CPU collectives that may start now (those issued while others ran), in
      // issue order, up to the first that may not.
      for (;;) {
        std::shared_ptr<Task> t;
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (!progress_resumes_ || stopping_ || queue_.empty() || !queue_.front()->schedulable ||
              !can_start_locked(*queue_.front()))
            break;
          t = take_front_locked();
        }
        start_schedule(t);
      }
      // Resume the ready ones; one that finishes may let a queued one start.
      if (!resume_schedules() || queued_.load(std::memory_order_acquire) == 0) break;
    }
  } catch (const std::exception& e) {  // (start_schedule and resume_schedules do not throw)
    COMMUX_LOG(kWarn, rank_, "commux: resuming the collectives of group '", group_name_,
               "' on the progress thread failed: ", e.what());
  } catch (...) {
    COMMUX_LOG(kWarn, rank_, "commux: resuming the collectives of group '", group_name_,
               "' on the progress thread failed");
  }
  t_driving = false;
  return listed_.load(std::memory_order_acquire) > 0;
}

std::exception_ptr ProcessGroupUCX::Impl::execute(Task& t) {
  std::exception_ptr err;
  if (!t.started_at_issue) recorder_->started(t.tag);
  try {
    if (any_dead_.load(std::memory_order_acquire)) drain_dead(t.tag);
    if (any_root_calls_.load(std::memory_order_acquire)) check_root_calls(t.tag, t.op_name);
    if (size_ > 1 && notice_look_due()) check_notices(t.tag, t.op_name);
    run(t);
  } catch (...) {
    err = std::current_exception();
    note_dead(t.tag, t.ntags);
  }
  if (err) {
    // The call may have failed leaving transfers posted that still read from or write into its
    // tensors (a peer's late receive of a timed-out call's send read freed memory here, and
    // crashed): they are handed to those transfers, and freed once they have finished.
    struct Kept {
      std::vector<at::Tensor> keep_alive, outputs;
      Body body;
    };
    c10d_detail::hold_for(call(t.tag, t.ntags),
                          std::make_shared<const Kept>(
                              Kept{std::move(t.keep_alive), t.outputs, std::move(t.body)}));
  }
  err = recorder_->finished(t.tag, err);  // a timeout gets the hang report
  t.body = nullptr;
  t.keep_alive.clear();
  return err;
}

std::shared_ptr<Task> ProcessGroupUCX::Impl::take_front_locked() {
  std::shared_ptr<Task> t = std::move(queue_.front());
  queue_.pop_front();
  queued_.fetch_sub(1, std::memory_order_release);
  t->taken = true;
  if (!running_.empty()) concurrent_.fetch_add(1, std::memory_order_relaxed);
  running_.push_back(t.get());
  return t;
}

void ProcessGroupUCX::Impl::ran_locked(const Task& t) {
  running_.erase(std::find(running_.begin(), running_.end(), &t));
}

bool ProcessGroupUCX::Impl::can_start_locked(const Task& t) const {
  if (running_.empty()) return true;
  if (t.alone || static_cast<int>(running_.size()) >= (t.schedulable ? sched_limit_ : inflight_))
    return false;
  std::size_t bytes = t.bytes;
  for (const Task* r : running_) {
    bytes += r->bytes;
    if (r->alone) return false;
    for (const auto& a : r->spans) {
      for (const auto& b : t.spans) {
        if (a.first < b.second && b.first < a.second) return false;
      }
    }
  }
  return !t.schedulable || sched_bytes_ == 0 || bytes <= sched_bytes_;
}

bool ProcessGroupUCX::Impl::needs_server_locked() {
  if (servers_ > servers_running_) return false;  // a pool thread between tasks takes it
  // While the progress thread resumes schedules, it also starts the CPU ones that may start.
  // (Past the line above every server is running something: a blocking collective, which never
  // runs beside a schedule, or a future's callbacks, which may wait for a listed schedule.)
  const bool drive = !scheduled_.empty() && !progress_resumes_;
  bool start = !stopping_ && !queue_.empty() && can_start_locked(*queue_.front());
  if (start && progress_resumes_ && queue_.front()->schedulable) {
    commux::detail::channel(*comm_).wake_driver();
    start = false;
  }
  const bool settle = !settle_.empty();
  if (!drive && !start && !settle) return false;
  ++servers_;
  return true;
}

// --- a waiter runs its collective (CollWork::wait) ----------------------------------------------

bool ProcessGroupUCX::Impl::enter() {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_) return false;
  ++waiters_in_;
  return true;
}

bool ProcessGroupUCX::Impl::leave_locked() {
  // The progress thread resumes what this thread leaves suspended: if it sleeps, wake it
  // (it would otherwise notice the schedules' requests only at the end of its sleep).
  if (progress_resumes_ && !scheduled_.empty()) commux::detail::channel(*comm_).wake_driver();
  --waiters_in_;
  const bool submit = needs_server_locked();
  cv_.notify_all();  // shutdown() may be waiting; nothing of *this is touched after
  return submit;
}

void ProcessGroupUCX::Impl::leave() {
  bool submit = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    submit = leave_locked();
  }
  if (submit) c10d_detail::CollectivePool::instance().submit(this);
}

void ProcessGroupUCX::Impl::run_through(const std::shared_ptr<Task>& target,
                                        Clock::time_point until, bool may_block) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++drivers_;
  }
  struct Driving {
    Impl* g;
    ~Driving() {
      // (A pool thread asleep for this waiter looks again within kScheduleSlice: waking it at
      // once would cost a context switch between the Works a caller waits for in turn.)
      std::lock_guard<std::mutex> lk(g->mu_);
      --g->drivers_;
    }
  } driving{this};
  const bool interruptible = c10d_detail::interruptible();
  auto next_interrupt_check = Clock::now() + c10d_detail::kInterruptPoll;
  int idle = 0;  // schedule slices in a row in which none was ready
  for (;;) {
    if (target->finished.load(std::memory_order_acquire)) return;
    // A pool thread runs it to its end: wait for that (CollWork::wait sleeps on the Task).
    if (target->pool_runs.load(std::memory_order_acquire)) return;
    std::shared_ptr<Task> t;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      // Device collectives keep to the collective thread (they wait for the issuing stream there).
      const bool startable = !target->taken && !queue_.empty() && queue_.front()->device.is_cpu() &&
                             (queue_.front()->schedulable || may_block) &&
                             can_start_locked(*queue_.front());
      if (startable) {
        t = take_front_locked();
      } else if (scheduled_.empty() && (!target->taken || !target->schedulable)) {
        return;  // nothing this thread can do for it: the collective threads run it
      }
    }
    if (t != nullptr) {
      if (t->schedulable) {
        start_schedule(t);
      } else {
        run_blocking(t);
      }
      continue;
    }
    idle = resume_schedules() ? 0 : idle + 1;
    if (target->finished.load(std::memory_order_acquire)) return;
    const auto now = Clock::now();
    if (now >= until) return;
    if (idle > 0) {
      await_schedules(std::min<std::chrono::microseconds>(
          schedule_slice(idle),
          std::chrono::duration_cast<std::chrono::microseconds>(until - now)));
    }
    // Ctrl-C: the KeyboardInterrupt leaves the schedules to the collective thread.
    if (interruptible && now >= next_interrupt_check) {
      next_interrupt_check = now + c10d_detail::kInterruptPoll;
      c10d_detail::check_interrupt();
    }
  }
}

void ProcessGroupUCX::Impl::run_blocking(const std::shared_ptr<Task>& t) {
  const auto interrupts = c10d_detail::interrupts_raised();
  caller_ran_.fetch_add(1, std::memory_order_relaxed);
  std::exception_ptr err = execute(*t);
  const bool interrupted = err && c10d_detail::interrupts_raised() != interrupts;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ran_locked(*t);
  }
  if (interrupted) {
    // Ctrl-C stopped this collective (Context::poll): the other ranks were told; the Work fails
    // as canceled, and the interrupt itself goes to the waiter.
    t->finish(std::make_exception_ptr(Error(
        Errc::kCanceled, std::string("commux ") + t->op_name + ": interrupted on this rank (" +
                             where() + ") while it ran; the other ranks were told")));
    std::rethrow_exception(err);
  }
  t->finish(err);
}

// Runs a task's body on the group's pool thread. A device collective first waits for the issuing
// stream's work on its tensors (the fence), runs with the backend's stream of that device current
// (so the body's ATen work and the collective's reductions go there), and synchronizes that stream
// before the task completes, so the results are visible to every stream after wait().
void ProcessGroupUCX::Impl::run(Task& t) {
  if (t.device.is_cpu()) {
    t.body(t.tag, t.deadline);
    return;
  }
  t.fence.wait(t.deadline, t.op_name);
  streams_->record(t.keep_alive);
  streams_->record(t.outputs);
  c10::StreamGuard g(streams_->stream(t.device));
  t.body(t.tag, t.deadline);
  streams_->sync(t.device);
}

std::chrono::milliseconds ProcessGroupUCX::Impl::effective(
    std::chrono::milliseconds op_timeout) const {
  return op_timeout.count() > 0 ? op_timeout : timeout_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::run_now(
    c10d::OpType type, const char* op_name, std::chrono::milliseconds op_timeout,
    std::vector<at::Tensor>& keep_alive, std::vector<at::Tensor>& outputs, Body& body,
    std::uint32_t ntags, int root) {
  Task t;
  const auto limit = effective(op_timeout);
  const auto issued_at = Clock::now();
  std::size_t bytes = 0;
  for (const auto& o : outputs) bytes += nbytes(o);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) {
      invalid(op_name, "the process group has been shut down");
    }
    if (!queue_.empty() || !running_.empty()) return {};
    // What running_'s readers (can_start_locked, check_notices, shutdown) read of it, set before
    // it is listed. Nothing starts beside it (alone): its spans are never filled.
    t.op_name = op_name;
    t.type = type;
    t.tag = next_tag_;
    t.ntags = ntags;
    t.alone = true;
    t.started_at_issue = true;
    next_tag_ += ntags;
    ++collectives_issued_;
    arrivals_.fetch_add(1, std::memory_order_release);
    recorder_->issued(t.tag, op_name, bytes, root, issued_at, true);
    running_.push_back(&t);
    ++waiters_in_;  // enter()
  }
  // Unlisted, and the group told, on every way out (before `t` goes).
  struct Ran {
    Impl* g;
    Task* t;
    ~Ran() { g->ran_now(*t); }
  } ran{this, &t};
  t.deadline = issued_at + limit;
  t.keep_alive = std::move(keep_alive);
  t.outputs = std::move(outputs);
  t.body = std::move(body);
  const auto interrupts = c10d_detail::interrupts_raised();
  caller_ran_.fetch_add(1, std::memory_order_relaxed);
  const std::exception_ptr err = execute(t);
  if (!err) {
    return c10::make_intrusive<c10d_detail::DoneWork>(getRank(), type, op_name,
                                                      std::move(t.outputs));
  }
  // Ctrl-C stopped it (Context::poll): the other ranks were told, and the interrupt goes to the
  // caller (no Work is returned).
  if (c10d_detail::interrupts_raised() != interrupts) std::rethrow_exception(err);
  // Failed: a finished Task for the Work, which reports the failure as the queued path's does.
  auto f = std::make_shared<Task>();
  f->op_name = op_name;
  f->type = type;
  f->tag = t.tag;
  f->ntags = ntags;
  f->deadline = t.deadline;
  f->outputs = t.outputs;
  f->finish(err);
  return c10::make_intrusive<CollWork>(getRank(), std::move(f), limit, where_);
}

void ProcessGroupUCX::Impl::ran_now(const Task& t) {
  bool submit = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ran_locked(t);
    submit = leave_locked();  // (another thread may have queued collectives meanwhile)
  }
  if (submit) c10d_detail::CollectivePool::instance().submit(this);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::enqueue(
    c10d::OpType type, const char* op_name, std::chrono::milliseconds op_timeout, bool async_op,
    std::vector<at::Tensor> keep_alive, std::vector<at::Tensor> outputs, Body body,
    std::uint32_t ntags, int root) {
  // A blocking CPU call (outside a coalescing window, whose Works report their outputs later) with
  // nothing of the group queued or running: run_now() runs it at once.
  if (!async_op && caller_runs_ && open_windows_.load(std::memory_order_acquire) == 0) {
    bool cpu = true;
    for (const auto* list : {&outputs, &keep_alive}) {
      for (const auto& x : *list) cpu = cpu && !on_device(x);
    }
    if (cpu) {
      auto w = run_now(type, op_name, op_timeout, keep_alive, outputs, body, ntags, root);
      if (w) return w;
    }
  }
  auto t = std::make_shared<Task>();
  t->op_name = op_name;
  t->type = type;
  const auto limit = effective(op_timeout);
  const auto issued_at = Clock::now();  // also the flight recorder's time of issue
  t->deadline = issued_at + limit;
  t->keep_alive = std::move(keep_alive);
  t->outputs = std::move(outputs);
  t->body = std::move(body);
  // A collective's tensors share one device (validated); on a device, fence the issuing stream.
  for (const auto* list : {&t->outputs, &t->keep_alive}) {
    for (const auto& x : *list) {
      if (on_device(x)) t->device = x.device();
    }
  }
  if (!t->device.is_cpu()) {
    std::vector<at::Tensor> all = t->outputs;
    all.insert(all.end(), t->keep_alive.begin(), t->keep_alive.end());
    t->fence = StreamFence(all);
  }
  // Which collectives it may run beside (COMMUX_INFLIGHT): the memory of its tensors.
  t->alone = type == c10d::OpType::BARRIER || !t->device.is_cpu() || aten_on_cpu_ ||
             (t->outputs.empty() && t->keep_alive.empty());
  for (const auto* list : {&t->outputs, &t->keep_alive}) {
    for (const auto& x : *list) {
      if (!x.defined() || x.numel() == 0) continue;
      if (x.layout() != c10::kStrided || !x.device().is_cpu()) {
        t->alone = true;
        continue;
      }
      t->spans.push_back(c10d_detail::byte_span(x));
    }
  }
  // A CPU collective runs as a schedule once started (unless a caller runs it blocking, below);
  // device and sparse ones (alone), and COMMUX_ATEN_REDUCE's, keep to a thread. A barrier is
  // alone only in that nothing starts beside it.
  t->schedulable = schedules_ && !aten_on_cpu_ && t->device.is_cpu() &&
                   (!t->alone || type == c10d::OpType::BARRIER);
  // Only a short collective's waiter polls for the result; a long one would take CPU from the
  // worker and the peers for nothing.
  std::size_t bytes = 0;
  for (const auto& o : t->outputs) bytes += nbytes(o);
  // (A schedule's byte window counts what it moves: the larger of its outputs and its inputs,
  // so that a reduce_scatter counts its input. Only schedules read it.)
  if (t->schedulable) {
    std::size_t in_bytes = 0;
    for (const auto& x : t->keep_alive) in_bytes += nbytes(x);
    t->bytes = std::max(bytes, in_bytes);
  }
  const bool small = bytes <= kSpinWaitBytes;
  bool submit = false;
  bool here = false;
  bool sched = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) {
      invalid(op_name, "the process group has been shut down");
    }
    t->tag = next_tag_;
    t->ntags = ntags;
    next_tag_ += ntags;
    ++collectives_issued_;
    t->spin = small ? spin_ : std::chrono::microseconds(0);
    if (caller_runs_) t->gate = gate_;
    queue_.push_back(t);
    queued_.fetch_add(1, std::memory_order_release);
    arrivals_.fetch_add(1, std::memory_order_release);
    // A blocking call with nothing queued before it that may start now (beside what runs, up to
    // COMMUX_INFLIGHT) runs here; else a pool thread takes it, unless one between tasks will, or
    // it cannot start yet (whoever finishes a running task looks again).
    // An async one that may start now starts here as a schedule: its first step is posted before
    // this call returns, and later steps run on whichever thread resumes it.
    const bool now = queue_.size() == 1 && can_start_locked(*t);
    here = now && !async_op && caller_runs_ && t->device.is_cpu();
    sched = now && async_op && t->schedulable;
    t->started_at_issue = here || sched;
    recorder_->issued(t->tag, op_name, bytes, root, issued_at, t->started_at_issue);
    if (here || sched) {
      take_front_locked();
      ++waiters_in_;  // enter()
    }
    if (!here && !sched && server_asleep_) serve_cv_.notify_all();  // it may start this one
    submit = !here && !sched && needs_server_locked();
  }
  if (submit) c10d_detail::CollectivePool::instance().submit(this);
  if (here || sched) {
    struct Leave {
      Impl* g;
      ~Leave() { g->leave(); }  // submits the group if anything is left queued or scheduled
    } leave{this};
    if (here) {
      run_blocking(t);
      // torch's Python waits for this Work and drops it; its outputs are the caller's tensors
      // (work.hpp, Task::weak_outputs). A coalescing window's Works report them later.
      if (!t->error && open_windows_.load(std::memory_order_acquire) == 0) t->release_outputs();
    } else {
      start_schedule(t);
    }
  }
  return track(c10::make_intrusive<CollWork>(getRank(), std::move(t), limit, where_));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::track(c10::intrusive_ptr<c10d::Work> work) {
  if (open_windows_.load(std::memory_order_acquire) == 0) return work;  // the p2p fast path
  std::lock_guard<std::mutex> lk(coalesce_mu_);
  const auto me = std::this_thread::get_id();
  for (auto& w : windows_) {
    if (w.thread == me) w.works.push_back(work);
  }
  return work;
}

coll::Context ProcessGroupUCX::Impl::context(const char* op_name, std::uint32_t tag,
                                             Clock::time_point deadline, const at::Tensor& like) {
  coll::Context c;
  c.comm = comm_.get();
  c.tag = tag;
  c.deadline = deadline;
  c.op_name = op_name;
  c.mem = MemoryType::kHost;
  // Run by a waiter on Python's main thread (CollWork::wait): Ctrl-C stops it.
  // (Not a schedule: Ctrl-C leaves an async collective running, and its waiter raises it.)
  if (c10d_detail::interruptible() && !coll::Schedule::running()) {
    c.poll = &c10d_detail::poll_interrupt;
  }
  if (like.defined()) {
    // Every rank's tensors of a collective have one dtype: part of the call's fingerprint, and
    // with the element count how errors describe the call ("1000 float32").
    // (Formatted when it changes: a loop of calls of one shape formats it once. It was a tenth of
    // the backend's instructions of a blocking 8-byte all_reduce.)
    struct Text {
      std::int64_t numel = -1;
      c10::ScalarType type = c10::ScalarType::Undefined;
      std::string text;
    };
    thread_local Text last;
    if (last.numel != like.numel() || last.type != like.scalar_type()) {
      last.text = std::to_string(like.numel()) + " " + c10d_detail::dtype_text(like.scalar_type());
      last.numel = like.numel();
      last.type = like.scalar_type();
    }
    c.call_key = static_cast<std::uint64_t>(like.scalar_type()) + 1;
    c.call_text = last.text.c_str();
  }
  if (on_device(like)) {
    // Reductions, scratch and local copies stay on the device, on the backend's stream.
    c.mem = memory_type_of(op_name, like, "tensor");
    c.device = streams_->ops(like.device());
  } else if (aten_on_cpu_ && like.defined()) {
    c.device = streams_->ops(like.device());
  }
  if (c.device != nullptr) device_ops_calls_.fetch_add(1, std::memory_order_relaxed);
  return c;
}

namespace {
// What a collective cannot see of a reduction (AVG divides and PREMUL_SUM scales around a SUM):
// part of the call's fingerprint and description, so ranks that disagree (AVG on one, SUM on
// another) fail instead of returning different results.
coll::Context reducing(coll::Context c, const Reduction& r) {
  const std::uint64_t kind = (r.average ? 1u : 0u) | (r.premul ? 2u : 0u);
  if (kind == 0) return c;
  c.call_key ^= kind << 40;
  thread_local std::string text;
  text = std::string(c.call_text != nullptr ? c.call_text : "") +
         (r.average ? ", averaged" : ", premultiplied");
  c.call_text = text.c_str();
  return c;
}
}  // namespace

// --- point-to-point -----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::post_p2p(c10d::OpType type,
                                                               const char* op_name,
                                                               std::vector<at::Tensor>& tensors,
                                                               int peer, int tag) {
  c10d_detail::check_p2p(op_name, tensors, peer, getSize(), type == c10d::OpType::SEND, tag);
  if (defer_in_window_ && open_windows_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lk(coalesce_mu_);
    const auto me = std::this_thread::get_id();
    for (auto& w : windows_) {
      if (w.thread != me) continue;
      auto d = c10::make_intrusive<DeferredWork>(getRank(), type, op_name, tensors);
      w.deferred.push_back(Deferred{type, tensors, peer, tag, d});
      w.works.push_back(d);
      return d;
    }
  }
  return track(post_now(type, tensors, peer, tag));
}

c10::intrusive_ptr<P2PWork> ProcessGroupUCX::Impl::post_now(c10d::OpType type,
                                                            const std::vector<at::Tensor>& tensors,
                                                            int peer, int tag) {
  Buffer bufs[8];
  std::vector<Buffer> many;
  Buffer* b = bufs;
  if (tensors.size() > 8) {
    many.resize(tensors.size());
    b = many.data();
  }
  const char* op = type == c10d::OpType::SEND ? "send" : "recv";
  bool device = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    b[i] =
        Buffer{tensors[i].data_ptr(), nbytes(tensors[i]), memory_type_of(op, tensors[i], "tensor")};
    device = device || b[i].mem != MemoryType::kHost;
  }
  Request r;
  try {
    // UCX reads (or overwrites) the tensors once posted: the work queued on their streams before
    // this call must be complete first. With work still queued the post is held back in core
    // behind an event on each stream, and this returns at once; core posts it when the events
    // have fired, after the group's earlier point-to-point posts and before its later ones.
    auto& ch = commux::detail::channel(*comm_);
    const auto dir = type == c10d::OpType::SEND ? commux::detail::Direction::kSend
                                                : commux::detail::Direction::kRecv;
    StreamFence fence;
    if (device) fence = StreamFence(tensors);
    // A small host message the transport takes inside the call is sent, and one from a given
    // peer that is there already is received: the Work comes finished (no Op, no Request to post
    // and complete, nothing for the watcher). Device memory is always posted.
    r = fence.empty() ? ch.move_or_post(dir, op, b, tensors.size(), peer, TagKind::kUser,
                                        static_cast<std::uint32_t>(tag), type == c10d::OpType::SEND)
                      : ch.post_after(c10d_detail::fence_gate(std::move(fence)), dir, op, b,
                                      tensors.size(), peer, TagKind::kUser,
                                      static_cast<std::uint32_t>(tag), type == c10d::OpType::SEND);
  } catch (...) {
    c10d_detail::throw_torch_error(std::current_exception());
  }
  // A receive must be filled exactly: torch cannot report a shorter message's length.
  auto w = c10::make_intrusive<P2PWork>(getRank(), type, std::move(r), tensors, timeout_,
                                        comm_->options().shutdown_timeout,
                                        type == c10d::OpType::SEND ? nullptr : where_, tag);
  keep_until_done(w);
  return w;
}

void ProcessGroupUCX::Impl::keep_until_done(const c10::intrusive_ptr<P2PWork>& w) {
  if (w->done()) return;
  w->set_watcher(watcher_);
  watcher_->track(w);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::send(std::vector<at::Tensor>& tensors,
                                                           int dstRank, int tag) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return post_p2p(c10d::OpType::SEND, "send", tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::recv(std::vector<at::Tensor>& tensors,
                                                           int srcRank, int tag) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return post_p2p(c10d::OpType::RECV, "recv", tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::recvAnysource(
    std::vector<at::Tensor>& tensors, int tag) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return post_p2p(c10d::OpType::RECVANYSOURCE, "recvAnysource", tensors, kAnySource, tag);
}

// --- coalescing window -------------------------------------------------------------------------

void ProcessGroupUCX::Impl::startCoalescing() {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  std::lock_guard<std::mutex> lk(coalesce_mu_);
  const auto me = std::this_thread::get_id();
  for (auto& w : windows_) {
    if (w.thread == me)
      invalid("startCoalescing", "a coalescing window is already open on this thread");
  }
  windows_.push_back(Window{me, {}, {}});
  open_windows_.fetch_add(1, std::memory_order_release);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::endCoalescing() {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  Window win;
  {
    std::lock_guard<std::mutex> lk(coalesce_mu_);
    const auto me = std::this_thread::get_id();
    auto it = std::find_if(windows_.begin(), windows_.end(),
                           [&](const Window& w) { return w.thread == me; });
    if (it == windows_.end())
      invalid("endCoalescing", "no coalescing window is open on this thread");
    win = std::move(*it);
    windows_.erase(it);
    open_windows_.fetch_sub(1, std::memory_order_release);
  }
  // COMMUX_GROUP: post the deferred ops, receives first, each kind in issue order (the order in
  // which same-tag messages from one sender match is kept). A post that fails fails its own Work;
  // the window's Work reports it.
  for (const bool receives : {true, false}) {
    for (auto& d : win.deferred) {
      if ((d.type == c10d::OpType::SEND) == receives) continue;
      try {
        d.work->bind(post_now(d.type, d.tensors, d.peer, d.tag));
      } catch (...) {
        d.work->fail(std::current_exception());
      }
    }
  }
  return c10::make_intrusive<CoalescedWork>(getRank(), std::move(win.works));
}

// --- collectives --------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::barrier(const c10d::BarrierOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  return enqueue(c10d::OpType::BARRIER, "barrier", opts.timeout, opts.asyncOp, {}, {},
                 [this](std::uint32_t tag, Clock::time_point dl) {
                   coll::barrier(context("barrier", tag, dl, at::Tensor()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::broadcast(
    std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const at::Tensor t = single("broadcast", tensors);
  check_root("broadcast", opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(
      c10d::OpType::BROADCAST, "broadcast", opts.timeout, opts.asyncOp, {}, tensors,
      [this, t, root](std::uint32_t tag, Clock::time_point dl) {
        coll::broadcast(context("broadcast", tag, dl, t), t.data_ptr(), nbytes(t), root);
        if (root == getRank() && getSize() > 1) note_root_call(tag, "broadcast", 0, 3);
      },
      1, root);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::allreduce(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  if (!tensors.empty() && tensors[0].defined() && tensors[0].is_sparse()) {
    return allreduce_sparse(tensors, opts);  // sparse_allreduce.cpp
  }
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  at::Tensor t = single("allreduce", tensors);
  const Reduction r = to_reduction("allreduce", opts.reduceOp, t.scalar_type());
  const DataType dt = to_dtype("allreduce", t.scalar_type());
  const int size = getSize();
  return enqueue(c10d::OpType::ALLREDUCE, "allreduce", opts.timeout, opts.asyncOp, {}, tensors,
                 [this, t, r, dt, size](std::uint32_t tag, Clock::time_point dl) mutable {
                   apply_scale(t, r.pre_scale);
                   coll::allreduce(reducing(context("allreduce", tag, dl, t), r), t.data_ptr(),
                                   t.numel(), dt, r.op);
                   if (r.average) apply_average(t, size);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allreduce_coalesced";
  c10d_detail::check_coalesced(op, tensors);
  to_reduction(op, opts.reduceOp, tensors[0].scalar_type());  // validate now, on every rank
  std::vector<at::Tensor> ts = tensors;
  std::vector<std::size_t> each;
  int64_t count = 0;
  for (const auto& t : ts) {
    each.push_back(nbytes(t));
    count += t.numel();
  }
  const int size = getSize();
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, op, opts.timeout, opts.asyncOp, {}, tensors,
                 [this, ts, each, count, op, opts, size](std::uint32_t tag, Clock::time_point dl) {
                   const Reduction red = to_reduction(op, opts.reduceOp, ts[0].scalar_type());
                   // One allreduce over the tensors back to back: their own memory where they are, else
                   // staged (list_buffer.hpp).
                   ListBuffer buf(call(tag), ts, each, ts[0], nullptr, 0);
                   buf.pack();
                   // A view of the buffer: scaled in place, and how errors describe the call.
                   at::Tensor flat =
                       count > 0 ? at::from_blob(buf.data(), {count}, ts[0].options()) : ts[0];
                   apply_scale(flat, red.pre_scale);
                   coll::allreduce(reducing(context(op, tag, dl, flat), red), buf.data(),
                                   static_cast<std::size_t>(count),
                                   to_dtype(op, ts[0].scalar_type()), red.op);
                   if (red.average) apply_average(flat, size);
                   buf.unpack();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::reduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::ReduceOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  at::Tensor t = single("reduce", tensors);
  check_root("reduce", opts.rootRank, getSize());
  const Reduction r = to_reduction("reduce", opts.reduceOp, t.scalar_type());
  const DataType dt = to_dtype("reduce", t.scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  const int size = getSize();
  const bool is_root = getRank() == root;
  return enqueue(
      c10d::OpType::REDUCE, "reduce", opts.timeout, opts.asyncOp, {}, tensors,
      [this, t, r, dt, root, size, is_root](std::uint32_t tag, Clock::time_point dl) {
        // coll::reduce only reads a non-root's buffer; a pre-scale needs a copy.
        c10d_detail::HeldOnFailure held(call(tag));
        at::Tensor buf = held(is_root || r.pre_scale == 1.0 ? t : t.clone());
        apply_scale(buf, r.pre_scale);
        coll::reduce(reducing(context("reduce", tag, dl, buf), r), buf.data_ptr(), buf.numel(), dt,
                     r.op, root);
        if (is_root && r.average) apply_average(buf, size);
        if (!is_root) note_root_call(tag, "reduce", 1, 1);
      },
      1, root);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allgather";
  const at::Tensor in = single(op, inputs);
  c10d_detail::check_allgather_outputs(op, outputs, in, getSize());
  std::vector<at::Tensor> outs = outputs[0];
  std::vector<std::size_t> each(outs.size(), nbytes(in));
  const int rank = getRank();
  return enqueue(c10d::OpType::ALLGATHER, op, opts.timeout, opts.asyncOp, {in}, outs,
                 [this, in, outs, each, rank, op](std::uint32_t tag, Clock::time_point dl) {
                   ListBuffer out(call(tag), outs, each, in, in.data_ptr(), nbytes(in), rank);
                   coll::allgather(context(op, tag, dl, in), in.data_ptr(), nbytes(in), out.data());
                   out.unpack();
                 });
}

namespace {
// The input of an all_gather (small: its input, big: its output) or a reduce_scatter (small: its
// output, big: its input): itself where it does not overlap the output or `small` is exactly this
// rank's block of `big` (in place, which the algorithms allow), else a copy made when the call
// runs. (A reduce_scatter_tensor whose output was another rank's block
// of its input gave a wrong result at 1 MiB per block, silently.)
at::Tensor unaliased(const at::Tensor& in, const at::Tensor& out, const at::Tensor& small,
                     const at::Tensor& big, int rank) {
  const auto* own = static_cast<const std::byte*>(big.data_ptr()) +
                    static_cast<std::size_t>(rank) * nbytes(small);
  if (small.data_ptr() == own ||
      !c10d_detail::overlaps(in.data_ptr(), nbytes(in), out.data_ptr(), nbytes(out))) {
    return in;
  }
  return in.clone();
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "_allgather_base";
  check_blocks(op, input, "input", output, "output", getSize());
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, op, opts.timeout, opts.asyncOp, {in}, {out},
                 [this, in, out, op](std::uint32_t tag, Clock::time_point dl) {
                   c10d_detail::HeldOnFailure held(call(tag));
                   const at::Tensor& src = held(unaliased(in, out, in, out, getRank()));
                   coll::allgather(context(op, tag, dl, in), src.data_ptr(), nbytes(in),
                                   out.data_ptr());
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allgather_coalesced";
  c10d_detail::check_allgather_coalesced(op, outputs, inputs, getSize());
  std::vector<at::Tensor> outs;
  for (auto& list : outputs) outs.insert(outs.end(), list.begin(), list.end());
  auto ins = inputs;
  auto outlists = outputs;
  const int rank = getRank();
  return enqueue(
      c10d::OpType::ALLGATHER_COALESCED, op, opts.timeout, opts.asyncOp, ins, outs,
      [this, ins, outlists, rank, op](std::uint32_t tag, Clock::time_point dl) {
        std::vector<at::Tensor> column(outlists.size());
        for (std::size_t i = 0; i < ins.size(); ++i) {
          const at::Tensor& in = ins[i];
          for (std::size_t r = 0; r < outlists.size(); ++r) column[r] = outlists[r][i];
          const std::vector<std::size_t> each(column.size(), nbytes(in));
          ListBuffer out(call(tag + i), column, each, in, in.data_ptr(), nbytes(in), rank);
          coll::allgather(context(op, tag + i, dl, in), in.data_ptr(), nbytes(in), out.data());
          out.unpack();
        }
      },
      static_cast<std::uint32_t>(std::max<std::size_t>(1, ins.size())));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "allgather_into_tensor_coalesced";
  c10d_detail::check_blocks_coalesced(op, outputs, inputs, getSize(), /*gather=*/true);
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(
      c10d::OpType::ALLGATHER_COALESCED, op, opts.timeout, opts.asyncOp, ins, outs,
      [this, ins, outs, op](std::uint32_t tag, Clock::time_point dl) {
        for (std::size_t i = 0; i < ins.size(); ++i) {
          coll::allgather(context(op, tag + i, dl, ins[i]), ins[i].data_ptr(), nbytes(ins[i]),
                          outs[i].data_ptr());
        }
      },
      static_cast<std::uint32_t>(std::max<std::size_t>(1, ins.size())));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "gather";
  const at::Tensor in = single(op, inputs);
  check_root(op, opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> outs =
      root_list(op, outputs, in, getRank() == root, root, getSize(), "output");
  const std::vector<std::size_t> each(outs.size(), nbytes(in));
  return enqueue(
      c10d::OpType::GATHER, op, opts.timeout, opts.asyncOp, {in}, outs,
      [this, in, outs, each, root, op](std::uint32_t tag, Clock::time_point dl) {
        std::optional<ListBuffer> out;  // on the root only
        if (!outs.empty()) out.emplace(call(tag), outs, each, in, in.data_ptr(), nbytes(in));
        coll::gather(context(op, tag, dl, in), in.data_ptr(), nbytes(in),
                     out ? out->data() : nullptr, root);
        if (out) out->unpack();
        if (root != getRank()) note_root_call(tag, op, 1, 1);
      },
      1, root);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "scatter";
  const at::Tensor out = single(op, outputs);
  check_root(op, opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  const std::vector<at::Tensor> ins =
      root_list(op, inputs, out, getRank() == root, root, getSize(), "input");
  const std::vector<std::size_t> each(ins.size(), nbytes(out));
  return enqueue(
      c10d::OpType::SCATTER, op, opts.timeout, opts.asyncOp, ins, {out},
      [this, ins, out, each, root, op](std::uint32_t tag, Clock::time_point dl) {
        std::optional<ListBuffer> in;  // on the root only
        if (!ins.empty()) {
          in.emplace(call(tag), ins, each, out, out.data_ptr(), nbytes(out));
          in->pack();
        }
        coll::scatter(context(op, tag, dl, out), in ? in->data() : nullptr, out.data_ptr(),
                      nbytes(out), root);
        if (in) in->done();
        if (root == getRank() && getSize() > 1) note_root_call(tag, op, 0, 3);
      },
      1, root);
}

namespace {
// The reduce-scatter of `in` (size blocks of out's size and dtype, already scaled) into `out`.
void reduce_scatter_into(const coll::Context& ctx, const void* in, at::Tensor out,
                         const Reduction& r, int size) {
  std::vector<std::size_t> counts(size, static_cast<std::size_t>(out.numel()));
  coll::reduce_scatter(ctx, in, out.data_ptr(), counts.data(),
                       to_dtype(ctx.op_name, out.scalar_type()), r.op);
  if (r.average) apply_average(out, size);
}

// The reduce-scatter body shared by the list and the flat-tensor forms: `in` is owned scratch
// where a PREMUL_SUM scales it.
void run_reduce_scatter(const coll::Context& ctx, at::Tensor in, at::Tensor out, const Reduction& r,
                        int size) {
  c10d_detail::HeldOnFailure held(c10d_detail::call_of(ctx));
  held(in);
  apply_scale(in, r.pre_scale);
  reduce_scatter_into(ctx, in.data_ptr(), std::move(out), r, size);
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "reduce_scatter";
  const at::Tensor out = single(op, outputs);
  c10d_detail::check_reduce_scatter_inputs(op, inputs, out, getSize());
  const Reduction r = to_reduction(op, opts.reduceOp, out.scalar_type());
  auto ins = inputs[0];
  const int size = getSize();
  const std::vector<std::size_t> each(ins.size(), nbytes(out));
  return enqueue(
      c10d::OpType::REDUCE_SCATTER, op, opts.timeout, opts.asyncOp, ins, {out},
      [this, ins, out, each, r, size, op](std::uint32_t tag, Clock::time_point dl) {
        if (r.pre_scale != 1.0) {  // PREMUL_SUM: scales a copy
          std::vector<at::Tensor> parts;
          for (auto& i : ins) parts.push_back(i.reshape({-1}));
          run_reduce_scatter(reducing(context(op, tag, dl, out), r), at::cat(parts), out, r, size);
          return;
        }
        ListBuffer in(call(tag), ins, each, out, out.data_ptr(), nbytes(out));
        in.pack();
        reduce_scatter_into(reducing(context(op, tag, dl, out), r), in.data(), out, r, size);
        in.done();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "_reduce_scatter_base";
  check_blocks(op, output, "output", input, "input", getSize());
  const Reduction r = to_reduction(op, opts.reduceOp, output.scalar_type());
  at::Tensor in = input, out = output;
  const int size = getSize();
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, op, opts.timeout, opts.asyncOp, {in}, {out},
                 [this, in, out, r, size, op](std::uint32_t tag, Clock::time_point dl) {
                   // The input is not modified: PREMUL_SUM scales a copy.
                   run_reduce_scatter(reducing(context(op, tag, dl, out), r),
                                      r.pre_scale != 1.0 ? in.clone()
                                                         : unaliased(in, out, out, in, getRank()),
                                      out, r, size);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "reduce_scatter_tensor_coalesced";
  c10d_detail::check_blocks_coalesced(op, outputs, inputs, getSize(), /*gather=*/false);
  std::vector<Reduction> rs;
  for (const auto& o : outputs) rs.push_back(to_reduction(op, opts.reduceOp, o.scalar_type()));
  auto ins = inputs;
  auto outs = outputs;
  const int size = getSize();
  return enqueue(
      torch_compat::kReduceScatterTensorCoalesced, op, opts.timeout, opts.asyncOp, ins, outs,
      [this, ins, outs, rs, size, op](std::uint32_t tag, Clock::time_point dl) {
        for (std::size_t i = 0; i < ins.size(); ++i) {
          run_reduce_scatter(reducing(context(op, tag + i, dl, outs[i]), rs[i]),
                             rs[i].pre_scale != 1.0 ? ins[i].clone() : ins[i], outs[i], rs[i],
                             size);
        }
      },
      static_cast<std::uint32_t>(std::max<std::size_t>(1, ins.size())));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "alltoall_base";
  c10d_detail::check_alltoall_base(op, input, output);
  std::vector<std::size_t> sc, sd, rc, rd;
  c10d_detail::split_bytes(op, "input", input, inputSplitSizes, getSize(), sc, sd);
  c10d_detail::split_bytes(op, "output", output, outputSplitSizes, getSize(), rc, rd);
  at::Tensor in = input, out = output;
  return enqueue(c10d::OpType::ALLTOALL_BASE, op, opts.timeout, opts.asyncOp, {in}, {out},
                 [this, in, out, sc = std::move(sc), sd = std::move(sd), rc = std::move(rc),
                  rd = std::move(rd), op](std::uint32_t tag, Clock::time_point dl) {
                   const std::size_t in_bytes = nbytes(in);
                   if (!c10d_detail::overlaps(in.data_ptr(), in_bytes, out.data_ptr(),
                                              nbytes(out))) {
                     coll::alltoallv(context(op, tag, dl, in), in.data_ptr(), sc.data(), sd.data(),
                                     out.data_ptr(), rc.data(), rd.data());
                     return;
                   }
                   // In place (all_to_all_single(t, t)) or overlapping: the blocks that arrive
                   // would overwrite blocks not yet sent (a rendezvous reads the sender's memory
                   // late), so the input is read from a copy made when the call runs.
                   const std::vector<at::Tensor> ins{in};
                   const std::vector<std::size_t> in_len{in_bytes};
                   ListBuffer send(call(tag), ins, in_len, in, out.data_ptr(), nbytes(out));
                   send.pack();
                   coll::alltoallv(context(op, tag, dl, in), send.data(), sc.data(), sd.data(),
                                   out.data_ptr(), rc.data(), rd.data());
                   send.done();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::Impl::alltoall(std::vector<at::Tensor>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllToAllOptions& opts) {
  const c10d_detail::GroupScope scope(group_name_, getRank(), getSize());
  const char* op = "alltoall";
  c10d_detail::check_alltoall(op, outputs, inputs, getSize());
  const auto n = static_cast<std::size_t>(getSize());
  std::vector<std::size_t> sc(n), rc(n);
  for (std::size_t i = 0; i < n; ++i) {
    sc[i] = nbytes(inputs[i]);
    rc[i] = nbytes(outputs[i]);
  }
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(c10d::OpType::ALLTOALL, op, opts.timeout, opts.asyncOp, ins, outs,
                 [this, ins, outs, sc, rc, op](std::uint32_t tag, Clock::time_point dl) {
                   // Each list as one buffer (bytes): in place where it lies as one block apart
                   // from the other list, else packed.
                   const auto [out_at, out_len] = c10d_detail::extent(outs, rc);
                   const auto [in_at, in_len] = c10d_detail::extent(ins, sc);
                   ListBuffer send(call(tag), ins, sc, ins[0], out_at, out_len);
                   ListBuffer recv(call(tag), outs, rc, ins[0], in_at, in_len);
                   send.pack();
                   coll::alltoallv(context(op, tag, dl, ins[0]), send.data(), sc.data(),
                                   send.displs().data(), recv.data(), rc.data(),
                                   recv.displs().data());
                   send.done();
                   recv.unpack();
                 });
}

// --- the c10d::Backend entry points: forwarded to the Impl -------------------------------------

void ProcessGroupUCX::shutdown() {
  static_cast<void>(impl_->shutdown(true));
  // (Raised once: the destructor, and a second shutdown, have nothing more to say.)
  std::string untold = std::exchange(impl_->untold_, std::string());
  if (!untold.empty()) c10d_detail::throw_backend_error(untold);
}

void ProcessGroupUCX::abort() {
  static_cast<void>(impl_->shutdown(false));
  print_untold(impl_->untold_);
}
uint64_t ProcessGroupUCX::getSequenceNumberForGroup() { return impl_->getSequenceNumberForGroup(); }
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                     int tag) {
  return impl_->send(tensors, dstRank, tag);
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                     int tag) {
  return impl_->recv(tensors, srcRank, tag);
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::recvAnysource(std::vector<at::Tensor>& tensors,
                                                              int tag) {
  return impl_->recvAnysource(tensors, tag);
}
void ProcessGroupUCX::startCoalescing() { impl_->startCoalescing(); }
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::endCoalescing() { return impl_->endCoalescing(); }
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::barrier(const c10d::BarrierOptions& opts) {
  return impl_->checked("barrier", 1, [&] { return impl_->barrier(opts); });
}
void ProcessGroupUCX::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  impl_->monitoredBarrier(opts, wait_all_ranks);
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  return impl_->checked("broadcast", 1, [&] { return impl_->broadcast(tensors, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  // A sparse allreduce takes three tags (sparse_allreduce.cpp), a dense one one.
  const bool sparse = tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse();
  return impl_->checked("allreduce", sparse ? 3 : 1,
                        [&] { return impl_->allreduce(tensors, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return impl_->checked("allreduce_coalesced", 1,
                        [&] { return impl_->allreduce_coalesced(tensors, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  return impl_->checked("reduce", 1, [&] { return impl_->reduce(tensors, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return impl_->checked("allgather", 1, [&] { return impl_->allgather(outputs, inputs, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  return impl_->checked("_allgather_base", 1,
                        [&] { return impl_->_allgather_base(output, input, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return impl_->checked("allgather_coalesced", inputs.size(),
                        [&] { return impl_->allgather_coalesced(outputs, inputs, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return impl_->checked("allgather_into_tensor_coalesced", inputs.size(), [&] {
    return impl_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return impl_->checked("gather", 1, [&] { return impl_->gather(outputs, inputs, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return impl_->checked("scatter", 1, [&] { return impl_->scatter(outputs, inputs, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return impl_->checked("reduce_scatter", 1,
                        [&] { return impl_->reduce_scatter(outputs, inputs, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return impl_->checked("_reduce_scatter_base", 1,
                        [&] { return impl_->_reduce_scatter_base(output, input, opts); });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return impl_->checked("reduce_scatter_tensor_coalesced", inputs.size(), [&] {
    return impl_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) {
  return impl_->checked("alltoall_base", 1, [&] {
    return impl_->alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupUCX::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  return impl_->checked("alltoall", 1, [&] { return impl_->alltoall(outputs, inputs, opts); });
}
std::vector<std::int64_t> ProcessGroupUCX::exchange_lanes(
    const std::string& op, const std::vector<at::Tensor>& sends,
    const std::vector<std::vector<std::int64_t>>& send_bytes, const std::vector<at::Tensor>& recvs,
    const std::vector<std::vector<std::int64_t>>& recv_offsets,
    const std::vector<std::vector<std::int64_t>>& recv_capacity,
    std::chrono::milliseconds timeout) {
  return impl_->exchange_lanes(op, sends, send_bytes, recvs, recv_offsets, recv_capacity, timeout);
}

}  // namespace commux
