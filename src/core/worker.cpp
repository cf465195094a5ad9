// The worker, the progress thread and how a caller waits (docs/progress.md).
#include "worker.hpp"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "engine.hpp"
#include "status.hpp"

namespace commux::detail {

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::chrono::microseconds kMaxSpin{20000};
// A wait spins without yielding this long: a peer that is running answers a small message within
// a few microseconds.
constexpr std::chrono::microseconds kYieldAfter{5};
// How long the progress thread polls without sleeping after the last activity while a driver has
// work listed (Channel::set_driver): a waiter's default spin.
constexpr std::chrono::microseconds kDriveSpin{100};
// How long the progress thread stays parked while a user thread spins, and while user threads
// progress the worker back to back (Worker::user_progress_; from kRecentSpinPark, doubling up to
// kSpinnerPark): between two looks the callers' own waits progress the worker, and each look is
// a wake-up that preempts a caller where cores are few.
constexpr std::chrono::milliseconds kSpinnerPark{10};
constexpr std::chrono::milliseconds kRecentSpinPark{1};
// The progress thread's longest idle nap while work is in flight, and while nothing is.
constexpr std::chrono::microseconds kInFlightNap{2000};
constexpr std::chrono::microseconds kIdleNap{20000};
// A caller that goes to sleep in wait() wakes a progress thread that would sleep on longer than
// this (its idle backoff may have reached kIdleNap while the caller computed), so that the
// message it sleeps on is noticed within about the progress thread's restarted backoff.
constexpr std::chrono::microseconds kSleeperLook{50};
// Set on the progress thread: a wait there (a driver's) must progress itself.
thread_local bool t_progress_thread = false;
}  // namespace

Worker::~Worker() {
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Worker::create(ucp_context_h context, bool wakeup, RuntimeInfo& info) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // serialised by mu_
  check_status(ucp_worker_create(context, &wp, &worker_), "init: ucp_worker_create");
  if (!wakeup || ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;
  info.event_fd = efd_ >= 0;
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw Error(Errc::kTransport, "commux init: eventfd failed");
}

void Worker::destroy_locked() noexcept {
  if (worker_ != nullptr) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
}

void Worker::attach(Engine* engine) {
  std::lock_guard<std::mutex> a(engines_mu_);
  std::lock_guard<std::mutex> b(mu_);
  engines_.push_back(engine);
}

void Worker::detach(Engine* engine) {
  std::lock_guard<std::mutex> a(engines_mu_);
  std::lock_guard<std::mutex> b(mu_);
  engines_.erase(std::remove(engines_.begin(), engines_.end(), engine), engines_.end());
  const auto gone = std::remove_if(drivers_.begin(), drivers_.end(),
                                   [&](const auto& d) { return d.first == engine; });
  driver_count_.fetch_sub(static_cast<int>(drivers_.end() - gone));
  drivers_.erase(gone, drivers_.end());
}

bool Worker::set_driver(Engine* engine, std::shared_ptr<Driver> driver) {
  std::shared_ptr<Driver> old;  // released outside the locks
  bool set = driver == nullptr;
  {
    std::lock_guard<std::mutex> a(engines_mu_);
    auto it = std::find_if(drivers_.begin(), drivers_.end(),
                           [&](const auto& d) { return d.first == engine; });
    if (it != drivers_.end()) {
      old = std::move(it->second);
      if (driver) {
        it->second = std::move(driver);
        set = true;
      } else {
        drivers_.erase(it);
        driver_count_.fetch_sub(1);
      }
    } else if (driver && std::find(engines_.begin(), engines_.end(), engine) != engines_.end()) {
      drivers_.emplace_back(engine, std::move(driver));
      driver_count_.fetch_add(1);
      set = true;
    }
  }
  // A round that copied the old driver before the swap holds drive_mu_ until its calls end.
  if (old && !t_progress_thread) {
    std::lock_guard<std::mutex> g(drive_mu_);
  }
  return set;
}

bool Worker::drive() {
  if (driver_count_.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard<std::mutex> g(drive_mu_);
  {
    std::lock_guard<std::mutex> a(engines_mu_);
    for (const auto& d : drivers_) driving_.push_back(d.second);
  }
  bool listed = false;
  for (const auto& d : driving_) listed = d->drive() || listed;
  driving_.clear();
  return listed;
}

unsigned Worker::progress_locked() {
  if (worker_ == nullptr || shut_down_) return 0;
  const unsigned n = ucp_worker_progress(worker_);
  for (Engine* e : engines_) e->step_locked(n);
  return n;
}

std::size_t Worker::drop_unexpected_locked(std::uint64_t tag, std::uint64_t mask,
                                           Clock::time_point deadline) {
  if (worker_ == nullptr) return 0;
  std::size_t n = 0;
  for (;;) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, tag, mask, 1, &info);
    if (msg == nullptr) return n;
    ++n;
    // A zero-byte receive, failed as truncated: UCX fetches nothing, and a rendezvous sender is
    // released without its buffer being read (as Engine::discard).
    static char sink = 0;
    ucp_request_param_t prm{};
    void* r = ucp_tag_msg_recv_nbx(worker_, &sink, 0, msg, &prm);
    if (!UCS_PTR_IS_PTR(r)) continue;  // done (or failed) at once
    while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(r);
  }
}

