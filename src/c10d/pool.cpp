#include "pool.hpp"

#include "work.hpp"

#include <pthread.h>

#include <algorithm>
#include <thread>

namespace commux::c10d_detail {

CollectivePool& CollectivePool::instance() {
  static CollectivePool* pool =
      new CollectivePool();  // never destroyed: threads may outlive statics
  return *pool;
}

void CollectivePool::submit(Client* client) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!idle_.empty()) {
      // The thread that went idle last: the likeliest to be still awake or cache-warm, and the
      // ones below it keep idling until they retire.
      Idle* t = idle_.back();
      idle_.pop_back();
      t->client = client;
      t->cv.notify_one();  // under mu_: the thread may retire (and its Idle go) once it is free
      return;
    }
    ++threads_;
  }
  std::thread([this, client] { loop(client); }).detach();
}

int CollectivePool::threads() {
  std::lock_guard<std::mutex> lk(mu_);
  return threads_;
}

void CollectivePool::loop(Client* client) {
  // Named for top -H, perf and the tests; a thread takes the name of the one that starts it, so
  // one started from the core's progress thread (a future handed on from there) would otherwise
  // be shown as that thread.
  ::pthread_setname_np(::pthread_self(), "commux-pool");
  CallbackScope::on_commux_thread();  // the futures it completes: see work.hpp
  Idle self;
  for (;;) {
    client->serve();  // the client may be gone once this returns
    std::unique_lock<std::mutex> lk(mu_);
    self.client = nullptr;
    idle_.push_back(&self);
    if (!self.cv.wait_for(lk, kRetireAfter, [&] { return self.client != nullptr; })) {
      idle_.erase(std::find(idle_.begin(), idle_.end(), &self));
      --threads_;
      return;
    }
    client = self.client;
  }
}

}  // namespace commux::c10d_detail
