#include "watcher.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>

#include "commux/error.hpp"
#include "errors.hpp"

namespace commux::c10d_detail {

namespace {
// A Work kept only to release it (no future asked for) is checked this often: the user's wait()
// releases it at once, so this only bounds how long a Work the user dropped keeps its tensors.
// Slow on purpose: the posting thread never wakes this one (on a 2-core machine a wake-up per
// operation costs more than the operation).
constexpr auto kReleasePeriod = std::chrono::milliseconds(10);
// Nothing watched for this long: the thread ends (the next Work starts one): a group with no p2p
// in flight holds no thread.
constexpr auto kIdleBeforeSleep = std::chrono::seconds(1);
}  // namespace

void FutureWatcher::track(c10::intrusive_ptr<P2PWork> work) { watch(std::move(work), false); }

void FutureWatcher::add(c10::intrusive_ptr<P2PWork> work) { watch(std::move(work), true); }

void FutureWatcher::watch(c10::intrusive_ptr<P2PWork> work, bool future) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stopping_) {
    lk.unlock();
    work->poll_future();
    return;
  }
  // A Work is tracked once, when it is posted: only a later add() (its future) can find it here.
  auto it = future ? std::find_if(watched_.begin(), watched_.end(),
                                  [&](const Entry& e) { return e.work == work; })
                   : watched_.end();
  if (it == watched_.end()) {
    watched_.push_back(Entry{std::move(work), future});
    futures_ += future ? 1 : 0;
  } else if (future && !it->future) {
    it->future = true;
    ++futures_;
  } else {
    return;
  }
  if (retired_) {
    thread_.join();  // it has returned from loop() already, or is about to
    retired_ = false;
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  // Wake the thread only where it matters: a future to complete promptly. A plain p2p post does
  // not wake it otherwise.
  const bool wake = future;
  lk.unlock();
  if (wake) cv_.notify_one();
}

bool FutureWatcher::release(P2PWork* work) {
  // Settles a future first (outside the lock: its callbacks may post more operations).
  if (!work->poll_future()) return false;
  c10::intrusive_ptr<P2PWork> gone;  // the caller holds `work`: nothing is destroyed here
  std::lock_guard<std::mutex> lk(mu_);
  auto it = std::find_if(watched_.begin(), watched_.end(),
                         [&](const Entry& e) { return e.work.get() == work; });
  if (it == watched_.end()) return true;
  futures_ -= it->future ? 1 : 0;
  gone = std::move(it->work);
  watched_.erase(it);
  return true;
}

void FutureWatcher::loop() {
  CallbackScope::on_commux_thread();  // the futures it completes: see work.hpp
  // With futures to complete: polls with a backoff (20 us .. 2 ms). With only Works to release:
  // every kReleasePeriod. With nothing for kIdleBeforeSleep: asleep until watch() wakes it.
  auto backoff = std::chrono::microseconds(20);
  auto empty_since = std::chrono::steady_clock::now();
  for (;;) {
    std::vector<c10::intrusive_ptr<P2PWork>> batch;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (futures_ == 0) {
        if (watched_.empty() &&
            std::chrono::steady_clock::now() - empty_since >= kIdleBeforeSleep) {
          retired_ = true;  // the next watch() joins this thread and starts another
          return;
        } else {
          cv_.wait_for(lk, kReleasePeriod, [&] { return stopping_ || futures_ > 0; });
        }
      }
      if (stopping_) return;
      if (watched_.empty()) continue;
      batch.reserve(watched_.size());
      for (const Entry& e : watched_) batch.push_back(e.work);
    }
    std::vector<P2PWork*> settled;
    for (auto& p : batch) {
      if (p->poll_future()) settled.push_back(p.get());
    }
    bool futures_left = false;
    {
      std::vector<c10::intrusive_ptr<P2PWork>> gone;  // destroyed outside the lock
      std::unique_lock<std::mutex> lk(mu_);
      if (!settled.empty()) {
        auto keep = std::stable_partition(watched_.begin(), watched_.end(), [&](const Entry& e) {
          return std::find(settled.begin(), settled.end(), e.work.get()) == settled.end();
        });
        for (auto i = keep; i != watched_.end(); ++i) {
          futures_ -= i->future ? 1 : 0;
          gone.push_back(std::move(i->work));
        }
        watched_.erase(keep, watched_.end());
      }
      if (watched_.empty()) empty_since = std::chrono::steady_clock::now();
      futures_left = futures_ > 0;
      lk.unlock();
    }
    batch.clear();  // the last references to released Works go before the sleep
    if (!futures_left) {
      backoff = std::chrono::microseconds(20);
      continue;
    }
    backoff = settled.empty() ? std::min(backoff * 2, std::chrono::microseconds(2000))
                              : std::chrono::microseconds(20);
    std::this_thread::sleep_for(backoff);
  }
}

void FutureWatcher::stop() {
  std::vector<c10::intrusive_ptr<P2PWork>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    for (Entry& e : watched_) left.push_back(std::move(e.work));
    watched_.clear();
    futures_ = 0;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& p : left) {
    if (!p->poll_future()) {
      std::lock_guard<std::mutex> settling(p->settle_mu_);
      std::lock_guard<std::mutex> lk(p->future_mu_);
      if (p->future_ && !p->future_->completed()) {
        p->future_->setError(to_torch_error(std::make_exception_ptr(
            Error(Errc::kCanceled,
                  "commux p2p: the process group was shut down before the operation finished"))));
      }
    }
  }
}

}  // namespace commux::c10d_detail
