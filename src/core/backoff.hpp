// Polling for something that raises no event (a device stream's event, a post's gate): naps that
// grow by a quarter (and a microsecond) each, up to a cap; the progress thread's own idle polls
// grow the same way (grow_nap), with a cap that depends on what is in flight.
// The naps before the k-th add up to about four times it, so whatever the poll waits for is
// noticed late by at most about a quarter of the time waited so far, and never by more than the
// cap. (Doubling naps let a 1 ms cap be missed by up to the whole last nap: a stream that finished
// 40 us after a poll was seen up to 1 ms late.)
// A long wait (a post held behind a kernel that runs for seconds) does not keep polling at the
// short cap: once the wait has lasted kLongWaitRatio times the cap, the cap grows with it, up to
// a long cap, so the end is still seen within about 1/64 of the time waited (under 2%), and a wait
// of seconds settles at one poll per long cap. (At a 250 us cap, a post held for 3 s cost 7% of a
// core on a slow VM; at 1 ms it costs about a quarter of that.)
// YieldGate, below, decides the same kind of question for a spinning waiter: whether yielding
// the CPU pays, and LongSleepFlag whether a post must wake the progress thread from a long sleep.
// Internal to commux (src/core, and src/c10d's device fences). Torch-free and UCX-free.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace commux::detail {

// The cap of the polls for a device stream's event (a fence before a post or a collective): a
// stream whose work ends in the first 16 ms of a wait is seen within this...
inline constexpr std::chrono::microseconds kEventPollCap{250};
// ...and one that ends later within 1/kLongWaitRatio of the wait, never more than this: a wait
// of seconds polls about 1000 times a second.
inline constexpr std::chrono::microseconds kEventPollLongCap{1000};
inline constexpr int kLongWaitRatio = 64;

// The cap for a nap after `waited`: `cap` until waited / kLongWaitRatio passes it, then that, up
// to `long_cap` (taken as at least `cap`).
constexpr std::chrono::microseconds wait_cap(std::chrono::microseconds waited,
                                             std::chrono::microseconds cap,
                                             std::chrono::microseconds long_cap) noexcept {
  return std::clamp(waited / kLongWaitRatio, cap, std::max(cap, long_cap));
}

// The nap after `nap`: a quarter (and a microsecond) longer, at most `cap`.
constexpr std::chrono::microseconds grow_nap(std::chrono::microseconds nap,
                                             std::chrono::microseconds cap) noexcept {
  return std::min(cap, nap + nap / 4 + std::chrono::microseconds(1));
}

class PollBackoff {
 public:
  // Naps from `first` up to `cap`, and in a long wait up to `long_cap` (wait_cap; pass `cap`
  // again for none).
  constexpr PollBackoff(std::chrono::microseconds first, std::chrono::microseconds cap,
                        std::chrono::microseconds long_cap) noexcept
      : first_(first),
        cap_(std::max(cap, first)),
        long_cap_(std::max(long_cap, cap_)),
        nap_(first) {}
  // The nap to take now; the next one is a quarter longer.
  std::chrono::microseconds next() noexcept {
    const std::chrono::microseconds n = nap_;
    waited_ += n;
    nap_ = grow_nap(nap_, wait_cap(waited_, cap_, long_cap_));
    return n;
  }
  // Something happened: the next nap is the first again, and the wait starts over.
  void reset() noexcept {
    nap_ = first_;
    waited_ = std::chrono::microseconds(0);
  }

 private:
  std::chrono::microseconds first_;
  std::chrono::microseconds cap_;
  std::chrono::microseconds long_cap_;
  std::chrono::microseconds nap_;
  std::chrono::microseconds waited_{0};  // the naps taken since the start (or reset)
};

