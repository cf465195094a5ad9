#include "pool.hpp"

#include "work.hpp"

#include <pthread.h>

#include <thread>

namespace commux::c10d_detail {

CollectivePool& CollectivePool::instance() {
  static CollectivePool* pool =
      new CollectivePool();  // never destroyed: threads may outlive statics
  return *pool;
}

void CollectivePool::submit(Client* client) {
  std::unique_lock<std::mutex> lk(mu_);
  ready_.push_back(client);
  // Every ready client needs a thread of its own: wake a waiting one if there are enough of them
  // for all ready clients (a notified thread still counts as waiting until it runs), else start
  // one more.
  if (static_cast<std::size_t>(waiting_) >= ready_.size()) {
    lk.unlock();
    cv_.notify_one();
    return;
  }
  ++threads_;
  lk.unlock();
  std::thread([this] { loop(); }).detach();
}

int CollectivePool::threads() {
  std::lock_guard<std::mutex> lk(mu_);
  return threads_;
}

void CollectivePool::loop() {
  // Named for top -H, perf and the tests; a thread takes the name of the one that starts it, so
  // one started from the core's progress thread (a future handed on from there) would otherwise
  // be shown as that thread.
  ::pthread_setname_np(::pthread_self(), "commux-pool");
  CallbackScope::on_commux_thread();  // the futures it completes: see work.hpp
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    ++waiting_;
    const bool got = cv_.wait_for(lk, kRetireAfter, [&] { return !ready_.empty(); });
    --waiting_;
    if (!got) {
      --threads_;
      return;
    }
    Client* c = ready_.front();
    ready_.pop_front();
    lk.unlock();
    c->serve();  // the client may be gone once this returns
    lk.lock();
  }
}

}  // namespace commux::c10d_detail