std::vector<std::shared_ptr<Op>> Worker::inflight_snapshot_locked() const {
  std::vector<std::shared_ptr<Op>> out;
  for (Op* op = inflight_; op != nullptr; op = op->next) out.push_back(op->self);
  return out;
}

// What the progress thread's eventfd counts: kicks in its low 32 bits, background wake-ups
// (wake_for_background_locked) above them, so that one read tells whether a kick came too.
constexpr std::uint64_t kKickCount = 1;
constexpr std::uint64_t kBackgroundCount = std::uint64_t{1} << 32;

void Worker::signal(std::uint64_t count) noexcept {
  if (wake_fd_ < 0) return;
  [[maybe_unused]] const ssize_t w = ::write(wake_fd_, &count, sizeof(count));
}

void Worker::kick() noexcept { signal(kKickCount); }

void Worker::wake_if_asleep(std::chrono::microseconds late) noexcept {
  if (progress_thread_nap_left() > late) kick();
}

void Worker::wake_for_background_locked() noexcept {
  if (long_sleep_.posted()) signal(kBackgroundCount);
}

Worker::Woke Worker::sleep_until(Clock::time_point end, int other_fd) {
  asleep_until_.store(end.time_since_epoch().count());
  struct Awake {
    std::atomic<std::int64_t>& until;
    ~Awake() { until.store(0); }
  } awake{asleep_until_};
  pollfd fds[2] = {pollfd{wake_fd_, POLLIN, 0}, pollfd{other_fd, POLLIN, 0}};
  const Clock::duration timeout = std::max(Clock::duration::zero(), end - Clock::now());
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  const timespec ts{
      static_cast<time_t>(secs.count()),
      static_cast<long>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(timeout - secs).count())};
  const int r = ::ppoll(fds, other_fd >= 0 ? 2 : 1, &ts, nullptr);
  if (r > 0 && (fds[0].revents & POLLIN)) {
    std::uint64_t drain = 0;
    [[maybe_unused]] const ssize_t got = ::read(wake_fd_, &drain, sizeof(drain));
    return (drain & (kBackgroundCount - 1)) != 0 ? Woke::kKick : Woke::kBackground;
  }
  return r > 0 ? Woke::kFd : Woke::kTimeout;
}

bool Worker::wait_for_kick(std::chrono::microseconds timeout, int other_fd, std::uint64_t posts) {
  const auto end = Clock::now() + timeout;
  // A post may cut a long sleep short (once per sleep: a caller that waits for what it posted
  // costs one wake-up per sleep at most), and so may one that came since the look.
  struct LongSleep {
    LongSleepFlag& flag;
    ~LongSleep() { flag.disarm(); }
  } long_sleep{long_sleep_};
  bool posted = timeout > kBackgroundLate && long_sleep_.arm(posts);
  for (;;) {
    Woke woke = posted ? Woke::kBackground : sleep_until(end, other_fd);
    posted = false;
    if (woke != Woke::kBackground) return woke == Woke::kKick;
    // A transfer above kBackgroundBytes was posted while nobody spun. A caller that goes on to
    // wait for it progresses the worker itself within kBackgroundGrace: then sleep on. One that
    // computes instead leaves it to this thread: return as kicked (no more parking, poll).
    // (A background wake-up meanwhile is stale, from a post that took an earlier sleep's flag:
    // the grace goes on.)
    const std::uint64_t mark = user_progress_.load(std::memory_order_relaxed);
    const auto grace_end = std::min(end, Clock::now() + kBackgroundGrace);
    do {
      woke = sleep_until(grace_end, other_fd);
    } while (woke == Woke::kBackground && Clock::now() < grace_end);
    if (woke == Woke::kKick) return true;
    if (woke == Woke::kFd) return false;
    if (inflight_large_.load() > 0 && spinners_.load() == 0 &&
        user_progress_.load(std::memory_order_relaxed) == mark) {
      return true;
    }
    if (Clock::now() >= end) return false;
  }
}

