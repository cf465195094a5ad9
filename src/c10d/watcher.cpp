#include "watcher.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>

#include "commux/error.hpp"
#include "errors.hpp"

namespace commux::c10d_detail {

void FutureWatcher::track(c10::intrusive_ptr<P2PWork> work) { watch(std::move(work), false); }

void FutureWatcher::add(c10::intrusive_ptr<P2PWork> work) { watch(std::move(work), true); }

void FutureWatcher::watch(c10::intrusive_ptr<P2PWork> work, bool maybe_watched) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stopping_) {
    lk.unlock();
    work->poll_future();
    return;
  }
  if (maybe_watched && std::find(watched_.begin(), watched_.end(), work) != watched_.end()) return;
  watched_.push_back(std::move(work));
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  lk.unlock();
  cv_.notify_one();
}

bool FutureWatcher::release(P2PWork* work) {
  // Settles a future first (outside the lock: its callbacks may post more operations).
  if (!work->poll_future()) return false;
  c10::intrusive_ptr<P2PWork> gone;  // the caller holds `work`: nothing is destroyed here
  std::lock_guard<std::mutex> lk(mu_);
  auto it = std::find_if(watched_.begin(), watched_.end(),
                         [&](const c10::intrusive_ptr<P2PWork>& p) { return p.get() == work; });
  if (it == watched_.end()) return true;
  gone = std::move(*it);
  watched_.erase(it);
  return true;
}

void FutureWatcher::loop() {
  // Polls with a backoff (20 us .. 2 ms) while anything is in flight, sleeps while nothing is.
  auto idle = std::chrono::microseconds(20);
  for (;;) {
    std::vector<c10::intrusive_ptr<P2PWork>> batch;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !watched_.empty(); });
      if (stopping_) return;
      batch = watched_;
    }
    std::vector<P2PWork*> settled;
    for (auto& p : batch) {
      if (p->poll_future()) settled.push_back(p.get());
    }
    if (!settled.empty()) {
      std::vector<c10::intrusive_ptr<P2PWork>> gone;  // destroyed outside the lock
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto keep = std::stable_partition(
            watched_.begin(), watched_.end(), [&](const c10::intrusive_ptr<P2PWork>& p) {
              return std::find(settled.begin(), settled.end(), p.get()) == settled.end();
            });
        gone.assign(std::make_move_iterator(keep), std::make_move_iterator(watched_.end()));
        watched_.erase(keep, watched_.end());
      }
      idle = std::chrono::microseconds(20);
    } else {
      idle = std::min(idle * 2, std::chrono::microseconds(2000));
    }
    batch.clear();  // the last references to released Works go before the sleep
    std::this_thread::sleep_for(idle);
  }
}

void FutureWatcher::stop() {
  std::vector<c10::intrusive_ptr<P2PWork>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    left.swap(watched_);
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