// Whether a waiter's sched_yield() pays. It does where the only other runnable threads are the
// ranks (and threads) it waits for: each yields back within microseconds. It does not where a
// foreign CPU hog (a compile, a data loader) shares the CPU: since Linux 6.6 (EEVDF) a yield
// pushes the yielder's deadline a whole slice back, so every yield hands the hog a slice of
// about 1.5 ms, and an 8 B allreduce between two ranks beside two busy loops took 1.7 ms (10 us
// with this gate; bench/experiments/busy_neighbour.py). So a yield that took longer than kSlow
// shuts the gate; meanwhile waiters spin without yielding (then sleep as always), and the first
// yield after it probes again.
// How long it stays shut grows with the evidence: kFirstOff after a first slow yield, twice the
// last period after one that came within kForget of the gate's last reopening (the hog is still
// there), up to kMaxOff. A single slow yield is common where no hog is: right after
// init_process_group some start-up thread of the process ran a slice, and a fixed 100 ms period
// then left the two ranks' main threads, queued on one CPU meanwhile, unable to hand it to each
// other: 8 B exchanges took 250 us instead of 13 for those 100 ms, in a fifth of the launches
// (bench/experiments/first_calls.py). Beside a hog, the probes at 1, 3, 7, ... ms cost seven
// slices in the first 130 ms, then one per kMaxOff as before.
// Shared by the threads of a process (relaxed atomics: a late view costs one yield).
class YieldGate {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::microseconds kSlow{200};
  static constexpr std::chrono::milliseconds kFirstOff{1};
  static constexpr std::chrono::milliseconds kMaxOff{100};
  static constexpr std::chrono::milliseconds kForget{400};

  bool open(Clock::time_point now) const noexcept {
    return now.time_since_epoch().count() >= shut_until_.load(std::memory_order_relaxed);
  }
  // A yield that began at `t0` returned at `t1`: whether yielding still pays (false: it was slow,
  // and the gate is shut from t1 for the period above).
  bool record(Clock::time_point t0, Clock::time_point t1) noexcept {
    if (t1 - t0 < kSlow) return true;
    const Clock::rep reopened = shut_until_.load(std::memory_order_relaxed);
    // Shut by another thread while this one yielded: that thread's period stands (two slow yields
    // of one slice do not double it).
    if (reopened > t0.time_since_epoch().count()) return false;
    const Clock::duration last{off_for_.load(std::memory_order_relaxed)};
    const bool again = reopened != 0 && t1.time_since_epoch() - Clock::duration(reopened) < kForget;
    // (At least kFirstOff: a thread that sees another's shut_until_ before its off_for_, where
    // relaxed stores may be seen out of order, must not double a zero into a gate that never
    // shuts.)
    const Clock::duration off = again ? std::clamp<Clock::duration>(2 * last, kFirstOff, kMaxOff)
                                      : Clock::duration(kFirstOff);
    off_for_.store(off.count(), std::memory_order_relaxed);
    shut_until_.store((t1 + off).time_since_epoch().count(), std::memory_order_relaxed);
    return false;
  }

 private:
  std::atomic<Clock::rep> shut_until_{0};  // steady_clock ticks; 0: never shut
  std::atomic<Clock::rep> off_for_{0};     // the last period, in ticks
};

// Whether a post above Worker::kBackgroundBytes must cut the progress thread's long sleep short
// (Worker::wake_for_background_locked). The thread looks at what is in flight, decides to sleep
// long, and arms; a post that lands between that look and the arming finds the flag down and
// signals nothing, and the sleep ran to its end (up to 10 ms) with the transfer unmoved unless its
// caller waited. So each side announces itself before it looks at the other (Dekker's pattern:
// sequentially consistent atomics): a post counts itself, then reads the flag; the sleeper raises
// the flag, then reads the count. At least one of them sees the other, and the flag's exchange
// lets exactly one act: the post signals the eventfd, or arm() tells the sleeper to treat the post
// as that signal. Once per sleep, as before.
class LongSleepFlag {
 public:
  // The count of posts so far: read at the look that precedes a sleep, and handed to arm().
  std::uint64_t posts() const noexcept { return posts_.load(); }
  // A post: true when it must wake the sleeper (it took the flag).
  bool posted() noexcept {
    posts_.fetch_add(1);
    // (Read first: raised only around long sleeps, so a post costs next to nothing meanwhile.)
    return armed_.load() && armed_.exchange(false);
  }
  // Before a long sleep whose look read `seen`: raises the flag; true when a post came since the
  // look that took no flag (nothing will signal it: act as if signalled, without sleeping first).
  bool arm(std::uint64_t seen) noexcept {
    armed_.store(true);
    return posts_.load() != seen && armed_.exchange(false);
  }
  // After the sleep (a post that took the flag meanwhile has signalled, or is about to).
  void disarm() noexcept { armed_.store(false, std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> posts_{0};
  std::atomic<bool> armed_{false};
};

}  // namespace commux::detail