// ---------------------------------------------------------------------------------------------
// The progress thread

void Worker::start_progress_thread() {
  progress_thread_ = std::thread([this] { progress_thread_main(); });
}

void Worker::stop_progress_thread() {
  stop_.store(true);
  kick();
  if (progress_thread_.joinable()) progress_thread_.join();
}

void Worker::progress_thread_main() {
  t_progress_thread = true;
  // Named for top -H, perf and the tests (at most 15 characters).
  ::pthread_setname_np(::pthread_self(), "commux-progress");
  // Polling mode backs off from 5 us to a cap while nothing happens: responsive right after
  // traffic, nearly free when idle.
  constexpr auto kMinIdle = std::chrono::microseconds(5);
  auto idle = kMinIdle;
  auto next_check = Clock::now();
  auto active = Clock::now();      // the last progress that did something, or kick
  auto held_since = Clock::now();  // since when posts have been held (while any are)
  bool was_holding = false;
  std::uint64_t progress_seen = 0;  // user_progress_ as of the last look
  bool kicked = false;              // the last park ended with a kick
  bool drivers_busy = false;        // a driver had work listed at the last drive()
  auto recent_park = kRecentSpinPark;
  while (!stop_.load()) {
    if (inflight_count_.load() > 0 && Clock::now() >= next_check) {
      {
        std::lock_guard<std::mutex> lock(engines_mu_);  // an Engine stays attached meanwhile
        for (Engine* e : engines_) e->check_local_peers();
      }
      next_check = Clock::now() + std::chrono::milliseconds(200);
    }
    // (parked_ is set before spinners_ is read, so a spinner that stops after this read sees it
    // and kicks.)
    parked_.store(true);
    // (Read before what is in flight: a large post that this misses is seen by the sleep's
    // arming, LongSleepFlag.)
    const std::uint64_t posts = long_sleep_.posts();
    const bool spinning = spinners_.load() > 0;
    const std::uint64_t progressed = user_progress_.load(std::memory_order_relaxed);
    // A user thread is progressing: stay off the CPU until it stops (or 10 ms pass). User
    // threads that progressed since the last look are waiting back to back (short calls in a
    // loop): look again later, from 1 ms up to 10 ms while that goes on, rather than take the
    // worker between their waits, which cost a preemption of a caller at each wake-up where
    // cores are few. Not while anything needs this thread between the callers' waits: a
    // transfer above kBackgroundBytes (it moves only while someone progresses: overlap with
    // the caller's computation), a held post (its gate is polled), a driver's listed work (only
    // this thread resumes it). A kick (a waiter handing progress back or going to sleep, work
    // for a driver) is obeyed at once.
    // Nor while a caller sleeps in wait(): it progressed the worker once before it went to sleep,
    // and now only this thread completes what it waits for. (sleepers_ is read after parked_ is
    // set, and a caller reads parked_ after counting itself a sleeper, so one of the two sees the
    // other: this thread does not park, or the caller kicks it.)
    const bool background =
        drivers_busy || inflight_large_.load() > 0 || held_.load() > 0 || sleepers_.load() > 0;
    if (spinning || (progressed != progress_seen && !kicked && !background)) {
      progress_seen = progressed;
      auto park = kSpinnerPark;
      if (!spinning) {
        park = recent_park;
        recent_park = std::min(recent_park * 2, kSpinnerPark);
      }
      kicked = wait_for_kick(park, -1, posts);
      parked_.store(false);
      idle = kMinIdle;
      continue;
    }
    progress_seen = progressed;
    kicked = false;
    recent_park = kRecentSpinPark;
    parked_.store(false);
    unsigned n = 0;
    bool busy = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (shut_down_) break;
      thread_passes_.fetch_add(1, std::memory_order_relaxed);
      for (int i = 0; i < 256; ++i) {
        const unsigned k = progress_locked();
        n += k;
        if (k == 0) break;
      }
      if (efd_ >= 0 && n == 0) busy = ucp_worker_arm(worker_) == UCS_ERR_BUSY;
    }
    // The layers above resume what this progress completed (Channel::set_driver). What a driver
    // posts either completes in its own progress call or shows up in the next one here.
    const bool driving = drive();
    drivers_busy = driving;
    const auto now = Clock::now();
    if (n > 0) active = now;
    // A driver with work listed expects completions soon (a collective's next step): poll
    // without sleeping for a while after the last activity, as a waiter spins, so that each
    // step does not pay a sleep and a wake-up. Where ranks outnumber cores, yield meanwhile.
    if (driving && n == 0 && now - active < kDriveSpin) {
      if (yield_pays(now)) yield_cpu();
      continue;
    }
    const bool in_flight = inflight_count_.load() > 0;
    // A post held behind a gate (a device stream's event) raises no event when the gate opens:
    // poll for it, backing off from 5 us to kHeldPoll, and once posts have been held for long
    // (a kernel that runs for seconds) up to kHeldPollLong (backoff.hpp: wait_cap).
    const bool holding = held_.load() > 0;
    if (holding && !was_holding) held_since = now;
    was_holding = holding;
    const auto held_cap =
        wait_cap(std::chrono::duration_cast<std::chrono::microseconds>(now - held_since), kHeldPoll,
                 kHeldPollLong);
    if (efd_ >= 0) {
      if (n > 0 || busy) {
        idle = kMinIdle;
        continue;
      }
      if (holding) {
        idle = grow_nap(idle, held_cap);
        if (wait_for_kick(idle, efd_, posts)) idle = kMinIdle;
        continue;
      }
      // Event mode: sleep until the worker's fd fires; wake at least every 10 ms while work is in
      // flight (transports whose pending queues raise no event, keepalive).
      wait_for_kick(std::chrono::milliseconds(in_flight ? 10 : 100), efd_, posts);
      continue;
    }
    if (n > 0) {
      idle = kMinIdle;
      continue;
    }
    // Grow by 1/4 per idle poll: the interval stays about a fifth of the time since the last
    // activity, so a completion is noticed late by at most ~20% of the wait, and a long wait
    // settles at the cap (2 ms while work is in flight, 20 ms otherwise).
    const auto cap = holding ? held_cap : in_flight ? kInFlightNap : kIdleNap;
    idle = grow_nap(idle, cap);
    if (wait_for_kick(idle, -1, posts)) {
      idle = kMinIdle;
      active = Clock::now();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Waiting: spin, then sleep

bool Worker::wait_on_progress_thread(Op& op, Clock::time_point deadline) {
  auto idle = std::chrono::microseconds(1);
  for (;;) {
    unsigned n = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      n = progress_locked();
    }
    if (op.done.load() || op.abandoned.load()) return true;
    if (Clock::now() >= deadline) return false;
    if (n > 0) {
      idle = std::chrono::microseconds(1);
      continue;
    }
    idle = std::min(idle * 2, std::chrono::microseconds(1000));
    std::this_thread::sleep_for(idle);
  }
}

bool Worker::yield_cpu() noexcept {
  if (yield_mode() == YieldMode::kAlways) {
    ::sched_yield();
    return true;
  }
  const auto t0 = Clock::now();
  ::sched_yield();
  return yield_gate_.record(t0, Clock::now());
}

bool Worker::wait(Op& op, std::chrono::milliseconds timeout, std::chrono::microseconds spin,
                  bool hand_back) {
  if (op.done.load()) return true;
  // A driver's wait (Channel::set_driver) on the progress thread: nobody else progresses.
  if (t_progress_thread) return wait_on_progress_thread(op, Clock::now() + timeout);
  {  // one progress call before anything else: most small messages complete here
    std::lock_guard<std::mutex> lock(mu_);
    // (A wait that will not spin, the later slices of a wait in slices, sleeps on the progress
    // thread's work: not counted as a caller progressing the worker itself.)
    if (spin.count() >= 0) {
      user_progress_locked();
    } else {
      progress_locked();
    }
  }
  if (op.done.load()) return true;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  // Spin at least `spin`, and longer for large messages: while a rendezvous of N bytes is under
  // way its completion is expected within about N / (2 GB/s), and sleeping through it would add
  // the progress thread's poll interval to every large transfer.
  const auto expected = std::chrono::microseconds(op.capacity / 2000);
  const auto spin_until =
      spin.count() < 0
          ? start
          : std::min(deadline,
                     start + std::clamp<std::chrono::microseconds>(expected, spin, kMaxSpin));
  // A poll that finds nothing to do yields the CPU once the wait has outlived kYieldAfter (the
  // peer may need this CPU to answer: the machine is busier than it has cores), unless a recent
  // yield handed the CPU to a foreign task for a whole slice (YieldGate), and from the first poll
  // in yield mode (this host's ranks outnumber its CPUs).
  const YieldMode mode = yield_mode();
  const auto yield_from = mode == YieldMode::kAlways ? start : start + kYieldAfter;
  bool yield = mode == YieldMode::kAlways;
  // spin < 0: the caller spun already (a wait in slices): straight to sleep, leaving the progress
  // thread's backoff as it is.
  if (spin.count() >= 0) spinners_.fetch_add(1);
  for (unsigned iter = 1; spin.count() >= 0 && !op.done.load() && !op.abandoned.load(); ++iter) {
    unsigned n = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      n = user_progress_locked();
    }
    if (yield && n == 0) yield = yield_cpu();
    if ((iter & 15) == 0) {
      const auto now = Clock::now();
      if (now >= spin_until) break;
      yield = now >= yield_from && yield_pays(now);
    }
  }
  const int left = spin.count() >= 0 ? spinners_.fetch_sub(1) - 1 : spinners_.load();
  if (op.done.load()) {
    // Hand background progress back to the progress thread at once if a transfer that needs it
    // is in flight. Small operations complete at the next progress call anyone makes, at the
    // latest the parked progress thread's own (within 10 ms): waking it for them cost a context
    // switch per wait where threads outnumber cores (4 ranks on 2 cores: 8 B barrier 36 us with
    // the wake-up, 3.6 us without). Nor is it woken for nothing: only if a large transfer is in
    // flight, or a sleeping thread waits for it to progress while it stays off.
    // Not for a transfer in flight where the caller goes on progressing (`hand_back` false: a
    // collective's waits, a driver of schedules, where the ranks have a CPU each and none to
    // spare: Engine::await): each such wake-up took a CPU from a rank on the 2-core development
    // VM (8 allreduces of 64 KiB in flight as schedules: 1.98-2.77x the time of 8 blocking ones
    // with it, 1.37-1.51x without; bench/experiments/schedule_burst.cpp). The call's end hands
    // them back (hand_back()).
    if (left == 0 &&
        ((hand_back && inflight_large_.load() > 0) || (sleepers_.load() > 0 && parked_.load()))) {
      kick();
    }
    return true;
  }
  sleepers_.fetch_add(1);
  // The progress thread completes what this thread sleeps on: wake it if it stayed off for a
  // spinner (this one), or if it is in a nap that ends later than this wait can afford: a wait
  // that has just stopped spinning expects its message soon, and the progress thread's backoff
  // may have grown to kIdleNap while the caller computed (a barrier after a long computation then
  // returned up to 20 ms after the last rank arrived). The later slices of a wait in slices
  // (spin < 0) have waited for long: a nap within the in-flight cap is soon enough for them,
  // and one that is polling keeps its backoff (a kick would reset it to 5 us: a wait in 10 ms
  // slices then cost thousands of polls a second). So is it where the ranks outnumber the CPUs
  // (yield mode): there each wake-up and poll takes a CPU from a rank (4 ranks on 2 CPUs, 8 B
  // all_gather through torch: 1.14x the time when every sleeper cut naps beyond 50 us).
  // (In wakeup mode the progress thread sleeps on the worker's event fd, which the message
  // fires: no nap to cut.)
  const bool soon = spin.count() >= 0 && mode != YieldMode::kAlways;
  if (left == 0 && parked_.load()) {
    kick();
  } else if (efd_ < 0) {
    wake_if_asleep(soon ? kSleeperLook : kInFlightNap);
  }
  {
    std::unique_lock<std::mutex> lock(done_mu_);
    done_cv_.wait_until(lock, deadline, [&] { return op.done.load() || op.abandoned.load(); });
  }
  sleepers_.fetch_sub(1);
  return op.done.load() || op.abandoned.load();
}

}  // namespace commux::detail
