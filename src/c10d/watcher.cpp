#include "watcher.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>

#include "commux/error.hpp"
#include "errors.hpp"

namespace commux::c10d_detail {

void FutureWatcher::add(c10::intrusive_ptr<P2PWork> work) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_) {
    work->poll_future();
    return;
  }
  watched_.push_back(std::move(work));
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
}

void FutureWatcher::loop() {
  // Polls with a backoff (20 us .. 2 ms): futures of p2p Works are rare (batch_isend_irecv
  // callers wait()), so this thread exists only once someone asked for one.
  auto idle = std::chrono::microseconds(20);
  for (;;) {
    std::vector<c10::intrusive_ptr<P2PWork>> batch;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      batch = watched_;
    }
    std::vector<P2PWork*> settled;
    for (auto& p : batch) {
      if (p->poll_future()) settled.push_back(p.get());
    }
    if (!settled.empty()) {
      std::lock_guard<std::mutex> lk(mu_);
      watched_.erase(std::remove_if(watched_.begin(), watched_.end(),
                                    [&](const c10::intrusive_ptr<P2PWork>& p) {
                                      return std::find(settled.begin(), settled.end(), p.get()) !=
                                             settled.end();
                                    }),
                     watched_.end());
      idle = std::chrono::microseconds(20);
    } else {
      idle = std::min(idle * 2, std::chrono::microseconds(2000));
    }
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
  if (thread_.joinable()) thread_.join();
  for (auto& p : left) {
    if (!p->poll_future()) {
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
